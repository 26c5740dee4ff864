"""An OpenAI-compatible HTTP server over the in-flight batching Scheduler: FastAPI routes, run by uvicorn.

Longer than most modules: routes, the ASGI guard and the stream bridge are one server; request bodies are
runtime/serving/openai_protocol.py, responses runtime/serving/openai_responses.py, shutdown runtime/serving/drain.py.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true``: server-sent events in OpenAI's
chunk shapes, ending in ``data: [DONE]``), ``GET /v1/models[/{model}]``, ``GET /health`` (no key) and
``GET /metrics`` (Prometheus text). Request bodies: runtime/serving/openai_protocol.py.

Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 a bad request (validation, a
bound, the scheduler's RequestError), 401 a missing or wrong API key, 404 an unknown model or route, 413 a body over
the limit, 429 overloaded (the queue is full, or a request waited too long for a row; with Retry-After, so OpenAI's
clients back off and retry), 500 anything else, logged here and never described to the client. A streamed request
waits for its first text before the response starts, so an error until then gets its status code; a later one is
sent as an error event, then ``[DONE]``. A client that disconnects cancels its request: its row leaves the batch at
the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import hmac
import ipaddress
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.core.handles import Generation
from runtime.serving.connections import (
    ConnectionLimits,
    ProbeServer,
    client_key,
    raise_file_limit,
    server_config,
    trusted_proxies,
)
from runtime.serving.drain import Drain, DrainGuard, DrainingServer, probe_app
from runtime.errors import RequestError
from runtime.core.loaded import LoadedBundle
from runtime.core.handles import Event, Overloaded, Unavailable, is_stopping
from runtime.serving.body_parser import BodyError, BodyParser
from runtime.core.health import scheduler_problem
from runtime.serving.loop_lag import LoopLag
from runtime.serving.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from runtime.serving.openai_responses import (
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    Completion,
    Delta,
    ResponseShape,
    Usage,
    error_body,
    new_id,
)
from runtime.metric_families import CONTENT_TYPE, prometheus_text, read
from runtime.core.request import Asked, FrontDoor, Limits
from runtime.serving.pacing import RefusalPacer, RefusalPacing
from runtime.core.scheduler import PREFILL_CHUNK, Scheduler

log = logging.getLogger("draftsmith.openai")
DEFAULT_PACING = RefusalPacing()  # serve-openai's: 8 refusals a second a client at once, then 50 ms more each

DISCONNECT_POLL_S = 0.5  # how often a request waiting for text checks that its client is still there


class APIError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type, param, code), headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, self.status, headers=self.headers)


def overloaded(err: Overloaded) -> APIError:
    return APIError(429, str(err), "rate_limit_error", code="server_overloaded", headers={"Retry-After": "1"})


def create_app(
    scheduler: Scheduler,
    model_name: str,
    api_key: str | None = None,
    limits: Limits | None = None,
    request_timeout: float | None = None,
    drain: Drain | None = None,
    allowed_hosts: tuple[str, ...] | None = None,
    refusal_pacing: RefusalPacing | None = None,
) -> FastAPI:
    """The server's app over a started ``scheduler``.

    model_name: the one model requests must name; api_key: required as ``Authorization: Bearer KEY`` on every route
    but /health (None: open); limits: per-request bounds (default: from the bundle's context);
    request_timeout: seconds after which a request ends with finish_reason "timeout" (None: none);
    allowed_hosts: the Host header names answered (None: any; ``serve`` on loopback: LOOPBACK_HOSTS);
    drain: graceful shutdown (runtime/serving/drain.py): /health backed by the scheduler's loop and the drain, 503s
    while draining, /health/live (None: none); refusal_pacing: a client's refusals past a few a second answered
    late (runtime/serving/pacing.py; None: at once). /metrics: the families of runtime/metric_families.py's table,
    read from the bundle's registry and this scheduler (the Triton model exports the same table).
    """
    limits = limits or Limits.for_context(scheduler.bundle.max_context)
    api_key_bytes(api_key)  # an empty key is refused here, not at the first request (middleware is built lazily)
    lag, parser = LoopLag(), BodyParser()
    app = FastAPI(title="Draftsmith", docs_url=None, redoc_url=None, openapi_url=None, lifespan=_lifespan(lag, parser))
    app.add_middleware(
        _Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes, allowed_hosts=allowed_hosts, lag=lag
    )
    if drain is not None:  # added last: outermost, before the key check (a refusal does no work)
        app.add_middleware(DrainGuard, drain=drain, problem=lambda live: scheduler_problem(scheduler, live))
    if refusal_pacing is not None:  # outermost: every refusal, the guards' own included, is paced
        app.add_middleware(RefusalPacer, pacing=refusal_pacing)
    app.state.body_parser = parser  # tests read which path a body took, and stop its worker
    _add_error_handlers(app)
    _add_model_routes(app, scheduler, model_name, lag)
    door = FrontDoor(scheduler.bundle, limits, room=scheduler.check_room)  # a full queue refuses before any work
    replies = _Replies(scheduler, model_name, door, request_timeout)
    _add_completion_routes(app, replies, parser)
    return app


def warm_up(app: FastAPI, model_name: str, api_key: str | None) -> None:
    """One streamed two-token completion through the whole app, in-process, before the server listens: what the
    first request does once (routes and serializers set up, the door's and the scheduler's first use, the stream's
    first chunks) is done then, not beside the first clients (a fresh server's event loop lagged 50-100 ms once in
    its first minute under 16 streams). It is counted in /metrics like any request."""
    import httpx

    async def request() -> None:
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        body = {"model": model_name, "prompt": "Hello", "max_tokens": 2, "stream": True, "temperature": 0}
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", headers=headers) as client:
            async with client.stream("POST", "/v1/completions", json=body, timeout=60) as response:
                async for _ in response.aiter_bytes():
                    pass
                if response.status_code != 200:
                    log.warning("the warm-up request was answered %d; serving anyway", response.status_code)

    try:
        asyncio.run(request())
    except Exception as err:  # a warm-up is an optimisation: the server serves without it
        log.warning("the warm-up request failed (%s); serving anyway", err)


def settle_garbage_collector() -> None:
    """Everything made at start (the bundle, tokenizer, templates, the libraries' modules: ~10^6 objects) moved out
    of the collector's generations once: each full collection would walk them all again, holding the interpreter
    lock — and so the event loop — ~50-100 ms at a time while 16 streams were served (the loop's lag, measured)."""
    gc.collect()
    gc.freeze()


def _lifespan(lag: LoopLag, parser: BodyParser):
    """The app's life under a server that sends lifespan events: the loop's lag watched from the start (else from
    the first request), the body parser's worker (if one was made) stopped after."""

    @contextlib.asynccontextmanager
    async def life(app: FastAPI):
        lag.start()
        try:
            yield
        finally:
            await lag.stop()
            parser.close()

    return life


def _add_model_routes(app: FastAPI, scheduler: Scheduler, model_name: str, lag: LoopLag) -> None:
    """/health, /v1/models[/{model}] and /metrics: what the server is and how it is doing."""
    card = {
        "id": model_name,
        "object": "model",
        "created": 0,
        "owned_by": "draftsmith",
        "max_model_len": scheduler.bundle.max_context,
    }

    @app.get("/health")
    async def health() -> dict:
        problem = scheduler_problem(scheduler)  # the loop died or is stopping, or the engine keeps failing
        if problem:
            raise APIError(503, problem, type="server_error", code="unavailable")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        _check_model(model, model_name)
        return card

    @app.get("/metrics")
    async def metrics() -> Response:
        text = prometheus_text(read(scheduler.bundle.metrics, scheduler, model_name)) + lag.prometheus()
        return PlainTextResponse(text, media_type=CONTENT_TYPE)


def _add_completion_routes(app: FastAPI, replies: _Replies, parser: BodyParser) -> None:
    """/v1/completions and /v1/chat/completions: a body parsed by ``parser`` and validated by its model
    (runtime/serving/openai_protocol.py), then answered by ``replies``."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body, prompt = await _parsed(request, CompletionRequest, parser)
        return await replies.reply(body, prompt, False, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body, prompt = await _parsed(request, ChatCompletionRequest, parser)
        return await replies.reply(body, prompt, True, request)


async def _parsed(request: Request, kind: type[SamplingRequest], parser: BodyParser) -> tuple[SamplingRequest, object]:
    """(the body as ``kind``, its prompt), parsed and validated off the event loop by ``parser`` (both cost the
    body's size, up to the body limit: a 4 MB body on the loop held every other connection ~1 s). Its errors are
    FastAPI's own (RequestValidationError, answered by ``_add_error_handlers``)."""
    raw = await request.body()  # read whole already, by _Guard
    try:
        return await parser.parse(kind, raw)
    except BodyError as err:
        if err.problems:
            raise RequestValidationError(err.problems) from None
        raise StarletteHTTPException(err.status, err.message) from None
    except Overloaded as err:
        raise overloaded(err) from None


GRAMMAR_WORKERS = 2  # grammar compiles running at once, on a pool of their own (the default pool tokenizes)
GRAMMAR_PENDING = 32  # structured-output requests compiling or waiting to; past it: 429
SHAPE_WORKERS = 2  # threads that shape and serialise log-probabilities, off the event loop


class _Pools:
    """A server's thread pools besides the default one (which tokenizes and renders every request): grammar
    compiles (bounded: ``GRAMMAR_PENDING`` compiling or waiting, else Overloaded) and log-probability shaping. Each
    has a few threads, so neither can take every core nor starve the other requests."""

    def __init__(self):
        self.grammar = ThreadPoolExecutor(GRAMMAR_WORKERS, thread_name_prefix="draftsmith-grammar")
        self.shape = ThreadPoolExecutor(SHAPE_WORKERS, thread_name_prefix="draftsmith-shape")
        self.compiling, self.max_compiling = 0, GRAMMAR_PENDING

    async def compile(self, work: Callable, *args):
        """``work(*args)`` on the grammar pool; Overloaded at once when GRAMMAR_PENDING are already in (the event
        loop is one thread: the count needs no lock)."""
        if self.compiling >= self.max_compiling:
            raise Overloaded(
                f"overloaded: {self.compiling} structured-output requests are compiling (the limit); retry later"
            )
        self.compiling += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.grammar, work, *args)
        finally:
            self.compiling -= 1

    async def admission(self, admit: Callable, asked: Asked):
        """``admit(asked)`` (the front door's one call) off the event loop: on the grammar pool where it compiles a
        response format (bounded: ``compile``), else on the default pool, which tokenizes every other request."""
        if asked.fields.get("response_format") is not None:
            return await self.compile(admit, asked)
        return await asyncio.to_thread(admit, asked)

    async def shaped(self, work: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.shape, work, *args)


@dataclasses.dataclass(frozen=True)
class _Replies:
    """How a completion request is answered: checked, submitted to the scheduler, then answered whole or streamed;
    a client that leaves, or a server that stops, frees its row."""

    scheduler: Scheduler
    model_name: str
    door: FrontDoor  # the bundle's, with this server's limits and its scheduler's room
    request_timeout: float | None
    pools: _Pools = dataclasses.field(default_factory=_Pools)

    async def reply(self, body: SamplingRequest, prompt, chat: bool, request: Request) -> Response:
        """The response: 499 (nobody reads it) when the client went away before its text, the first event's error
        with its status code, else the stream or the whole answer."""
        handle, bridge, param = await self.submit(body, prompt, chat, request)
        shape = ResponseShape.of(body, chat, self.scheduler.bundle.tokenizer)
        pools = self.pools if shape.logprobs is not None else None  # shaping log-probabilities is the heavy part
        chunks, streaming = _Chunks(chat, self.model_name, body.include_usage, shape, pools), False
        try:
            first = await bridge.next(request)
            if first is None:
                return Response(status_code=499)  # the client went away: nobody reads this
            if first.error is not None:
                return _event_error(first.error, param).response()
            if body.stream:
                streaming = True  # from here the response's on_close cancels
                return _EventStream(chunks.stream(first, bridge, param), on_close=handle.cancel)
            generation = await bridge.final(first, request, param)
        finally:
            if not streaming:
                handle.cancel()  # a no-op once finished; frees the row if the client left or the server stops
        if generation is None:
            return Response(status_code=499)  # the client went away: nobody reads this
        if pools is None:
            return Response(_json_bytes(chunks.whole(generation)), media_type="application/json")
        return Response(
            await pools.shaped(lambda: _json_bytes(chunks.whole(generation))), media_type="application/json"
        )

    async def submit(self, body: SamplingRequest, prompt, chat: bool, request: Request):
        """(the scheduler's handle, the bridge its events arrive on, the field its own errors name) of a request
        through the front door (runtime/core/request.py: one call, run off the loop, on the grammar pool where it
        compiles a response format); its refusals as OpenAI's errors (404 another model, 400 a bad request naming
        the field, 429 overloaded, 503 unavailable)."""
        _check_model(body.model, self.model_name)
        asked = body.asked(prompt, chat)
        bridge = _Bridge()
        try:
            admitted = await self.pools.admission(self.door.admit, asked)
            handle = self.scheduler.enqueue(
                admitted, timeout=self.request_timeout, sink=bridge.put, client=_client_of(request)
            )[0]
        except Overloaded as err:
            raise overloaded(err) from None
        except RequestError as err:
            raise APIError(400, str(err), param=err.field) from None
        except Unavailable as err:
            raise _event_error(err) from None
        return handle, bridge, asked.names["response_format"] if admitted.config.grammar is not None else None


def _json_bytes(model) -> bytes:
    """A response model as JSONResponse writes it (compact, UTF-8, no NaN)."""
    return json.dumps(
        model.model_dump(mode="json"), ensure_ascii=False, allow_nan=False, separators=(",", ":")
    ).encode()


def _prepare_grammars(loaded: LoadedBundle) -> None:
    """Make the grammar compiler and read the tokens' bytes before serving, so no request waits for them. Where
    llguidance is missing or cannot read the bundle's tokenizer (a WordPiece decoder), the server still starts and
    serves the rest: said here once, and per request with a 400 saying why (the front door's, ``Asked.token_bytes``)."""
    try:
        loaded.grammar_compiler()
    except RequestError as err:
        log.warning("%s; requests with response_format or tools will be refused", err)
    why = loaded.tokenizer.bytes_problem()
    if why:
        log.warning(
            "chat logprobs are unavailable for this bundle: %s; chat requests with logprobs will be refused", why
        )


def _client_of(request: Request) -> str:
    """Whom the scheduler shares rows among: the peer's address (never a header a client could set, unless its
    peer is a proxy named by ``--trusted-proxy``), an IPv6 one by its /64 (``client_key``)."""
    return client_key(request.client.host) if request.client else ""


def _check_model(model: str, served: str) -> None:
    if model != served:
        raise APIError(
            404,
            f"The model {model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def _event_error(error: Exception, param: str | None = None) -> APIError:
    """An error the scheduler sent instead of text: overloaded (waited too long), the request's own (its grammar
    stopped it mid-decode: a 400 naming ``param``), or a server fault."""
    if isinstance(error, Overloaded):
        return overloaded(error)
    if isinstance(error, RequestError):
        return APIError(400, str(error), param=param)
    if is_stopping(error):
        return APIError(503, "the server is shutting down; retry on another", "server_error")
    log.error("generation failed: %s", error)
    return APIError(500, "the server failed while generating this completion; retry later", "server_error")


class _Bridge:
    """A request's events, from the scheduler thread to this event loop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.checked = self.loop.time()  # when the client was last seen connected

    def put(self, event: Event) -> None:
        """The scheduler's sink (its thread): must not raise there."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed: the server is gone
            pass

    async def next(self, request: Request) -> Event | None:
        """The next event, or None once the client has disconnected (checked every DISCONNECT_POLL_S, whether
        events keep coming or not)."""
        getter = asyncio.ensure_future(self.queue.get())
        try:
            while True:
                wait = self.checked + DISCONNECT_POLL_S - self.loop.time()
                done, _ = await asyncio.wait({getter}, timeout=max(0.0, wait))
                if self.loop.time() - self.checked >= DISCONNECT_POLL_S:
                    if await request.is_disconnected():
                        return None
                    self.checked = self.loop.time()
                if done:
                    return getter.result()
        finally:
            getter.cancel()

    async def final(self, event: Event, request: Request, param: str | None = None) -> Generation | None:
        """Events from ``event`` on until the final Generation (None: the client left); raises an error event."""
        while event is not None:
            if event.error is not None:
                raise _event_error(event.error, param)
            if event.final is not None:
                return event.final
            event = await self.next(request)
        return None


class _Chunks:
    """One request's response objects: whole, or as server-sent events."""

    def __init__(
        self,
        chat: bool,
        model: str,
        include_usage: bool,
        shape: ResponseShape | None = None,
        pools: _Pools | None = None,
    ):
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.shape = shape or ResponseShape(chat, None)  # log-probabilities and tool calls (openai_protocol.py)
        self.pools = pools  # shape chunks with log-probabilities there, off the event loop (None: here)

    def whole(self, g: Generation) -> Completion | ChatCompletion:
        usage = Usage.of(g.prompt_tokens, len(g.token_ids))
        if self.chat:
            return ChatCompletion(id=self.id, model=self.model, usage=usage, choices=[self.shape.choice(g)])
        return Completion(id=self.id, model=self.model, usage=usage, choices=[self.shape.choice(g)])

    async def stream(self, event: Event, bridge: _Bridge, param: str | None = None) -> AsyncIterator[str]:
        """Chunks from the first event on (the client's disconnect cancels this, see _EventStream); an error event
        names ``param`` when it is the request's own."""
        if self.chat:
            yield self._chunk("", role=True)
        while True:
            if event.error is not None:
                yield _sse(_event_error(event.error, param).body)
                break
            logprobs = event.logprobs if event.logprobs and event.logprobs[0] else None  # (tokens, logprobs, top)
            if event.piece or (logprobs and event.final is None):
                chunk = await self._shaped(event.piece, logprobs=logprobs)
                logprobs = None
                if chunk:
                    yield chunk
                await asyncio.sleep(0)  # let a lost connection be noticed before a burst of queued events is written
            if event.final is not None:
                g = event.final
                yield await self._shaped("", reason=self.shape.reason(g), final=g, logprobs=logprobs)
                if self.include_usage:
                    yield self._usage(Usage.of(g.prompt_tokens, len(g.token_ids)))
                break
            event = await bridge.queue.get()
        yield "data: [DONE]\n\n"

    async def _shaped(self, text: str, **options) -> str:
        """``_chunk``, on the shaping pool when there is one (log-probabilities: up to 20 alternatives a token)."""
        if self.pools is None:
            return self._chunk(text, **options)
        return await self.pools.shaped(functools.partial(self._chunk, text, **options))

    def _chunk(self, text: str, reason: str | None = None, role: bool = False, logprobs=None, final=None) -> str:
        """One chunk: text (with its tokens' log-probabilities, ``logprobs``: (tokens, logprobs, top)), or the
        finish (``final``: the Generation); "" when there is nothing to send (a tool call's arguments so far)."""
        if self.chat and role:
            choice = ChunkChoice(delta=Delta(role="assistant", content=""))
        else:
            choice = self.shape.chunk(text, *(logprobs or ([], None, None)), reason=reason, final=final)
        if choice is None:
            return ""
        kind = ChatCompletionChunk if self.chat else Completion
        chunk = kind(id=self.id, model=self.model, choices=[choice])
        return _sse(chunk.model_dump(mode="json", exclude=None if self.include_usage else {"usage"}))

    def _usage(self, usage: Usage) -> str:
        kind = ChatCompletionChunk if self.chat else Completion
        return _sse(kind(id=self.id, model=self.model, choices=[], usage=usage).model_dump(mode="json"))


# Characters JSON may carry raw that many line readers (Python's str.splitlines, so httpx's iter_lines) take for line
# breaks: escaped, an event's data stays on one line for every client (json.dumps already escapes the C0 controls).
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':')).translate(_LINE_BREAKS)}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that call ``on_close`` however the response ends: finished, failed, or the client gone
    (Starlette then cancels the stream, or its next send fails)."""

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(
            chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
BODY_SECONDS = 30.0  # a client must send its whole body within this (a slow client holds a connection, not a row)


class _Guard:
    """Pure ASGI, before FastAPI parses anything: the Host header (a server on loopback answers only loopback
    names, so a web page cannot reach it by DNS rebinding), the API key (every route but /health), a POST's
    Content-Type (application/json: a browser cannot send that cross-site without a preflight this server never
    grants), then the body's size (read here whole, at most ``max_body_bytes`` within ``BODY_SECONDS``, and
    handed on)."""

    def __init__(
        self,
        app,
        api_key: str | None,
        max_body_bytes: int,
        allowed_hosts: tuple[str, ...] | None = None,
        lag: LoopLag | None = None,
    ):
        self.app, self.max_body_bytes, self.allowed_hosts, self.lag = app, max_body_bytes, allowed_hosts, lag
        self.key = api_key_bytes(api_key)
        self.loopback = allowed_hosts is not None and any(is_loopback(h) for h in allowed_hosts)

    def answers(self, host: bytes) -> bool:
        """Whether the Host header names this server: one of ``allowed_hosts`` or, on loopback, any loopback
        address (127.0.0.0/8, ::1, ::ffff:127.x.y.z)."""
        name = host_name(host)
        return name in self.allowed_hosts or (self.loopback and is_loopback(name))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.lag is not None:
            self.lag.start()  # a no-op once it watches this loop
        headers = dict(scope["headers"])
        if self.allowed_hosts is not None and not self.answers(headers.get(b"host", b"")):
            error = APIError(
                421,
                f"this server answers only requests addressed to {' or '.join(self.allowed_hosts)} (the Host header)",
                code="misdirected_request",
            )
            return await error.response()(scope, receive, send)
        if self.key is not None and scope["path"] != "/health":
            given = headers.get(b"authorization")
            if not given or not hmac.compare_digest(bearer_token(given), self.key):
                message = (
                    "Incorrect API key provided"
                    if given
                    else "Missing API key: send it as the header 'Authorization: Bearer KEY'"
                )
                error = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await error.response()(scope, receive, send)
        if (
            scope["method"] == "POST"
            and not headers.get(b"content-type", b"").split(b";")[0].strip().lower() == b"application/json"
        ):
            error = APIError(
                415,
                "send the request body as JSON with the header 'Content-Type: application/json'",
                code="unsupported_media_type",
            )
            return await error.response()(scope, receive, send)
        too_large = APIError(
            413,
            f"the request body is over this server's limit of {self.max_body_bytes} bytes",
            param="body",
            code="request_too_large",
        )
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body_bytes:
            return await too_large.response()(scope, receive, send)
        parts, size, more, deadline = [], 0, True, asyncio.get_running_loop().time() + BODY_SECONDS
        while more:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                error = APIError(408, f"the request body did not arrive within {BODY_SECONDS:g} s", code="timeout")
                return await error.response()(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_body_bytes:
                return await too_large.response()(scope, receive, send)
            more = message.get("more_body", False)
        pending = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)


def api_key_bytes(api_key: str | None) -> bytes | None:
    """The key a request must present, stripped (a key read from a file or a Secret often ends in a newline, which no
    client sends); ValueError when nothing is left (an empty key must never mean "no key")."""
    if api_key is None:
        return None
    if not api_key.strip():
        raise ValueError("the API key is empty (after stripping white space): set a key, or none to serve without one")
    return api_key.strip().encode()


def bearer_token(header: bytes) -> bytes:
    """The token of an ``Authorization: Bearer TOKEN`` header (b"" for another scheme): the scheme is
    case-insensitive and followed by one or more spaces (RFC 7235 section 2.1, RFC 6750 section 2.1)."""
    scheme, _, token = header.strip().partition(b" ")
    return token.lstrip(b" ") if scheme.lower() == b"bearer" else b""


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name is loopback: "localhost", 127.0.0.0/8, ::1, and IPv4-mapped
    ::ffff:127.x.y.z (the ipaddress module's own test, not a list of spellings)."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def allowed_hosts_for(host: str) -> tuple[str, ...] | None:
    """The Host names a server bound to ``host`` answers: on loopback, loopback names and addresses only (DNS
    rebinding); elsewhere any (None)."""
    return (*LOOPBACK_HOSTS, host.lower()) if is_loopback(host) else None


def host_name(header: bytes) -> str:
    """The host of a Host header, without its port ("[::1]:8000" -> "::1")."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = [_describe(e) for e in err.errors()]
        return APIError(400, "; ".join(m for _, m in problems), param=problems[0][0] if problems else None).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = (
            f"Unknown route: {request.method} {request.url.path}"
            if err.status_code == 404
            else f"{request.method} is not allowed on {request.url.path}"
            if err.status_code == 405
            else str(err.detail)
        )
        return APIError(err.status_code, message, code="not_found" if err.status_code == 404 else None).response()

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", "server_error").response()


def _describe(error: dict) -> tuple[str | None, str]:
    """(param, message) of one pydantic error, in the words OpenAI's API uses."""
    loc = [str(part) for part in error.get("loc", ())][1:]  # without the leading "body"
    param = loc[0] if loc else None
    kind, message = error.get("type"), str(error.get("msg", "")).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        return param, f"Unrecognized request argument supplied: {'.'.join(loc)}"
    if kind == "json_invalid":
        return None, f"the request body is not valid JSON: {error.get('ctx', {}).get('error', message)}"
    if kind == "missing" and not loc:
        return None, "a JSON request body is required"
    return param, f"{'.'.join(loc) or 'body'}: {message}"


def serve(
    bundle: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_batch: int = 8,
    max_queue: int = 256,
    threads: int = 0,
    model_name: str | None = None,
    log_level: str = "info",
    policy: str = "exact",
    drain_timeout: float = 30.0,
    drain_linger: float = 2.0,
    request_timeout: float = 600.0,
    max_connections: int = 512,
    max_rows_per_client: int | None = None,
    health_port: int | None = None,
    connection_limits: ConnectionLimits | None = None,
    plan: bool = True,
    prefill_chunk: int | str | None = PREFILL_CHUNK,
    trusted_proxy: tuple[str, ...] = (),
    refusal_pacing: RefusalPacing | None = DEFAULT_PACING,
) -> None:
    """Load ``bundle``, start a scheduler on it (calibrated), and serve until interrupted: Ctrl-C stops at once,
    SIGTERM drains (runtime/serving/drain.py: 503 to new requests, running ones finish within ``drain_timeout`` seconds,
    at least ``drain_linger`` seconds of 503s), then returns. Bounded by default: a request runs at most
    ``request_timeout`` seconds, at most ``max_connections`` requests are in flight (503 past it), a connection
    must send its request's headers within 10 s, at most 4096 connections wait for theirs (the oldest is closed
    past it) and one client (an address, an IPv6 /64) holds at most 64 connections (``connection_limits``,
    runtime/serving/connections.py), idle keep-alive connections close after 5 s, and on loopback only loopback Host
    names are answered. ``trusted_proxy``: addresses or networks whose X-Forwarded-For names the client (none: the
    TCP peer is the client). ``health_port``: /health and /health/live also on that port, served apart, so no
    client can starve the probes. ``refusal_pacing``: a client looping on refused requests gets its refusals late
    (runtime/serving/pacing.py; None: at once)."""
    drain = Drain(timeout=drain_timeout, linger=drain_linger)  # a bad setting fails before the load
    limits = connection_limits or ConnectionLimits()
    trusted = trusted_proxies(trusted_proxy)
    loaded = LoadedBundle.open(bundle, threads=threads)  # what the scheduler runs on; the Python API is no server's
    _prepare_grammars(loaded)
    scheduler = Scheduler(
        loaded,
        max_batch=max_batch,
        max_queue=max_queue,
        policy=policy,
        plan=plan,
        max_rows_per_client=max_rows_per_client,
        prefill_chunk=prefill_chunk,
    ).start()
    name = model_name or Path(bundle).resolve().name
    if not api_key and not is_loopback(host):
        log.warning("serving on %s without an API key: anyone who can reach it can use it (--api-key)", host)
    app = create_app(
        scheduler,
        name,
        api_key=api_key,
        drain=drain,
        allowed_hosts=allowed_hosts_for(host),
        request_timeout=request_timeout,
        refusal_pacing=refusal_pacing,
    )
    raise_file_limit(max_connections + limits.pending + 512)  # both ports' connections, and the process's own files
    app.state.body_parser.start()  # its worker ready before the first request
    warm_up(app, name, api_key)
    settle_garbage_collector()
    config = server_config(
        app, host, port, max_connections, limits, log_level=log_level, trusted=trusted, timeout_graceful_shutdown=5
    )
    server, probes = DrainingServer(config, drain), None
    try:
        if health_port is not None:
            probes = ProbeServer(
                probe_app(drain, lambda live: scheduler_problem(scheduler, live)), host, health_port
            ).start()
        server.run()
    finally:
        if probes is not None:
            probes.stop()
        scheduler.stop()
    if not server.started:
        raise ValueError(f"the server did not start on {host}:{port} (the log above says why)")
