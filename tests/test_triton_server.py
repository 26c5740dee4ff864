"""A real tritonserver (from the nvidia-pytriton wheel) serving a generated repository, checked against the runtime.

One server per module (started once, stopped by the fixture), on free loopback ports. Greedy decoding, so the server's
text must equal ``SpeculativeGenerator.generate``'s exactly.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")

from conftest import has_tritonserver  # noqa: E402

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(
        not has_tritonserver(), reason="needs nvidia-pytriton's tritonserver (pip install --no-deps nvidia-pytriton)"
    ),
]

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "Speculative decoding keeps",
    "for i in range(10):",
    "Ünïcödé café",
    "日本語の",
    "emoji 🙂",
    "print(i * i)",
]
MAX_TOKENS = 24


# --- fixtures ---------------------------------------------------------------------------------------------------


def _serve(bundle, out, **options):
    from triton_repo.generate import RepoOptions, write_repository
    from triton_repo.server import start_server

    repo = write_repository(bundle, out, RepoOptions(threads=1, **options))
    return start_server(repo, timeout=180)


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    # plan=False: k drafted every step, as generate() does, so the draft counts compare exactly (the planned server
    # is test_smollm2_through_triton's)
    handle = _serve(tiny_bundle, tmp_path_factory.mktemp("triton") / "repo", max_batch_size=16, plan=False)
    yield handle
    handle.stop()
    assert handle.process.returncode is not None
    assert not handle.log_kept and not handle.log_path.exists()  # a clean stop removes its temporary log


@pytest.fixture(scope="module")
def expected(generator):
    """What the Python runtime answers for every prompt (text, acceptance stats)."""
    return {p: generator.generate(p, max_new_tokens=MAX_TOKENS, plan=False) for p in PROMPTS}  # k every step


# --- clients ----------------------------------------------------------------------------------------------------


def http_generate(server, body: dict, stream: bool = False):
    url = f"{server.url}/v2/models/ensemble/generate" + ("_stream" if stream else "")
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read().decode()
    if not stream:
        return json.loads(raw)
    return [json.loads(line[len("data: ") :]) for line in raw.splitlines() if line.startswith("data: ")]


def http_error(server, body: dict) -> str:
    with pytest.raises(urllib.error.HTTPError) as info:
        http_generate(server, body)
    return info.value.read().decode()


def grpc_inputs(text, max_tokens, stream=False, extra=None):
    """Inputs of one ensemble request; ``extra``: name -> (array, Triton dtype), replacing or adding inputs."""
    import tritonclient.grpc as grpcclient

    arrays = {
        "text_input": (np.array([[text if isinstance(text, bytes) else text.encode()]], dtype=object), "BYTES"),
        "max_tokens": (np.array([[max_tokens]], dtype=np.int32), "INT32"),
        "stream": (np.array([[stream]], dtype=bool), "BOOL"),
    }
    arrays.update(extra or {})
    inputs = []
    for name, (array, dtype) in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class Stream:
    """A gRPC bidirectional stream; ``collect`` returns one request's responses up to its final one (or its error)."""

    def __init__(self, server):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.results = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def collect(self, inputs, timeout=60):
        self.client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        responses = []
        while True:
            result, error = self.results.get(timeout=timeout)
            if error is not None:
                return responses, error
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.as_numpy("text_output") is not None:
                responses.append(result)
            if final:
                return responses, None

    def close(self):
        self.client.stop_stream()
        self.client.close()


def metrics_text(server) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        return response.read().decode()


def metrics(server) -> dict[str, float]:
    text = metrics_text(server)
    found = {}
    for name, value in re.findall(r"^(draftsmith_\w+)\{[^}]*\} (\S+)$", text, re.M):
        found[name] = found.get(name, 0.0) + float(value)
    return found


# --- tests ------------------------------------------------------------------------------------------------------


def test_generate_endpoint_equals_runtime(server, expected):
    for prompt in PROMPTS[:4]:
        out = http_generate(server, {"text_input": prompt, "max_tokens": MAX_TOKENS})
        want = expected[prompt]
        assert out["text_output"] == want.text
        assert out["total_draft_tokens"] == want.stats.num_draft_tokens
        assert out["total_accepted_draft_tokens"] == want.stats.num_accepted_tokens
        assert out["acceptance_rate"] == pytest.approx(want.stats.draft_acceptance_rate, abs=1e-6)


def test_generate_stream_endpoint_concatenates(server, expected):
    prompt = PROMPTS[0]
    events = http_generate(server, {"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True}, stream=True)
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == expected[prompt].text
    assert events[-1]["total_draft_tokens"] == expected[prompt].stats.num_draft_tokens


def test_grpc_stream_is_incremental(server, expected):
    stream = Stream(server)
    try:
        for prompt in PROMPTS[:3]:
            responses, error = stream.collect(grpc_inputs(prompt, MAX_TOKENS, stream=True))
            assert error is None
            pieces = [r.as_numpy("text_output").reshape(-1)[0].decode() for r in responses]
            assert len([p for p in pieces if p]) > 1, pieces  # tokens arrive as they are accepted
            assert "".join(pieces) == expected[prompt].text
            drafted = int(responses[-1].as_numpy("total_draft_tokens").reshape(-1)[0])  # totals come with the last
            assert drafted == expected[prompt].stats.num_draft_tokens
            whole, error = stream.collect(grpc_inputs(prompt, MAX_TOKENS, stream=False))
            assert error is None and len(whole) == 1
            assert whole[0].as_numpy("text_output").reshape(-1)[0].decode() == expected[prompt].text
    finally:
        stream.close()


def test_sixteen_clients_twenty_requests_each(server, expected):
    before = metrics(server)

    def client(c: int) -> list[tuple[str, str]]:
        return [
            (p, http_generate(server, {"text_input": p, "max_tokens": MAX_TOKENS})["text_output"])
            for p in (PROMPTS[(c + i) % len(PROMPTS)] for i in range(20))
        ]

    with ThreadPoolExecutor(16) as pool:
        answers = [a for batch in pool.map(client, range(16)) for a in batch]
    assert len(answers) == 16 * 20
    wrong = [(p, got) for p, got in answers if got != expected[p].text]
    assert not wrong, wrong[:3]
    after = metrics(server)
    assert after["draftsmith_requests_total"] - before["draftsmith_requests_total"] == 320
    # concurrent requests shared verify calls: fewer batched calls than per-sequence steps
    calls = after["draftsmith_target_calls_total"] - before["draftsmith_target_calls_total"]
    steps = after["draftsmith_verify_steps_total"] - before["draftsmith_verify_steps_total"]
    assert calls < steps
    assert server.ready()


def test_malformed_requests_get_errors_and_server_keeps_serving(server, expected, generator):
    assert "text_input" in http_error(server, {"max_tokens": 8})
    assert "max_tokens" in http_error(server, {"text_input": "hi", "max_tokens": 0})
    assert "max_tokens" in http_error(server, {"text_input": "hi", "max_tokens": 100_000})
    assert "parse" in http_error(server, {"text_input": "hi", "max_tokens": "eight"})  # Triton's own JSON check
    assert "num_draft_tokens" in http_error(
        server, {"text_input": "hi", "max_tokens": 8, "num_draft_tokens": generator.max_k + 1}
    )
    assert "num_draft_tokens" in http_error(server, {"text_input": "hi", "max_tokens": 8, "num_draft_tokens": -1})
    assert "top_p" in http_error(server, {"text_input": "hi", "max_tokens": 8, "top_p": 2.0})
    assert "empty" in http_error(server, {"text_input": "", "max_tokens": 8})
    assert "tokens" in http_error(server, {"text_input": "word " * 200, "max_tokens": 8})
    stream = Stream(server)
    try:
        _, error = stream.collect(grpc_inputs(b"\xff\xfe broken", 8))
        assert error is not None and "UTF-8" in str(error)
        wrong_dtype = {"max_tokens": (np.array([[8.0]], np.float32), "FP32")}
        _, error = stream.collect(grpc_inputs("hi", 8, extra=wrong_dtype))
        assert error is not None and "max_tokens" in str(error) and "FP32" in str(error).upper()
        half_character = {"stop_words": (np.array([[b"\xc3"]], dtype=object), "BYTES")}
        _, error = stream.collect(grpc_inputs("hi", 8, extra=half_character))
        assert error is not None and "stop_words" in str(error)
        responses, error = stream.collect(grpc_inputs(PROMPTS[1], MAX_TOKENS))  # still serving
        assert error is None
        assert responses[-1].as_numpy("text_output").reshape(-1)[0].decode() == expected[PROMPTS[1]].text
    finally:
        stream.close()
    assert server.ready()
    assert metrics(server)["draftsmith_request_errors_total"] >= 4


def test_parameters_reach_the_runtime(server, generator):
    prompt = PROMPTS[0]
    target_only = generator.generate(prompt, max_new_tokens=12, mode="target")
    out = http_generate(server, {"text_input": prompt, "max_tokens": 12, "num_draft_tokens": 0})
    assert out["text_output"] == target_only.text and out["total_draft_tokens"] == 0
    k2 = generator.generate(prompt, max_new_tokens=12, k=2, plan=False)  # the server drafts k every step
    out = http_generate(server, {"text_input": prompt, "max_tokens": 12, "num_draft_tokens": 2})
    assert (out["text_output"], out["total_draft_tokens"]) == (k2.text, k2.stats.num_draft_tokens)
    sampled = generator.generate(prompt, max_new_tokens=12, temperature=0.8, top_k=20, seed=7, plan=False)
    out = http_generate(server, {"text_input": prompt, "max_tokens": 12, "temperature": 0.8, "top_k": 20, "seed": 7})
    assert out["text_output"] == sampled.text
    full = generator.generate(prompt, max_new_tokens=MAX_TOKENS).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if stop.strip():
        stopped = generator.generate(prompt, max_new_tokens=MAX_TOKENS, stop=[stop], plan=False)
        stream = Stream(server)
        try:
            responses, error = stream.collect(
                grpc_inputs(
                    prompt, MAX_TOKENS, extra={"stop_words": (np.array([[stop.encode()]], dtype=object), "BYTES")}
                )
            )
        finally:
            stream.close()
        assert error is None
        assert responses[-1].as_numpy("text_output").reshape(-1)[0].decode() == stopped.text


def test_metrics_count_this_request(server, expected):
    prompt = PROMPTS[2]
    before = metrics(server)
    http_generate(server, {"text_input": prompt, "max_tokens": MAX_TOKENS})
    after = metrics(server)
    stats = expected[prompt].stats
    assert after["draftsmith_draft_tokens_total"] - before["draftsmith_draft_tokens_total"] == stats.num_draft_tokens
    assert (
        after["draftsmith_accepted_tokens_total"] - before["draftsmith_accepted_tokens_total"]
        == stats.num_accepted_tokens
    )
    assert after["draftsmith_verify_steps_total"] - before["draftsmith_verify_steps_total"] == stats.num_steps
    assert after["draftsmith_target_calls_total"] - before["draftsmith_target_calls_total"] == stats.num_steps + 1
    assert after["draftsmith_emitted_tokens_total"] > before.get("draftsmith_emitted_tokens_total", 0)
    assert "draftsmith_scheduler_running" in after and "draftsmith_scheduler_waiting" in after


def test_metrics_are_the_one_table(server):
    """Triton's /metrics has exactly the families of runtime/metric_families.py's table, the OpenAI server's
    (tests/test_openai_server.py test_metrics), histograms included; a labelled one appears with its first value: a
    drafted request gives each one its first."""
    from metric_readers import table_names, type_lines

    http_generate(server, {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS})
    text = metrics_text(server)
    assert type_lines(text, ("draftsmith_", "vllm:")) == table_names()
    assert 'vllm:num_requests_waiting{model="speculative",model_name="speculative",version="1"}' in text


def test_plain_repository_serves_http_infer(tiny_bundle, tmp_path, expected):
    """Triton's HTTP /infer refuses decoupled models; a --no-streaming repository serves it (after being moved)."""
    import tritonclient.http as httpclient
    from triton_repo.generate import RepoOptions, write_repository
    from triton_repo.server import start_server

    written = write_repository(
        tiny_bundle, tmp_path / "written", RepoOptions(threads=1, streaming=False, max_batch_size=4, plan=False)
    )
    moved = shutil.move(str(written), str(tmp_path / "moved"))  # relocatable: nothing points back to "written"
    server = start_server(moved, timeout=180)
    try:
        client = httpclient.InferenceServerClient(f"{server.host}:{server.http_port}")
        inputs = []
        for name, array, dtype in (
            ("text_input", np.array([[PROMPTS[0].encode()]], dtype=object), "BYTES"),
            ("max_tokens", np.array([[MAX_TOKENS]], np.int32), "INT32"),
        ):
            tensor = httpclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer("ensemble", inputs)
        client.close()  # an open keep-alive connection holds Triton's shutdown for its exit timeout
        want = expected[PROMPTS[0]]
        assert result.as_numpy("text_output").reshape(-1)[0].decode() == want.text
        assert int(result.as_numpy("total_draft_tokens").reshape(-1)[0]) == want.stats.num_draft_tokens
        assert float(result.as_numpy("acceptance_rate").reshape(-1)[0]) == pytest.approx(
            want.stats.draft_acceptance_rate, abs=1e-6
        )
        assert "stream" in http_error(server, {"text_input": "hi", "max_tokens": 4, "stream": True})
    finally:
        server.stop()


def test_server_stops_cleanly(tiny_bundle, tmp_path):
    from triton_repo.server import ServerError, start_server

    with pytest.raises(ServerError, match="no model repository"):
        start_server(tmp_path / "missing")
    broken = tmp_path / "broken"
    (broken / "bad" / "1").mkdir(parents=True)
    (broken / "bad" / "config.pbtxt").write_text('name: "bad"\nbackend: "no_such_backend"\n')
    with pytest.raises(ServerError, match="exited with") as failed:
        start_server(broken, timeout=60)
    log = Path(re.search(r"\(full log: (.+)\)", str(failed.value)).group(1))
    assert log.is_file() and "no_such_backend" in log.read_text()  # kept: the error points at it
    shutil.rmtree(log.parent)


def test_server_environment_is_an_allow_list(monkeypatch):
    from triton_repo.server import server_env

    monkeypatch.setenv("DRAFTSMITH_TEST_SECRET", "x")
    monkeypatch.setenv("HF_TOKEN", "x")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    env = server_env()
    assert "DRAFTSMITH_TEST_SECRET" not in env and "HF_TOKEN" not in env
    assert env["OMP_NUM_THREADS"] == "2" and env["LC_ALL"] == "C.UTF-8" and "PATH" in env
    assert server_env(pass_env=["HF_TOKEN"])["HF_TOKEN"] == "x"


@pytest.mark.parametrize(
    "spec", ["model-repository", "no-such-api:k=v", "model-repository:k", ":k=v", "inference:k=v w"]
)
def test_bad_restriction_is_refused_before_starting(spec):
    from triton_repo.server import ServerError, check_restriction

    with pytest.raises(ServerError, match="APIS:HEADER=VALUE"):
        check_restriction(spec, "--http-restricted-api")


def test_serve_command_prints_endpoints_and_stops(tiny_bundle, tmp_path):
    """``draftsmith serve`` binds 127.0.0.1, prints its endpoints, serves, and exits on Ctrl-C (SIGINT)."""
    import signal
    import subprocess
    import sys
    import time
    from triton_repo.generate import RepoOptions, write_repository
    from triton_repo.server import free_port

    repo = write_repository(tiny_bundle, tmp_path / "repo", RepoOptions(threads=1, max_batch_size=2))
    ports = [str(free_port()) for _ in range(3)]
    command = [
        sys.executable,
        "-m",
        "runtime.cli",
        "serve",
        str(repo),
        "--http-port",
        ports[0],
        "--grpc-port",
        ports[1],
        "--metrics-port",
        ports[2],
        "--http-restricted-api",
        "model-repository:admin-key=serve-test",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(line.startswith("metrics") for line in lines):
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
        assert f"http://127.0.0.1:{ports[0]}" in "".join(lines), lines
        assert f"127.0.0.1:{ports[1]}" in "".join(lines)
        body = json.dumps({"text_input": PROMPTS[0], "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{ports[0]}/v2/models/ensemble/generate", data=body)
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["text_output"]
        index = urllib.request.Request(f"http://127.0.0.1:{ports[0]}/v2/repository/index", data=b"{}")
        with pytest.raises(urllib.error.HTTPError):  # restricted: no admin-key header
            urllib.request.urlopen(index, timeout=10)
        index.add_header("admin-key", "serve-test")
        with urllib.request.urlopen(index, timeout=10) as response:
            assert response.status == 200
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    assert process.returncode == 0
    printed = "".join(lines) + process.stdout.read()  # what readline buffered, then the rest
    log = Path(re.search(r"^log +(\S+)$", printed, re.M).group(1))
    assert f"log kept at {log}" in printed  # the path it printed still holds the log after it stopped
    assert log.is_file() and "Started HTTPService" in log.read_text()
    shutil.rmtree(log.parent)


@pytest.mark.slow
def test_smollm2_through_triton(smollm2_bundle, tmp_path):
    from runtime.api import SpeculativeGenerator

    generator = SpeculativeGenerator.from_bundle(smollm2_bundle, threads=1)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    want = {p: generator.generate(p, max_new_tokens=32, plan=False) for p in prompts}  # k every step: the bound
    server = _serve(smollm2_bundle, tmp_path / "repo", max_batch_size=4)
    try:
        before = metrics(server)
        for prompt in prompts:
            out = http_generate(server, {"text_input": prompt, "max_tokens": 32})
            assert out["text_output"] == want[prompt].text
            # the step plan picks each step's draft length up to k (0 included): never more than k a step, and a step
            # emits at least one token (a planned run may take more steps than the unplanned one, so draft more)
            k = -(-want[prompt].stats.num_draft_tokens // want[prompt].stats.num_drafts)
            assert 0 <= out["total_draft_tokens"] <= k * 32
        stream = Stream(server)
        try:
            responses, error = stream.collect(grpc_inputs(prompts[0], 32, stream=True))
        finally:
            stream.close()
        assert error is None and len(responses) > 1
        assert "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r in responses) == want[prompts[0]].text
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: http_generate(server, {"text_input": p, "max_tokens": 32}), prompts * 2))
        assert [a["text_output"] for a in answers] == [want[p].text for p in prompts * 2]
        assert "max_tokens" in http_error(server, {"text_input": "hi", "max_tokens": 0})
        after = metrics(server)
        assert after["draftsmith_accepted_tokens_total"] > before.get("draftsmith_accepted_tokens_total", 0)
        assert 0 <= after["draftsmith_scheduler_mean_draft_length"] <= generator.max_k  # the plan's choice
        assert server.ready()
    finally:
        server.stop()
