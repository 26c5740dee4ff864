"""Request bodies parsed where they cannot hold the event loop (runtime/serving/body_parser.py): a body of many
values goes to the worker process, which answers with the same validated body as a thread would, or with a few
errors that quote no input; what comes back is bounded; past the pending bound a large body is a 429. And the
server's event-loop lag (runtime/serving/loop_lag.py) records a loop that was held."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi")

from openai_asgi import MODEL, call, chat  # noqa: E402
from runtime.serving.body_parser import INLINE_VALUES, BodyError, BodyParser, parse_body, value_count  # noqa: E402
from runtime.core.handles import Overloaded  # noqa: E402
from runtime.serving.loop_lag import LoopLag  # noqa: E402
from runtime.serving.openai_protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402

MANY = INLINE_VALUES + 1000  # values past what a thread parses


def _raw(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _parse(parser: BodyParser, kind, body: dict):
    return asyncio.run(parser.parse(kind, _raw(body)))


def test_the_value_count_bounds_the_values_from_above():
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a, b: c"}], "metadata": {"k": "v"}}
    assert value_count(_raw(body)) >= 7  # model, messages, role, content, metadata, k (+ the text's , and :)
    assert value_count(_raw({"metadata": {"a": [0] * MANY}})) == MANY + 1  # 2 colons, MANY - 1 commas


def test_a_body_sent_to_the_worker_is_the_body_a_thread_parses():
    """Every body to the worker (inline_values 0): the same validated request and prompt as parsed in-process."""
    parser = BodyParser(inline_values=0)
    try:
        for kind, body in (
            (ChatCompletionRequest, chat(stop=["\n\n"], temperature=0.5, metadata={"k": "v"})),
            (CompletionRequest, {"model": MODEL, "prompt": "x," * 100, "max_tokens": 3, "seed": 7}),
        ):
            got, prompt = _parse(parser, kind, body)
            want, want_prompt = parse_body(kind, _raw(body))
            assert got == want and prompt == want_prompt
        assert parser.sent_to_worker == 2
    finally:
        parser.close()


def test_the_worker_refuses_a_body_it_would_send_back_unbounded():
    """A schema of more values than a thread parses validates (it is a dict) but is refused in the worker, so the
    server's process never unpickles it; a huge metadata is refused by name, as in-process."""
    parser = BodyParser()
    try:
        fmt = {"type": "json_schema", "json_schema": {"schema": {"enum": list(range(MANY))}}}
        with pytest.raises(BodyError) as refused:
            _parse(parser, ChatCompletionRequest, chat(response_format=fmt))
        assert refused.value.status == 400 and "JSON values" in refused.value.message
        with pytest.raises(BodyError) as refused:
            _parse(parser, ChatCompletionRequest, chat(metadata={"a": [0] * MANY}))
        assert refused.value.problems[0]["loc"] == ("body", "metadata")
        assert parser.sent_to_worker == 2
    finally:
        parser.close()


def test_the_workers_errors_are_few_and_quote_no_input():
    parser = BodyParser(inline_values=0)
    try:
        body = {"model": MODEL, "messages": [{"role": "nobody", "content": "x" * 1000}] * 500}
        with pytest.raises(BodyError) as refused:
            _parse(parser, ChatCompletionRequest, body)
        problems = refused.value.problems
        assert 1 <= len(problems) <= 20 and all("input" not in p for p in problems)
        assert problems[0]["loc"][:2] == ("body", "messages")
        with pytest.raises(BodyError) as refused:  # not JSON: the decoder's reason comes back
            asyncio.run(parser.parse(CompletionRequest, b'{"prompt": [' + b"0," * MANY + b"}"))
        assert refused.value.problems[0]["type"] == "json_invalid"
    finally:
        parser.close()


def test_past_the_pending_bound_a_large_body_is_overloaded():
    parser = BodyParser(pending=0)
    with pytest.raises(Overloaded):
        _parse(parser, ChatCompletionRequest, chat(metadata={"a": [0] * MANY}))
    small, _ = _parse(parser, ChatCompletionRequest, chat())  # a small body is parsed on a thread as before
    assert small.messages[0].content == "hi" and parser.sent_to_worker == 0


def test_the_server_sends_a_body_of_many_values_to_its_worker(scheduler):
    """Through the app, with a body limit that admits it: the 4 MB-class metadata body is a 400 naming metadata,
    parsed by the worker; the next ordinary request is answered."""
    from runtime.core.request import Limits
    from runtime.serving.openai_server import LOOPBACK_HOSTS, create_app

    limits = Limits.for_context(scheduler.bundle.max_context, max_body_bytes=4 << 20)
    app = create_app(scheduler, MODEL, allowed_hosts=LOOPBACK_HOSTS, limits=limits)
    try:
        raw = _raw(chat(metadata={"a": [0] * MANY}))
        refused = call(app, "POST", "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "metadata", refused.text
        assert app.state.body_parser.sent_to_worker == 1
        assert call(app, "POST", "/v1/chat/completions", json=chat()).status_code == 200
    finally:
        app.state.body_parser.close()


def test_the_loop_lag_records_a_held_loop():
    """A loop held 150 ms (a blocking call in a coroutine) shows as a lag of at least 100 ms; its histogram is in
    Prometheus' text format."""
    lag = LoopLag(interval=0.005)

    async def run():
        lag.start()
        await asyncio.sleep(0.03)
        time.sleep(0.15)  # holds the loop, as a parse on it would
        await asyncio.sleep(0.03)
        await lag.stop()

    asyncio.run(run())
    assert lag.largest >= 0.1 and lag.histogram.observed >= 3
    text = lag.prometheus()
    assert 'draftsmith_event_loop_lag_seconds_bucket{le="+Inf"}' in text
    assert f"draftsmith_event_loop_lag_seconds_count {lag.histogram.observed}" in text


def test_the_server_settles_the_collector_before_it_serves():
    """What exists at start is frozen out of the collector's generations (a full collection over it held the loop
    50-100 ms under load), and what is made later is still collected."""
    import gc

    from runtime.serving.openai_server import settle_garbage_collector

    try:
        settle_garbage_collector()
        assert gc.get_freeze_count() > 0
        cycle: list = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # a cycle made after the freeze is found and freed
    finally:
        gc.unfreeze()


def test_the_warm_up_request_runs_through_the_app(scheduler):
    """serve-openai's warm-up: one streamed completion through the app before it listens, counted like any other;
    a server it cannot reach (another model name: a 404) is warned about, not fatal."""
    from runtime.serving.openai_server import LOOPBACK_HOSTS, create_app, warm_up

    app = create_app(scheduler, MODEL, allowed_hosts=LOOPBACK_HOSTS)
    before = scheduler.bundle.metrics.snapshot()
    warm_up(app, MODEL, None)
    after = scheduler.bundle.metrics.snapshot()
    assert after.total.num_emitted_tokens > before.total.num_emitted_tokens
    warm_up(app, "another-model", None)  # answered 404: a warning, no exception
