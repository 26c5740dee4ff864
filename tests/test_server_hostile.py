"""Hardening III, the serving side: what a hostile client (or a sick engine) could still do to the OpenAI server.

Every client error is a 4xx naming its field (a big or deep tool schema, a grammar that fails mid-decode); log
probabilities are shaped off the event loop; /health reads the engine's fault rate; grammar compiles are bounded
and single-flight; the API key survives a trailing newline and a lower-case scheme; loopback is every loopback
address; one failing admission fails only its own request; a timeout says so. ``HOSTILE`` counts the distinct
hostile inputs sent here, by class (the issue's table)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from runtime.errors import RequestError  # noqa: E402
from runtime.serving import openai_responses, openai_server  # noqa: E402
from runtime.serving.openai_server import LOOPBACK_HOSTS, create_app  # noqa: E402
from runtime.serving.scheduler import Scheduler  # noqa: E402

MODEL = "tiny"
HOSTILE: dict[str, set] = {}  # class: distinct hostile inputs sent


def hostile(kind: str, value) -> None:
    HOSTILE.setdefault(kind, set()).add(json.dumps(value, sort_keys=True, default=repr))


@pytest.fixture(scope="module")
def generator(tiny_bundle):
    from runtime.api import SpeculativeGenerator

    return SpeculativeGenerator.from_bundle(tiny_bundle, threads=1)


@pytest.fixture(scope="module")
def scheduler(generator):
    scheduler = Scheduler(generator, max_batch=2).start()
    yield scheduler
    scheduler.stop()


@pytest.fixture(scope="module")
def app(scheduler):
    return create_app(scheduler, MODEL, allowed_hosts=LOOPBACK_HOSTS)


def call(app, method: str, path: str, **options) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return await client.request(method, path, **options)

    return asyncio.run(run())


def chat(tools=None, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    if tools is not None:
        body.update(
            tools=[{"type": "function", "function": {"name": "f", "parameters": tools}}], tool_choice="required"
        )
    return body


def nested(depth: int, key: str = "a") -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {key: schema}}
    return schema


# --- item 3: every client error is a 4xx naming its field ---------------------------------------------------------

BAD_SCHEMAS = [
    {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(700)}},
    {"type": "object", "properties": {"a": {"type": "string", "enum": ["y" * 50] * 900}}},
    nested(33),
    nested(35),
    nested(40, "b"),
    {"anyOf": [nested(34)]},
    {"type": "object", "properties": {"a": {"$ref": "#/nope"}}},
    {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}},
    {"$ref": "http://example.com/schema.json"},
    {"type": "array", "items": {"$ref": "#"}, "minItems": "three"},
    {"type": "object", "required": 5},
]
BAD_FORMATS = [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": nested(36)}},
    {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "schema": {
                "type": "object",
                "properties": {f"k{i}": {"type": "integer", "description": "z" * 60} for i in range(600)},
            },
        },
    },
    {"type": "regex", "regex": "x" * 40_000},
    {"type": "grammar", "grammar": "start: undefined_rule"},
    {"type": "grammar", "grammar": "x" * 40_000},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/missing"}}},
]


@pytest.mark.parametrize("schema", BAD_SCHEMAS, ids=range(len(BAD_SCHEMAS)))
def test_a_bad_tool_schema_is_a_400_naming_tools(app, schema):
    hostile("tool schema", schema)
    response = call(app, "POST", "/v1/chat/completions", json=chat(schema))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools"


@pytest.mark.parametrize("fmt", BAD_FORMATS, ids=range(len(BAD_FORMATS)))
def test_a_bad_response_format_is_a_400_naming_it(app, fmt):
    hostile("response format", fmt)
    response = call(
        app, "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "response_format": fmt}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_error_mid_decode_is_a_client_error_not_a_500(app, monkeypatch, stream):
    """llguidance stops a request whose grammar runs out of fuel mid-decode: that is the request's own (its grammar),
    a 400 before the first text, an invalid_request_error event after it; never "internal server error"."""
    from runtime.decoding import grammar

    def out_of_fuel(self, *args, **kwargs):
        raise RequestError("the grammar engine stopped this request: lexer fuel exhausted")

    monkeypatch.setattr(grammar.GrammarRow, "commit", out_of_fuel)
    body = {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": 8,
        "stream": stream,
        "response_format": {"type": "json_object"},
    }
    response = call(app, "POST", "/v1/completions", json=body)
    if not stream:
        assert response.status_code == 400 and "grammar" in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "response_format"
    else:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        errors = [e["error"] for e in events if "error" in e]
        assert response.status_code in (200, 400)
        if response.status_code == 200:
            assert errors and errors[0]["type"] == "invalid_request_error"
            assert errors[0]["param"] == "response_format"


# --- item 5: log-probabilities are shaped off the event loop ------------------------------------------------------


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


# --- item 6: health reads the fault rate ---------------------------------------------------------------------------


@pytest.mark.parametrize("with_drain", [False, True])
def test_a_sticky_engine_fault_turns_readiness_then_liveness_off(generator, monkeypatch, with_drain):
    """Every target call fails (ORT out of memory, a CUDA error): after a few requests /health answers 503 with the
    reason, and after a longer streak /health/live too (Kubernetes restarts the pod); before, both said 200."""
    from runtime.serving.drain import Drain

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    for name in ("forward", "prefill_rows", "prefill"):
        monkeypatch.setattr(generator.target, name, broken)
    scheduler = Scheduler(generator, max_batch=2).start()
    app = create_app(scheduler, MODEL, drain=Drain() if with_drain else None)
    try:
        assert call(app, "GET", "/health").status_code == 200
        watch = scheduler.health
        for i in range(watch.live_after):
            response = call(app, "POST", "/v1/completions", json={"model": MODEL, "prompt": f"hi {i}", "max_tokens": 2})
            assert response.status_code == 500
            if i == watch.ready_after - 1:
                ready = call(app, "GET", "/health")
                assert ready.status_code == 503 and "engine" in ready.text
                if with_drain:
                    assert call(app, "GET", "/health/live").status_code == 200  # not yet: a longer streak
        assert call(app, "GET", "/health").status_code == 503
        if with_drain:
            live = call(app, "GET", "/health/live")
            assert live.status_code == 503 and "engine" in live.text
    finally:
        scheduler.stop()


def test_a_fault_watch_recovers_after_a_success_or_a_quiet_spell():
    from runtime.serving.health import FaultWatch

    now = [0.0]
    watch = FaultWatch(ready_after=2, live_after=4, retry_after_s=10.0, clock=lambda: now[0])
    assert watch.readiness() is None and watch.liveness() is None
    for _ in range(2):
        watch.failed()
    assert watch.readiness() and watch.liveness() is None
    now[0] = 11.0  # quiet: let traffic try again (a transient fault must not keep the pod out for ever)
    assert watch.readiness() is None
    watch.failed()
    watch.failed()
    assert watch.readiness() and watch.liveness()
    watch.succeeded()
    assert watch.readiness() is None and watch.liveness() is None


# --- item 8: grammar compiles are bounded and single-flight -------------------------------------------------------


def test_identical_concurrent_schemas_compile_once(generator, monkeypatch):
    from runtime.decoding.grammar import json_schema

    compiler = generator.grammar_compiler()
    count = []

    class SlowMatchers:  # llguidance's matcher, made slowly (a costly schema) and counted
        def __init__(self, real):
            self.real = real

        def __call__(self, *args, **kwargs):
            count.append(args)
            time.sleep(0.3)
            return self.real(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.real, name)

    class Llguidance:  # the compiler's public handle on llguidance, with the slow matcher
        def __init__(self, real):
            self.real, self.LLMatcher = real, SlowMatchers(real.LLMatcher)

        def __getattr__(self, name):
            return getattr(self.real, name)

    monkeypatch.setattr(compiler, "llg", Llguidance(compiler.llg))
    constraint = json_schema({"type": "object", "properties": {"single": {"type": "integer", "minimum": 7}}})
    results = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(constraint))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 6 and len({id(r) for r in results}) == 1
    assert len(count) == 1


def test_grammar_compiles_are_bounded_and_do_not_starve_plain_requests(scheduler, generator, monkeypatch):
    """Many distinct schemas at once: at most GRAMMAR_WORKERS compile together, on a pool of their own; past
    GRAMMAR_PENDING more are refused (429) before any compile; a plain request is served meanwhile."""
    gate, running, peak = threading.Event(), [0], [0]
    lock = threading.Lock()
    real = generator.compile_constraint

    def blocked(fmt):
        if fmt is None:  # an unconstrained request: nothing to compile
            return real(fmt)
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        gate.wait(20)
        with lock:
            running[0] -= 1
        return real(fmt)

    monkeypatch.setattr(generator, "compile_constraint", blocked)
    monkeypatch.setattr(openai_server, "GRAMMAR_PENDING", 6, raising=False)
    app = create_app(scheduler, MODEL)
    count = 10

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000", timeout=60) as client:
            bodies = [
                {
                    "model": MODEL,
                    "prompt": "hi",
                    "max_tokens": 2,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {
                            "name": "s",
                            "schema": {"type": "object", "properties": {f"k{i}": {"type": "integer"}}},
                        },
                    },
                }
                for i in range(count)
            ]
            for body in bodies:
                hostile("distinct schemas", body)
            tasks = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies]
            await asyncio.sleep(0.5)
            plain = await asyncio.wait_for(
                client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}), 10
            )
            gate.set()
            return plain, await asyncio.gather(*tasks)

    try:
        plain, answers = asyncio.run(run())
    finally:
        gate.set()
    assert plain.status_code == 200
    codes = sorted(a.status_code for a in answers)
    assert codes.count(429) == count - 6 and codes.count(200) == 6, codes
    assert peak[0] <= openai_server.GRAMMAR_WORKERS


# --- item 9: the key, the scheme, loopback, admission, timeouts -----------------------------------------------------

GOOD_AUTH = ["Bearer s3cret", "bearer s3cret", "BEARER s3cret", "bEaReR s3cret", "Bearer  s3cret", "Bearer s3cret "]
BAD_AUTH = [
    "Bearer s3cret2",
    "Bearer s3cre",
    "Basic s3cret",
    "Bearers3cret",
    "Bearer",
    "s3cret",
    "Token s3cret",
    "Bearer: s3cret",
    "Bearer s3cret\t x",
    "Bearer S3CRET",
    "Bearer \u00a0s3cret",
    "Bearer s3cret s3cret",
    "Digest s3cret",
]


@pytest.mark.parametrize("given", GOOD_AUTH)
def test_the_auth_scheme_is_case_insensitive_and_a_key_with_a_newline_is_stripped(scheduler, given):
    hostile("authorization", given)
    app = create_app(scheduler, MODEL, api_key="s3cret\n")
    assert call(app, "GET", "/v1/models", headers={"authorization": given}).status_code == 200


@pytest.mark.parametrize("given", BAD_AUTH)
def test_wrong_credentials_are_401(scheduler, given):
    hostile("authorization", given)
    app = create_app(scheduler, MODEL, api_key="s3cret")
    assert call(app, "GET", "/v1/models", headers={"authorization": given.encode()}).status_code == 401


@pytest.mark.parametrize("key", ["s3cret\n", "s3cret\r\n", "  s3cret ", "\ts3cret"])
def test_the_cli_strips_the_key(tiny_bundle, monkeypatch, key):
    from click.testing import CliRunner

    from runtime.cli import main

    hostile("api key", key)
    seen = {}
    monkeypatch.setenv("DRAFTSMITH_API_KEY", key)
    monkeypatch.setattr(openai_server, "serve", lambda *a, **k: seen.update(k))
    result = CliRunner().invoke(main, ["serve-openai", str(tiny_bundle), "--port", "1"])
    assert result.exit_code == 0, result.output
    assert seen["api_key"] == "s3cret"


@pytest.mark.parametrize("key", ["\n", "\r\n", " \t "])
def test_a_key_empty_after_stripping_is_refused(scheduler, key):
    hostile("api key", key)
    with pytest.raises(ValueError, match="empty"):
        create_app(scheduler, MODEL, api_key=key)


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "127.0.0.2",
        "127.255.255.254",
        "::1",
        "::ffff:127.0.0.1",
        "::ffff:127.1.2.3",
        "localhost",
        "LocalHost",
    ],
)
def test_every_loopback_address_is_loopback(host):
    hostile("loopback", host)
    assert openai_server.is_loopback(host)


@pytest.mark.parametrize(
    "host",
    [
        "0.0.0.0",
        "::",
        "10.0.0.1",
        "::ffff:10.0.0.1",
        "128.0.0.1",
        "127.0.0.1.nip.io",
        "localhost.evil",
        "",
        "[::1]",
        "fe80::1",
        "::ffff:0.0.0.0",
    ],
)
def test_other_addresses_are_not(host):
    hostile("loopback", host)
    assert not openai_server.is_loopback(host)


@pytest.mark.parametrize("host", ["127.0.0.2:8000", "[::ffff:127.0.0.1]:8000", "127.0.0.3"])
def test_a_loopback_server_answers_every_loopback_address(app, host):
    assert call(app, "GET", "/v1/models", headers={"host": host}).status_code == 200


def test_a_server_bound_to_another_loopback_address_checks_host_names(monkeypatch):
    assert openai_server.allowed_hosts_for("127.0.0.2") is not None
    assert openai_server.allowed_hosts_for("::ffff:127.0.0.1") is not None
    assert openai_server.allowed_hosts_for("0.0.0.0") is None


def test_one_failing_admission_fails_only_its_own_request(generator, monkeypatch):
    engine = generator.target
    real = engine.prefill_rows
    poison = generator.encode_prompt("poison pill", False)[:-1]

    def picky(cache, rows, chunks):
        if any(list(map(int, chunk)) == poison for chunk in chunks):
            raise MemoryError("this request's prefill ran out of memory")
        return real(cache, rows, chunks)

    monkeypatch.setattr(engine, "prefill_rows", picky)
    scheduler = Scheduler(generator, max_batch=4)
    handles = [scheduler.submit(p, max_new_tokens=3) for p in ("hello there", "poison pill", "The quick")]
    while scheduler.step():
        pass
    assert handles[0].result().token_ids and handles[2].result().token_ids
    with pytest.raises(Exception, match="admission failed"):
        handles[1].result()


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


def test_dependency_floors_exclude_the_advisories():
    import re
    from importlib.metadata import version
    from pathlib import Path

    text = Path(__file__).resolve().parents[1].joinpath("pyproject.toml").read_text()
    serve = re.search(r"^serve = \[(.*)\]", text, re.M).group(1)
    floors = dict(re.findall(r'"([a-z0-9]+)>=([0-9.]+)', serve))
    assert tuple(map(int, floors["h11"].split("."))) >= (0, 16)
    assert tuple(map(int, floors["starlette"].split("."))) >= (0, 47, 2)
    for name, floor in floors.items():  # the environment the tests run in satisfies them
        have = tuple(int(p) for p in re.findall(r"\d+", version(name))[:3])
        assert have >= tuple(map(int, floor.split("."))), name


def test_hostile_input_count():
    """Run last in this file: the distinct hostile inputs above, by class."""
    if len(HOSTILE) < 5:
        pytest.skip("counts only when the whole file runs")
    total = sum(len(v) for v in HOSTILE.values())
    print({k: len(v) for k, v in HOSTILE.items()}, total)
    assert total >= 35
