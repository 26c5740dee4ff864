"""The OpenAI-compatible server through the official ``openai`` client, on a real uvicorn over the tiny bundle; a
few checks in-process through httpx's ASGI transport (a timeout's finish reason, the event loop while
log-probabilities are shaped)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from door_path import submit  # noqa: E402
from openai_asgi import call, chat  # noqa: E402
from runtime.serving import openai_responses  # noqa: E402
from runtime.serving.openai_server import create_app  # noqa: E402 - after the skips: it needs fastapi
from runtime.core.scheduler import Scheduler  # noqa: E402

PROMPT = "The quick brown fox"
MODEL = "tiny"


class _Server:
    """uvicorn in a daemon thread on a free 127.0.0.1 port (the socket is bound here: no race for the port)."""

    def __init__(self, app):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(tiny_bundle):
    from runtime.api import SpeculativeGenerator

    generator = SpeculativeGenerator.from_bundle(tiny_bundle, threads=1)
    # calibrated: start(calibrate=False) leaves CostModel empty, and step() then fails in np.interp (a scheduler bug)
    scheduler = Scheduler(generator, max_batch=4).start()
    server = _Server(create_app(scheduler, MODEL))
    yield SimpleNamespace(url=server.url, scheduler=scheduler, generator=generator)
    server.close()
    scheduler.stop()


@pytest.fixture(scope="module")
def reference(tiny_bundle):
    """A generator of its own, decoding one request at a time: what a request gets alone."""
    from runtime.api import SpeculativeGenerator

    return SpeculativeGenerator.from_bundle(tiny_bundle, threads=1)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _finish(reason: str) -> str:
    return {"stop": "stop", "length": "length", "context": "length"}[reason]


# --- completions ---------------------------------------------------------------------------------------------------


def test_greedy_completion_equals_generate(client, reference):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    want = reference.generate(PROMPT, max_new_tokens=24)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == _finish(want.finish_reason)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (want.prompt_tokens, len(want.token_ids))
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_completion_equals_whole_with_usage_chunk(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])


def test_stream_is_server_sent_events_ending_in_done(served):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert '"usage"' not in "".join(lines)  # only with stream_options.include_usage


def test_stop_strings(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    # the random model's text is mostly broken UTF-8 (U+FFFD): stop at a plain ASCII pair after the start
    stop = next(
        (text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].isalnum()),
        None,
    )
    assert stop, f"no ASCII pair in the tiny model's text for this test: {text!r}"
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "\x00"])
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text


def test_seed_reproduces_sampled_text(client):
    options = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=11)
    first, second = (client.completions.create(**options).choices[0].text for _ in range(2))
    assert first == second
    streamed = client.completions.create(**options, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == first


def test_num_draft_tokens_extension_keeps_greedy_text(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    for k in (0, 1, 3):
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"num_draft_tokens": k}
        )
        assert out.choices[0].text == base


# --- chat ---------------------------------------------------------------------------------------------------------


def test_chat_completion_and_stream(client, reference):
    messages = [{"role": "user", "content": PROMPT}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    want = reference.generate(PROMPT, chat=True, max_new_tokens=24)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want.text
    assert out.choices[0].finish_reason == _finish(want.finish_reason)
    assert out.usage.prompt_tokens == want.prompt_tokens
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-2].choices[0].finish_reason == out.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == out.usage


def test_chat_messages_render_with_the_template(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    ids = reference.tokenizer.encode_chat(messages)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens <= 12
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        messages[1],
    ]
    same = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=12, temperature=0)
    assert same.choices[0].message.content == out.choices[0].message.content


# --- errors -------------------------------------------------------------------------------------------------------


def test_bad_requests_are_400_in_openais_shape(client):
    bad = [
        dict(n=2),
        dict(prompt=["one", "two"]),
        dict(prompt=[1, 2, 3]),
        dict(max_tokens=10_000),
        dict(stop=[str(i) for i in range(17)]),
        dict(temperature=3),
        dict(extra_body={"logprobs": 6}),
        dict(extra_body={"frequency_penalty": 0.5}),
        dict(extra_body={"no_such_field": 1}),
        dict(prompt="x" * 5000),
        dict(extra_body={"num_draft_tokens": 99}),
        dict(stream_options={"include_usage": True}),
    ]
    params = []
    for case in bad:
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(**{"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **case})
        assert raised.value.status_code == 400 and raised.value.type == "invalid_request_error"
        assert raised.value.message
        params.append(raised.value.param)
    assert params[:6] == ["n", "prompt", "prompt", "max_tokens", "stop", "temperature"]
    assert params[8] == "no_such_field" and params[9] == "prompt"
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: no_such_field"):
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"no_such_field": 1})
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
        )
    harmless = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, user="someone", frequency_penalty=0, n=1
    )
    assert harmless.choices


def test_unknown_model_route_and_bad_json(client, served):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert raised.value.code == "model_not_found" and raised.value.param == "model"
    response = httpx.get(served.url + "/v1/nothing-here")
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    response = httpx.post(
        served.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 200_000})
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"


def test_models_and_health(client, served):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}


def test_api_key_on_every_route_but_health(served):
    server = _Server(create_app(served.scheduler, MODEL, api_key="s3cret"))
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        for path in ("/v1/models", "/metrics", "/v1/nothing-here"):
            assert httpx.get(server.url + path).status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices
    finally:
        server.close()


def test_overloaded_is_429_with_retry_after(served):
    scheduler = Scheduler(served.generator, max_queue=1)  # never started: the one queued request stays queued
    submit(scheduler, PROMPT, max_new_tokens=2)
    server = _Server(create_app(scheduler, MODEL))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError) as raised:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert raised.value.code == "server_overloaded"
        assert raised.value.response.headers["retry-after"] == "1"
        assert scheduler.stats()["refused"] == 1
    finally:
        server.close()
        scheduler.stop()


def test_metrics(client, served):
    """/metrics: exactly the families of the one table (runtime/metric_families.py, the Triton model's too), counted
    where they happen: the target's calls while the scheduler runs, the front door's refusals; and the OpenAI
    server's own event-loop lag (runtime/serving/loop_lag.py)."""
    from metric_readers import prometheus_samples, table_names, type_lines

    def samples():
        response = httpx.get(served.url + "/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        return response.text, prometheus_samples(response.text)

    _, before = samples()
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "num_draft_tokens": 1000}  # over the bundle's max_k
    refused = httpx.post(served.url + "/v1/completions", json=body, timeout=30)
    assert refused.status_code == 400 and "num_draft_tokens" in refused.text
    text, after = samples()
    assert type_lines(text) == table_names() | {"draftsmith_event_loop_lag_seconds": "histogram"}  # + the server's
    assert after[("draftsmith_event_loop_lag_seconds_count", ())] > 0  # its loop watched while it serves

    def grew(name, labels=()):
        return after[(name, labels)] - before[(name, labels)]

    assert grew("draftsmith_requests_total") == 1
    assert grew("draftsmith_request_errors_total") == 1
    assert grew("draftsmith_target_calls_total") >= 2  # its prefill, and at least one step
    assert grew("draftsmith_scheduler_steps_total") >= 1
    assert grew("draftsmith_emitted_tokens_total") == 4
    assert ("vllm:num_requests_running", (("model_name", MODEL),)) in after


def test_disconnect_cancels_the_request(client, served, reference, monkeypatch):
    assert reference.generate(PROMPT, max_new_tokens=100).finish_reason != "stop", "pick a prompt that runs long"
    engine, forward = served.scheduler.target, served.scheduler.target.forward

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine, "forward", slow)
    before = served.scheduler.stats()["cancelled"]
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while served.scheduler.stats()["cancelled"] == before:
        assert time.monotonic() < deadline, "the disconnected request was not cancelled"
        time.sleep(0.02)
    assert served.scheduler.stats()["running"] == 0
    before = served.scheduler.stats()["cancelled"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the server notices the client left while it waits
        httpx.post(served.url + "/v1/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 10
    while served.scheduler.stats()["cancelled"] == before:
        assert time.monotonic() < deadline, "the abandoned request was not cancelled"
        time.sleep(0.02)
    monkeypatch.undo()
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices  # still serving


# --- in-process: a timeout's finish reason, and log-probabilities shaped off the event loop -----------------------


def test_a_timeout_is_reported_as_timeout_not_length(scheduler, generator, monkeypatch):
    engine = generator.target
    forward = engine.forward

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine, "forward", slow)
    app = create_app(scheduler, MODEL, request_timeout=0.2)
    for stream in (False, True):
        response = call(
            app,
            "POST",
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "The quick brown fox",
                "max_tokens": 100,
                "temperature": 0,
                "stream": stream,
            },
        )
        assert response.status_code == 200
        assert '"finish_reason":"timeout"' in response.text.replace(" ", ""), response.text[-300:]


def shaping_waits_for_the_loop(monkeypatch, pending: list, outcomes: list) -> None:
    """Each log-probability shaping waits (up to 5 s) for the event loop to run a tick while it is under way: it can
    only if the shaping is off the loop (on it, the loop stands still until the shaping returns)."""
    for name in ("chat_logprobs", "completion_logprobs"):
        real = getattr(openai_responses, name)

        def waiting(*args, _real=real, **kwargs):
            ticked = threading.Event()
            pending.append(ticked)
            outcomes.append(ticked.wait(5))
            return _real(*args, **kwargs)

        monkeypatch.setattr(openai_responses, name, waiting)


@pytest.mark.parametrize("stream,chat_body", [(False, False), (False, True), (True, False), (True, True)])
def test_logprobs_shaping_does_not_freeze_the_event_loop(app, monkeypatch, stream, chat_body):
    pending, outcomes = [], []
    shaping_waits_for_the_loop(monkeypatch, pending, outcomes)
    if chat_body:
        path, body = "/v1/chat/completions", chat(logprobs=True, top_logprobs=20, stream=stream)
    else:
        path, body = (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "max_tokens": 4, "logprobs": 5, "stream": stream},
        )

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            done = asyncio.Event()

            async def tick():  # the event loop's heartbeat: tells every shaping under way that the loop runs
                while not done.is_set():
                    while pending:
                        pending.pop().set()
                    await asyncio.sleep(0.001)

            ticker = asyncio.create_task(tick())
            response = await client.post(path, json=body)
            done.set()
            await ticker
            return response

    response = asyncio.run(run())
    assert response.status_code == 200
    assert '"logprobs"' in response.text
    assert outcomes and all(outcomes), "a shaping ran on the event loop: the loop stood still until it returned"


# --- the load driver ----------------------------------------------------------------------------------------------


def test_load_driver_against_the_server(served):
    from bench.openai_load import run_load

    report = run_load(
        served.url,
        clients=2,
        duration=60,
        max_requests=6,
        max_tokens=16,
        cancel_fraction=0.34,
        check_identical=True,
        seed=3,
    )
    assert report["sent"] == 6 and report["lost"] == 0 and report["failed"] == 0
    assert report["answered"] + report["cancelled"] == 6 and report["answered"] >= 1
    assert report["identical"]["mismatches"] == 0 and report["identical"]["checked"] >= 1
    assert report["output_tokens"] > 0 and report["ttft_s"]["p50"] > 0


def test_load_driver_sends_draft_lengths_and_long_prompts(served):
    """The soak's mix: num_draft_tokens up to a maximum and prompts near the context limit, checked alone too."""
    from bench.openai_client import long_prompt_of, mixed_spec
    from bench.openai_load import run_load

    specs = [mixed_spec(i, 1, 16, 0.0, max_draft_tokens=8, long_prompt="L", long_fraction=0.5) for i in range(40)]
    assert {s.num_draft_tokens for s in specs} - {None} <= set(range(1, 9)) and any(s.num_draft_tokens for s in specs)
    assert any(s.prompt == "L" for s in specs) and any(s.prompt != "L" for s in specs)
    assert len(long_prompt_of(50).split()) == 50
    report = run_load(
        served.url,
        clients=3,
        duration=60,
        max_requests=9,
        max_tokens=12,
        cancel_fraction=0.0,
        check_identical=True,
        check_limit=4,
        max_draft_tokens=6,
        long_prompt_tokens=100,
        long_fraction=0.4,
        seed=5,
    )
    assert report["sent"] == 9 and report["lost"] == 0 and report["failed"] == 0
    assert report["identical"]["mismatches"] == 0 and report["identical"]["distinct"] <= 4


def test_an_events_data_stays_on_one_line_for_every_line_reader():
    """Text may hold U+2028, U+2029 or U+0085, which JSON carries raw and str.splitlines (so httpx's iter_lines)
    takes for line breaks: the server escapes them, and the load tool splits only at CR/LF (a drain run lost a
    request to a chunk cut at U+2028 before this)."""
    import json

    from bench.openai_client import sse_lines
    from runtime.serving.openai_server import _sse

    text = "a\u2028b\u2029c\x85d\x1ce \u00e9"
    event = _sse({"text": text})
    assert len(event.splitlines()) == 2 and json.loads(event.splitlines()[0][len("data: ") :]) == {"text": text}

    class Chunks:
        def iter_text(self):
            yield from ['data: {"t":"x\u2028', 'y"}\r', "\ndata: [DO", "NE]\n\n"]

    lines = [line for line in sse_lines(Chunks()) if line]
    assert lines == ['data: {"t":"x\u2028y"}', "data: [DONE]"]


def test_load_driver_runs_speculation_on_and_off_beside_hostile_connections(served):
    """openai-load's comparison (the same server with speculation off: num_draft_tokens 0), the draft lengths the
    server's step plan chose during each run (from /metrics), and the soak's companions: idle and slow-header
    connections held open from other source addresses, and a health probe timed the whole time."""
    from bench.openai_load import run_load
    from bench.openai_report import level_summary

    # the tiny pair's draft is near its target in cost, so its measured costs may keep every row from drafting (and
    # a row is probed only where drafting could pay): with planning off each row drafts its limit
    served.scheduler.plan = False
    try:
        runs = _load_runs(served, run_load)
    finally:
        served.scheduler.plan = True
    for run in runs:
        assert run["sent"] == 4 and run["answered"] == 4 and run["failed"] == run["lost"] == 0
        assert run["hostile_connections"]["opened"] >= 8 and run["health"]["failed"] == 0
        assert run["health"]["probes"] >= 1 and run["watched_stream_gap_s"]["n"] > 0
    on, off = (run["planned_draft_length"] for run in runs)
    assert sum(on["row_steps"].values()) > 0 and off["mean"] == 0 and set(off["row_steps"]) == {"0"}
    assert [run["speculation"] for run in runs] == [True, False]  # draft_tokens 0 turned the server's drafting off
    (level,) = level_summary(runs)  # one client level: the two runs side by side
    assert level["clients"] == 2 and level["ratio"] > 0
    assert level["mean_planned_k"] == on["mean"] > 0  # the speculative side is the run that drafted


def _load_runs(served, run_load) -> list[dict]:
    """openai-load at 2 clients against the served bundle, speculation on (the server's k) and off."""
    return [
        run_load(
            served.url,
            clients=2,
            duration=60,
            max_requests=4,
            max_tokens=8,
            cancel_fraction=0.0,
            seed=2,
            draft_tokens=draft,
            idle_connections=6,
            slow_header_clients=2,
            health_url=served.url + "/health",
            watch_stream=24,  # several chunks a request, so gaps exist even when drafts are long
        )
        for draft in (None, 0)
    ]


def test_the_level_summary_sets_each_levels_speculative_run_beside_its_plain_one():
    """Runs at 1 and 2 clients, speculation on and off, in any order: per level, the speculative tokens/s over the
    plain one (1 client: 30 / 20; 2 clients: 45 / 36) and the speculative throughput over one client's (45 / 30)."""
    from bench.openai_report import level_summary

    def run(clients: int, speculation: bool, tokens_per_s: float) -> dict:
        planned = {"mean": 2.5 if speculation else 0.0}
        return dict(
            clients=clients,
            speculation=speculation,
            output_tokens_per_s=tokens_per_s,
            ttft_s={"p95": 0.1},
            planned_draft_length=planned,
        )

    runs = [run(2, False, 36.0), run(1, True, 30.0), run(2, True, 45.0), run(1, False, 20.0)]
    one, two = level_summary(runs)
    assert (one["clients"], one["ratio"], one["scaling"]) == (1, pytest.approx(1.5), pytest.approx(1.0))
    assert (two["clients"], two["ratio"], two["scaling"]) == (2, pytest.approx(1.25), pytest.approx(1.5))
    assert one["mean_planned_k"] == two["mean_planned_k"] == 2.5


def _four_requests_beside(url: str, **hostile) -> dict:
    """openai-load's report of 4 requests from 2 clients, with the ``hostile`` client given."""
    from bench.openai_load import run_load

    return run_load(url, clients=2, duration=60, max_requests=4, max_tokens=8, cancel_fraction=0.0, **hostile)


def test_the_load_tool_sends_a_hostile_format_beside_its_clients(scheduler):
    """``openai-load --hostile-format``: one more client sends the issue's regex in a loop; the server refuses each
    at once (400) and the clients' requests all finish."""
    server = _Server(create_app(scheduler, MODEL))
    try:
        report = _four_requests_beside(server.url, hostile_format={"type": "regex", "regex": "a{250000}"})
    finally:
        server.close()
    assert report["sent"] == 4 and report["failed"] == 0 and report["lost"] == 0
    hostile_client = report["hostile_client"]
    assert hostile_client["sent"] >= 1 and set(hostile_client["by_status"]) == {"400"}
    assert "expands to more than" in hostile_client["first_error"]


def test_the_load_tool_sends_huge_metadata_beside_its_clients_and_reads_the_loop_lag(scheduler):
    """``openai-load --hostile-body-bytes``: one more client sends metadata arrays of ~150k values (parsed by the
    server's worker process) in a loop; each is refused naming metadata, the clients' requests all finish, and the
    report carries the server's event-loop lag over the run."""
    from runtime.core.request import Limits

    limits = Limits.for_context(scheduler.bundle.max_context, max_body_bytes=1 << 20)
    app = create_app(scheduler, MODEL, limits=limits)
    server = _Server(app)
    try:
        report = _four_requests_beside(server.url, hostile_body_bytes=300_000)
    finally:
        server.close()
        app.state.body_parser.close()
    assert report["sent"] == 4 and report["failed"] == 0 and report["lost"] == 0
    hostile_client = report["hostile_client"]
    assert hostile_client["sent"] >= 1 and set(hostile_client["by_status"]) == {"400"}
    assert "metadata" in hostile_client["first_error"] and app.state.body_parser.sent_to_worker >= 1
    assert report["event_loop_lag"]["samples"] > 0 and report["event_loop_lag"]["max_at_most_s"] > 0
