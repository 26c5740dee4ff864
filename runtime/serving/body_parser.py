"""A request body parsed and validated where it cannot hold the event loop.

Parsing JSON holds Python's interpreter lock for the whole call: on a thread it still stops the event loop, and so
every other connection. A body of ordinary requests parses in a few milliseconds, so it is parsed on a thread. A
body of many small values costs in proportion to their number (a 4 MB ``metadata`` array of 2M zeros: ~135 ms of
``json.loads``, any thread): such a body is parsed and validated in a worker process of its own, at the lowest CPU
priority (it does not slow the decoding threads either), and only what the request model kept comes back, at most
INLINE_VALUES values (what a body parsed on a thread can hold; more is refused: no request needs it), or its errors,
a few, without the input they quote. So what the event loop's process unpickles is as bounded as what it parses.

The number of values is counted from the raw bytes (``,`` and ``:``, C-speed: ~4 ms for 4 MB) before any parse;
commas inside strings count too, which can only send a body to the worker needlessly, never keep one out of it.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from pydantic import ValidationError

from runtime.core.handles import Overloaded
from runtime.serving.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

INLINE_VALUES = 65_536  # values a body may have and still be parsed on a thread (json.loads: ~5 ms)
WORKER_PENDING = 4  # large bodies parsing or waiting to; past it, a 429 (each holds its bytes until parsed)
WORKER_TASKS = 64  # parses a worker runs before it is replaced (what a parse allocates is given back)
ERRORS_KEPT = 20  # validation errors a worker returns (a body of 100k bad messages has 100k)
KINDS: dict[str, type[SamplingRequest]] = {"completion": CompletionRequest, "chat": ChatCompletionRequest}


class BodyError(Exception):
    """The body is not JSON the request model takes: ``problems`` in pydantic's error shape (type, loc, msg, ctx),
    or ``status``/``message`` where it could not be read at all."""

    def __init__(self, problems: list[dict] | None = None, status: int = 400, message: str = ""):
        super().__init__(message or "the request body is invalid")
        self.problems, self.status, self.message = problems, status, message


def value_count(raw: bytes) -> int:
    """An upper bound on the values in a JSON body, read from its bytes: each value but the first follows a ``,``
    or a ``:``."""
    return raw.count(b",") + raw.count(b":")


def parse_body(kind: type[SamplingRequest], raw: bytes) -> tuple[SamplingRequest, object]:
    """(the body as ``kind``, its prompt: text or plain messages); BodyError where it is not one. What FastAPI does
    with a JSON body parameter (fastapi/routing.py), on the caller's thread."""
    if not raw:
        raise BodyError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise BodyError(
            [{"type": "json_invalid", "loc": ("body", err.pos), "msg": "JSON decode error", "ctx": {"error": err.msg}}]
        ) from None
    except (ValueError, RecursionError):  # not UTF-8, nested past the parser's depth
        raise BodyError(message="There was an error parsing the body") from None
    try:
        body = kind.model_validate(data)
    except ValidationError as err:
        raise BodyError([{**e, "loc": ("body", *e["loc"])} for e in err.errors()]) from None
    return body, body.prompt if isinstance(body, CompletionRequest) else body.plain_messages()


def parse_in_worker(kind_name: str, raw: bytes):
    """``parse_body`` in the worker process: ("ok", body, prompt), or ("error", problems, status, message) with
    the problems cut to ERRORS_KEPT and to what a response names (no ``input``: it can be the whole body)."""
    try:
        body, prompt = parse_body(KINDS[kind_name], raw)
    except BodyError as err:
        return "error", [_slim(p) for p in (err.problems or [])[:ERRORS_KEPT]], err.status, err.message
    kept = _values(body.model_dump(exclude_none=True))
    if kept > INLINE_VALUES:
        message = (
            f"the request holds {kept} JSON values; this server takes at most {INLINE_VALUES} in one request: send less"
        )
        return "error", [], 400, message
    return "ok", body, prompt


def _values(data) -> int:
    """The JSON values in ``data`` (plain dicts, lists and scalars), counted without recursion."""
    count, stack = 0, [data]
    while stack:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return count


def _slim(problem: dict) -> dict:
    """A pydantic error with what the server's answer reads of it: its type, location, message and the
    decoder's reason, all plain data."""
    ctx = problem.get("ctx") or {}
    kept = {"type": problem.get("type"), "loc": tuple(problem.get("loc", ())), "msg": str(problem.get("msg", ""))}
    return kept | ({"ctx": {"error": str(ctx["error"])[:300]}} if "error" in ctx else {})


def _lowest_priority() -> None:
    """The worker's initializer: it yields the CPU to the decoding threads."""
    try:
        os.nice(19)
    except OSError:  # not allowed here: it still keeps the event loop free
        pass


class BodyParser:
    """Parses request bodies for one server: on a thread when small, else in its worker process (made at the
    first such body, at most WORKER_PENDING of them in at once: past it Overloaded)."""

    def __init__(self, inline_values: int = INLINE_VALUES, pending: int = WORKER_PENDING):
        self.inline_values, self.max_pending, self.pending = inline_values, pending, 0
        self._pool: ProcessPoolExecutor | None = None
        self.sent_to_worker = 0  # bodies parsed by the worker (a test and the bench read it)

    async def parse(self, kind: type[SamplingRequest], raw: bytes) -> tuple[SamplingRequest, object]:
        if value_count(raw) <= self.inline_values:
            return await asyncio.to_thread(parse_body, kind, raw)
        if self.pending >= self.max_pending:
            raise Overloaded(f"overloaded: {self.pending} large request bodies are being parsed (the limit)")
        self.pending += 1  # the event loop is one thread: the count needs no lock
        try:
            outcome = await self._in_worker(kind, raw)
        finally:
            self.pending -= 1
        if outcome[0] == "ok":
            return outcome[1], outcome[2]
        _, problems, status, message = outcome
        raise BodyError(problems or None, status, message)

    async def _in_worker(self, kind: type[SamplingRequest], raw: bytes):
        name = next(name for name, model in KINDS.items() if model is kind)
        self.sent_to_worker += 1
        try:
            # submitted from a thread: the first submit starts the worker process (tens of ms), and each one copies
            # the body into the worker's queue
            future = await asyncio.to_thread(self._worker().submit, parse_in_worker, name, raw)
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:  # the worker died (killed, out of memory): a new one for the next body
            self._pool = None
            raise

    def start(self) -> "BodyParser":
        """Start the worker process now and wait until it has parsed a body: a server calls it before it listens,
        so no request waits for a process start (or its imports) while others are served."""
        self._worker().submit(parse_in_worker, "completion", b"{}").result()
        return self

    def _worker(self) -> ProcessPoolExecutor:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")  # never fork a process that runs ONNX Runtime's threads
            self._pool = ProcessPoolExecutor(
                1, mp_context=context, initializer=_lowest_priority, max_tasks_per_child=WORKER_TASKS
            )
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
