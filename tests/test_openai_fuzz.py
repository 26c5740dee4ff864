"""Property-based fuzzing of the OpenAI server's request schema (hypothesis): whatever a client sends, the answer is
a 2xx or a clear 4xx in OpenAI's error shape (never a 5xx, never a hang), and a good request still succeeds after."""

from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from runtime.serving.openai_server import create_app  # noqa: E402
from runtime.core.scheduler import Scheduler  # noqa: E402

MODEL = "tiny"
SEEN: set[str] = set()  # distinct hostile bodies sent (the hardening issue counts them)

texts = st.one_of(
    st.text(max_size=40), st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "\u202e", "🙂" * 30, "x" * 5000])
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), texts
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "tool", "root"]), values),
        "content": st.one_of(texts, values),
    }
)
FIELDS = {
    "model": st.one_of(st.just(MODEL), values),
    "max_tokens": st.one_of(st.integers(-3, 40), values),
    "temperature": st.one_of(st.floats(-1, 3), values),
    "top_p": st.one_of(st.floats(-0.5, 1.5), values),
    "top_k": st.one_of(st.integers(-2, 50), values),
    "seed": st.one_of(st.integers(-5, 2**65), values),
    "stop": st.one_of(texts, st.lists(texts, max_size=20), values),
    "n": st.one_of(st.integers(-1, 3), values),
    "stream": st.one_of(st.booleans(), values),
    "num_draft_tokens": st.one_of(st.integers(-2, 20), values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), values),
    "logprobs": values,
    "response_format": values,
    "tools": values,
    "tool_choice": values,
}
junk = st.dictionaries(texts, values, max_size=3)


def completion_bodies():
    return st.tuples(st.fixed_dictionaries({"prompt": st.one_of(texts, values)}, optional=FIELDS), junk).map(
        lambda pair: {**pair[1], **pair[0]}
    )


def chat_bodies():
    return st.tuples(
        st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=5), values)}, optional=FIELDS), junk
    ).map(lambda pair: {**pair[1], **pair[0]})


@pytest.fixture(scope="module")
def client(tiny_bundle):
    from runtime.api import SpeculativeGenerator

    scheduler = Scheduler(SpeculativeGenerator.from_bundle(tiny_bundle, threads=1), max_batch=4).start()
    app = create_app(scheduler, MODEL, request_timeout=20)
    loop = asyncio.new_event_loop()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")

    def post(path: str, body) -> httpx.Response:
        raw = json.dumps(body, allow_nan=True).encode() if not isinstance(body, bytes) else body
        return loop.run_until_complete(
            asyncio.wait_for(http.post(path, content=raw, headers={"content-type": "application/json"}), 30)
        )

    yield post
    loop.run_until_complete(http.aclose())
    loop.close()
    scheduler.stop()


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and isinstance(error["message"], str)


def good(post) -> None:
    response = post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] is not None


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@FUZZ
@given(body=completion_bodies())
def test_completions_never_answer_a_client_error_with_a_5xx(client, body):
    for key in ("max_tokens",):  # keep the answers short: the fuzz tests the door, not decoding
        if isinstance(body.get(key), int) and body[key] > 8:
            body[key] = 8
    SEEN.add("c" + json.dumps(body, sort_keys=True, allow_nan=True, default=str))
    check(client("/v1/completions", body))


@FUZZ
@given(body=chat_bodies())
def test_chat_never_answers_a_client_error_with_a_5xx(client, body):
    body.setdefault("max_tokens", 4)
    SEEN.add("m" + json.dumps(body, sort_keys=True, allow_nan=True, default=str))
    check(client("/v1/chat/completions", body))


@FUZZ
@given(
    raw=st.one_of(
        st.binary(max_size=200),
        st.text(max_size=200).map(lambda t: t.encode("utf-8", "replace")),
        st.sampled_from([b"[" * 10000, b'{"a":' * 5000, b"\xff\xfe", b"", b"null", b"1e999999"]),
    )
)
def test_bodies_that_are_not_json_objects_are_4xx(client, raw):
    SEEN.add("r" + raw.hex())
    check(client("/v1/completions", raw))
    check(client("/v1/chat/completions", raw))


def test_the_server_still_serves_after_the_fuzz(client):
    good(client)
    assert len(SEEN) >= 300  # distinct hostile bodies tried above
