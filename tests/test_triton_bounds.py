"""The server survives its clients, against one real tritonserver.

Bounds before work, hostile requests batched together with good ones, cancellation that frees a row, seeded
requests that sample the same text whatever they are batched with, an environment without the caller's secrets,
restricted admin APIs, and a log that survives a crash. The server batches for up to 400 ms, so requests sent
together are decoded together; Triton's own counter of execute calls (``nv_inference_exec_count``) confirms each
batch, and the model's counters (sequence steps, target calls) measure the work, never the clock.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")

from conftest import has_tritonserver  # noqa: E402
from runtime.core.prefill import CHUNK_BOUNDS  # noqa: E402

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(
        not has_tritonserver(), reason="needs nvidia-pytriton's tritonserver (pip install --no-deps nvidia-pytriton)"
    ),
]

LONG = 120  # max_tokens_limit of this server; the tiny bundle's context is 128
PROMPT_LIMIT = 32 * 128  # the default max_prompt_bytes for that context
SECRET, PASSED = "DRAFTSMITH_TEST_SECRET", "DRAFTSMITH_TEST_PASSED"
ADMIN_HEADER, ADMIN_VALUE = "admin-key", "bounds-test-admin"
HOSTILE: set[str] = set()  # the distinct hostile inputs these tests send (printed at the end)
NEVER = "zqzqzq"  # a stop string no answer contains: requests batch only with requests that send the same inputs


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    from triton_repo.generate import RepoOptions, write_repository
    from triton_repo.server import start_server

    repo = write_repository(
        tiny_bundle,
        tmp_path_factory.mktemp("bounds") / "repo",
        RepoOptions(threads=1, max_batch_size=16, max_queue_delay_us=400_000, max_tokens_limit=LONG),
    )
    patch = pytest.MonkeyPatch()
    patch.setenv(SECRET, "must-not-reach-the-models")
    patch.setenv(PASSED, "passed-on-request")
    try:
        restriction = f"model-repository:{ADMIN_HEADER}={ADMIN_VALUE}"
        handle = start_server(
            repo,
            timeout=180,
            pass_env=[PASSED],
            http_restricted_api=[restriction],
            grpc_restricted_protocol=[restriction],
        )
    finally:
        patch.undo()
    yield handle
    handle.stop()
    if handle.log_kept:
        shutil.rmtree(handle.log_path.parent, ignore_errors=True)


# --- helpers ----------------------------------------------------------------------------------------------------


def counters(server) -> dict[tuple[str, str], float]:
    """(metric name, model) -> value, for Triton's execute counter and this project's counters and gauges."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    found = {}
    for name, model, value in re.findall(
        r'^(nv_inference_exec_count|draftsmith_\w+)\{model="(\w+)"[^}]*\} (\S+)$', text, re.M
    ):
        found[(name, model)] = found.get((name, model), 0.0) + float(value)
    return found


def settled(server, before, model="speculative") -> dict:
    """The counters once ``model``'s execute call has returned (Triton counts it after the last response went out;
    a bounded wait, asserted on nothing but the counts)."""
    deadline = time.monotonic() + 30
    while True:
        after = counters(server)
        if delta(before, after, "nv_inference_exec_count", model) >= 1 or time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def delta(before, after, name, model="speculative") -> float:
    return after.get((name, model), 0.0) - before.get((name, model), 0.0)


def tensors(arrays: dict):
    """name -> (numpy array, Triton dtype) as gRPC inputs; 1-D arrays get the batch dimension."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, (array, dtype) in arrays.items():
        array = array.reshape(1, -1) if array.ndim == 1 else array
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def text(value) -> np.ndarray:
    return np.array([value if isinstance(value, bytes) else value.encode()], dtype=object)


def ints(value, dtype=np.int32) -> np.ndarray:
    return np.array([value], dtype=dtype)


def ensemble_request(prompt, max_tokens=16, **extra):
    """Every request sends ``stop_words`` (a batch never mixes requests with and without an optional input)."""
    arrays = {
        "text_input": (text(prompt), "BYTES"),
        "max_tokens": (ints(max_tokens), "INT32"),
        "stop_words": stop_words([NEVER]),
    }
    arrays.update(extra)
    return arrays


def speculative_request(prompt, max_tokens=16, **extra):
    arrays = {
        "text_input": (text(prompt), "BYTES"),
        "request_output_len": (ints(max_tokens), "INT32"),
        "stop_words": stop_words([NEVER]),
        "stream": (np.array([[False]]), "BOOL"),
    }
    arrays.update(extra)
    return arrays


def stop_words(words) -> tuple[np.ndarray, str]:
    return np.array([[w if isinstance(w, bytes) else w.encode() for w in words]], dtype=object), "BYTES"


class Streams:
    """One gRPC stream per request, all opened first, then every request sent at once, so they share a batch."""

    def __init__(self, server, count):
        import tritonclient.grpc as grpcclient

        self.clients, self.results = [], []
        for _ in range(count):
            client = grpcclient.InferenceServerClient(server.grpc_url)
            results = queue.Queue()
            client.start_stream(callback=lambda result, error, q=results: q.put((result, error)))
            self.clients.append(client)
            self.results.append(results)

    def send(self, model, requests):
        prepared = [tensors(r) for r in requests]  # serialize everything before the first request leaves
        for client, inputs in zip(self.clients, prepared):
            client.async_stream_infer(model, inputs, enable_empty_final_response=True)

    def first(self, index, timeout=60):
        return self.results[index].get(timeout=timeout)

    def collect(self, index, timeout=60) -> tuple[str, str | None]:
        """(the request's whole text, or its error message)."""
        pieces = []
        while True:
            result, error = self.results[index].get(timeout=timeout)
            if error is not None:
                return "".join(pieces), str(error)
            out = result.as_numpy("text_output")
            if out is not None:
                pieces.append(out.reshape(-1)[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                return "".join(pieces), None

    def close(self):
        for client in self.clients:
            client.stop_stream()
            client.close()


def send_together(server, model, requests) -> list[tuple[str, str | None]]:
    streams = Streams(server, len(requests))
    try:
        streams.send(model, requests)
        return [streams.collect(i) for i in range(len(requests))]
    finally:
        streams.close()


def stub_pids(server) -> dict[str, int]:
    from test_triton_server_faults import stubs

    return stubs(server)


# --- bounds before work -----------------------------------------------------------------------------------------


def test_default_limits_are_written_into_the_configs(tiny_bundle, tmp_path):
    """Without options: max_tokens up to the context less one (as serve-openai), prompts 32 bytes per context token."""
    from triton_repo import pbtxt
    from triton_repo.generate import RepoOptions, write_repository

    repo = write_repository(tiny_bundle, tmp_path / "repo", RepoOptions(threads=1))
    parameters = {}
    for model in ("preprocessing", "speculative", "postprocessing"):
        config = pbtxt.parse((repo / model / "config.pbtxt").read_text())
        parameters[model] = {k: v.string_value for k, v in config.parameters.items()}
    assert parameters["speculative"]["max_tokens_limit"] == parameters["preprocessing"]["max_tokens_limit"] == "127"
    assert parameters["speculative"]["max_prompt_bytes"] == parameters["preprocessing"]["max_prompt_bytes"] == "4096"
    assert (parameters["speculative"]["max_stop_words"], parameters["speculative"]["max_stop_word_bytes"]) == (
        "16",
        "256",
    )
    assert parameters["postprocessing"]["max_output_ids"] == "128"


def test_hostile_requests_batched_with_good_ones_through_the_ensemble(server, generator):
    """Over-limit requests in the same batch as good ones (one execute call of each model): each gets an error that
    names the limit and its value; the good ones get their full answers."""
    good = ["The quick brown fox", "for i in range(10):", "x"]
    hostile = {
        "ensemble: 3 MB prompt": (ensemble_request(b"a" * 3_000_000), f"max_prompt_bytes={PROMPT_LIMIT}"),
        "ensemble: prompt one byte over the limit": (
            ensemble_request(b"b" * (PROMPT_LIMIT + 1)),
            f"max_prompt_bytes={PROMPT_LIMIT}",
        ),
        "ensemble: max_tokens 10^9": (ensemble_request("hi", 10**9), "max_tokens_limit"),
        "ensemble: 100k stop words": (
            ensemble_request("hi", stop_words=stop_words(["zz"] * 100_000)),
            "max_stop_words=16",
        ),
        "ensemble: 17 stop words": (
            ensemble_request("hi", stop_words=stop_words([f"s{i}" for i in range(17)])),
            "max_stop_words=16",
        ),
        "ensemble: one 10 KB stop word": (
            ensemble_request("hi", stop_words=stop_words(["w" * 10_000])),
            "max_stop_word_bytes=256",
        ),
    }
    HOSTILE.update(hostile)
    requests = [
        ensemble_request(good[0]),
        *[r for r, _ in hostile.values()][:3],
        ensemble_request(good[1]),
        *[r for r, _ in hostile.values()][3:],
        ensemble_request(good[2]),
    ]
    before = counters(server)
    answers = send_together(server, "ensemble", requests)
    after = settled(server, before)
    by_request = dict(zip(map(id, requests), answers))
    for (request, limit), name in zip(hostile.values(), hostile):
        out, error = by_request[id(request)]
        assert error is not None and limit in error, (name, error)
        if "max_tokens" in name:
            assert f"[1, {LONG}]" in error
    for prompt, request in zip(good, (requests[0], requests[4], requests[-1])):
        out, error = by_request[id(request)]
        assert error is None and out == generator.generate(prompt, max_new_tokens=16, stop=[NEVER]).text
    assert delta(before, after, "nv_inference_exec_count", "preprocessing") == 1  # all 9 in one batch
    assert delta(before, after, "nv_inference_exec_count", "speculative") == 1  # the 3 good + 3 stop-word ones
    assert delta(before, after, "draftsmith_requests_total") == 3
    assert delta(before, after, "draftsmith_request_errors_total") == 3


def test_direct_calls_to_speculative_are_bounded(server, generator):
    """``speculative`` called without ``preprocessing``: the same bounds, checked before it tokenizes anything."""
    hostile = {
        "speculative: 3 MB prompt": (speculative_request(b"a" * 3_000_000), f"max_prompt_bytes={PROMPT_LIMIT}"),
        "speculative: request_output_len 10^6": (speculative_request("hi", 10**6), "max_tokens_limit"),
        "speculative: 100k stop words": (
            speculative_request("hi", stop_words=stop_words(["zz"] * 100_000)),
            "max_stop_words=16",
        ),
        "speculative: one 1 MB stop word": (
            speculative_request("hi", stop_words=stop_words([b"w" * 2**20])),
            "max_stop_word_bytes=256",
        ),
        "speculative: 3 MB prompt of invalid UTF-8": (
            speculative_request(b"\xff" * 3_000_000),
            f"max_prompt_bytes={PROMPT_LIMIT}",
        ),
    }
    HOSTILE.update(hostile)
    prompt = "Speculative decoding keeps"
    requests = [r for r, _ in hostile.values()] + [speculative_request(prompt)]
    before = counters(server)
    answers = send_together(server, "speculative", requests)
    after = settled(server, before)
    for name, (_, limit), (_, error) in zip(hostile, hostile.values(), answers):
        assert error is not None and limit in error, (name, error)
    assert answers[-1] == (generator.generate(prompt, max_new_tokens=16, stop=[NEVER]).text, None)
    assert delta(before, after, "nv_inference_exec_count") == 1
    assert delta(before, after, "draftsmith_request_errors_total") == len(hostile)


def test_direct_calls_to_postprocessing_are_bounded(server, generator):
    """``postprocessing``: more ids than the context, and ids outside the vocabulary, are refused one by one; a good
    request in the same batch is decoded."""
    import tritonclient.grpc as grpcclient

    vocab = generator.tokenizer.vocab_size
    ids = generator.tokenizer.encode("The quick brown fox")
    hostile = {
        "postprocessing: 129 ids (context + 1)": (np.zeros((1, 129), np.int32), "max_output_ids=128"),
        "postprocessing: 100k ids": (np.zeros((1, 100_000), np.int32), "max_output_ids=128"),
        "postprocessing: id past the vocabulary": (np.array([[vocab]], np.int32), f"[0, {vocab})"),
        "postprocessing: negative id": (np.array([[-1]], np.int32), f"[0, {vocab})"),
    }
    HOSTILE.update(hostile)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results = []
    arrays = [a for a, _ in hostile.values()] + [np.array([ids], np.int32)]
    before = counters(server)
    try:
        prepared = [tensors({"output_ids": (a, "INT32")}) for a in arrays]
        for inputs in prepared:
            box = queue.Queue()
            client.async_infer("postprocessing", inputs, callback=lambda result, error, q=box: q.put((result, error)))
            results.append(box)
        answers = [box.get(timeout=60) for box in results]
    finally:
        client.close()
    after = settled(server, before, "postprocessing")
    for name, (_, limit), (_, error) in zip(hostile, hostile.values(), answers):
        assert error is not None and limit in str(error), (name, error)
    result, error = answers[-1]
    assert error is None
    assert result.as_numpy("text_output").reshape(-1)[0].decode() == generator.tokenizer.decode(ids)
    assert delta(before, after, "nv_inference_exec_count", "postprocessing") == 1


# --- cancellation stops the work --------------------------------------------------------------------------------


def test_cancelled_stream_frees_its_row_and_gets_its_final_response(server, generator):
    """Two requests decoded in one batch; the first one's gRPC stream is cancelled after its first piece (the model
    process paused meanwhile, so the step it lands on does not depend on the machine's speed). It stops at the next
    step (a handful of steps, not its 120), gets its final response, and the other request is served in exactly the
    steps it needs alone: the batch's loop runs no step for the cancelled row."""
    cancelled_prompt, other_prompt = "hello", "The quick brown fox"
    options = {"num_draft_tokens": (ints(0), "INT32")}  # target only: one token per step, so steps count tokens
    full = generator.generate(cancelled_prompt, max_new_tokens=LONG, mode="target", stop=[NEVER])
    other = generator.generate(other_prompt, max_new_tokens=LONG, mode="target", stop=[NEVER])
    assert full.stats.num_steps > other.stats.num_steps  # so a cancelled row still running would show
    HOSTILE.add("gRPC stream cancelled mid-request")
    requests = [
        speculative_request(cancelled_prompt, LONG, stream=(np.array([[True]]), "BOOL"), **options),
        speculative_request(other_prompt, LONG, **options),
    ]
    before = counters(server)
    streams = Streams(server, 2)
    try:
        streams.send("speculative", requests)
        stub = stub_pids(server)["speculative"]
        result, error = streams.first(0)
        os.kill(stub, signal.SIGSTOP)  # decoding holds still while the cancellation reaches the server
        try:
            cancel = threading.Thread(target=streams.clients[0].stop_stream, kwargs={"cancel_requests": True})
            cancel.start()
            time.sleep(0.2)  # well under the 1 s after which Triton would judge a silent stub unhealthy
        finally:
            os.kill(stub, signal.SIGCONT)
        cancel.join(30)
        assert error is None
        out, error = streams.collect(1)
    finally:
        streams.close()
    after = settled(server, before)
    assert (out, error) == (other.text, None)
    assert delta(before, after, "nv_inference_exec_count") == 1  # the two were one batch
    assert delta(before, after, "draftsmith_scheduler_cancelled_total") == 1
    assert delta(before, after, "draftsmith_scheduler_finished_total") == 1
    assert delta(before, after, "draftsmith_requests_total") == 2  # every sequence that ended, the cancelled one too
    cancelled_steps = delta(before, after, "draftsmith_verify_steps_total") - other.stats.num_steps
    assert 1 <= cancelled_steps < full.stats.num_steps // 2
    # each prompt's prefill is a call or a few: the "auto" chunk follows the measured costs (CHUNK_BOUNDS' 2 tokens
    # at the least, where a machine under load measured a steep cost per token)
    lengths = [len(generator.encode_prompt(p, False)) for p in (cancelled_prompt, other_prompt)]
    fewest, most = sum(n > 1 for n in lengths), sum(-(-(n - 1) // CHUNK_BOUNDS[0]) for n in lengths)
    prefill_calls = delta(before, after, "draftsmith_target_calls_total") - other.stats.num_steps  # a call a step
    assert fewest <= prefill_calls <= most
    finals = [line for line in server.log().splitlines() if "request cancelled by its client" in line]
    assert finals and "final response" in finals[-1], server.log()[-2000:]
    print(finals[-1])
    assert f"after {int(cancelled_steps)} steps" in finals[-1]


# --- seeded sampling does not depend on the batch ---------------------------------------------------------------


def test_identical_seeded_requests_in_one_batch_sample_as_alone(server, generator):
    prompt, other = "Speculative decoding keeps", "for i in range(10):"
    sampled = {"temperature": (np.array([[0.9]], np.float32), "FP32")}
    options = dict(max_new_tokens=24, temperature=0.9, stop=[NEVER])
    alone = generator.generate(prompt, seed=11, **options).text
    assert generator.generate(prompt, seed=12, **options).text != alone
    requests = [
        ensemble_request(prompt, 24, seed=(ints(11, np.uint64), "UINT64"), **sampled),
        ensemble_request(other, 24, seed=(ints(5, np.uint64), "UINT64"), **sampled),
        ensemble_request(prompt, 24, seed=(ints(11, np.uint64), "UINT64"), **sampled),
    ]
    before = counters(server)
    answers = send_together(server, "ensemble", requests)
    after = settled(server, before)
    assert answers[0] == answers[2] == (alone, None)
    assert answers[1] == (generator.generate(other, seed=5, **options).text, None)
    assert delta(before, after, "nv_inference_exec_count") == 1


# --- the server's environment, restricted APIs ------------------------------------------------------------------


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_model_processes_do_not_see_the_callers_secrets(server):
    HOSTILE.add("a secret in the caller's environment")
    pids = [server.process.pid, *stub_pids(server).values()]
    assert len(pids) == 4  # tritonserver and the three Python models
    for pid in pids:
        env = _environ(pid)
        assert SECRET not in env, pid
        assert env.get(PASSED) == "passed-on-request"  # --pass-env NAME reaches them
        assert "PATH" in env and "LD_LIBRARY_PATH" in env


def test_restricted_apis_need_their_header(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    HOSTILE.update({"HTTP repository index without the admin header", "gRPC repository index without the header"})
    request = urllib.request.Request(f"{server.url}/v2/repository/index", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code in (401, 403)
    request.add_header(ADMIN_HEADER, ADMIN_VALUE)
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException):
            client.get_model_repository_index()
        # gRPC carries the header as triton-grpc-protocol-<HEADER>
        assert client.get_model_repository_index(headers={f"triton-grpc-protocol-{ADMIN_HEADER}": ADMIN_VALUE})
        assert client.is_model_ready("ensemble")  # inference and health stay open
    finally:
        client.close()


# --- last: the log survives a crash -----------------------------------------------------------------------------


def test_log_is_kept_after_a_crash(server):
    """SIGKILL the server: ``stop()`` keeps the log it would delete after a clean stop, and kills the model stubs
    the dead server left behind."""
    stubs = list(stub_pids(server).values())
    server.process.kill()
    server.process.wait(10)
    server.stop()
    assert server.log_kept and server.log_path.is_file()
    assert "Started GRPCInferenceService" in server.log()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in stubs):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in stubs)
    print(f"distinct hostile inputs tried: {len(HOSTILE)}: {sorted(HOSTILE)}")


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status
