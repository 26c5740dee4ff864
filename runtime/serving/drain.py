"""Graceful shutdown of the OpenAI server: on SIGTERM, stop taking work without losing any.

What a replica behind a load balancer (a Kubernetes Service) must do when it is told to stop:

1. readiness turns false at once (``GET /health`` answers 503), so the balancer takes it out of rotation;
2. a new generation request gets 503 with ``Retry-After`` and ``Connection: close`` before any work is done, so the
   client (OpenAI's clients retry 503s) sends it again, to another replica;
3. requests already running finish, up to ``timeout`` seconds after the signal;
4. then uvicorn stops and the process exits 0.

The replica keeps answering for at least ``linger`` seconds after the signal, even when idle: until the balancer has
seen readiness turn false it still sends requests here, and a closed port would fail them where a 503 is retried.
``GET /health/live`` (liveness) answers 200 while the scheduler's loop runs, draining or not, so a draining replica
is never restarted for being unready, and one whose scheduler died (or whose engine keeps failing,
runtime/core/health.py) is.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from typing import Callable

import uvicorn

from runtime.serving.openai_responses import error_body

log = logging.getLogger("uvicorn.error")  # shown with the server's own lines (uvicorn configures it)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
READY_PATH, LIVE_PATH = "/health", "/health/live"


class Drain:
    """The shutdown state of one server: when SIGTERM came, and how many generation requests are in flight.

    timeout: seconds after the signal when the server stops even with requests still running (set it under the
    pod's terminationGracePeriodSeconds); linger: the least seconds it keeps answering 503 after the signal;
    retry_after: the Retry-After it sends, in seconds.
    """

    def __init__(
        self,
        timeout: float = 30.0,
        linger: float = 2.0,
        retry_after: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not timeout > 0 or linger < 0 or linger > timeout or retry_after < 1:
            raise ValueError(
                f"drain: expected timeout > 0, 0 <= linger <= timeout and retry_after >= 1, received "
                f"timeout={timeout!r}, linger={linger!r}, retry_after={retry_after!r}"
            )
        self.timeout, self.linger, self.retry_after, self.clock = timeout, linger, retry_after, clock
        self.started_at: float | None = None
        self._inflight = 0
        self._lock = threading.Lock()

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    @property
    def inflight(self) -> int:
        return self._inflight

    def begin(self) -> None:
        """Start draining (from a signal handler: only sets a time); a second call changes nothing."""
        if self.started_at is None:
            self.started_at = self.clock()

    def finished(self) -> bool:
        """True once the server should stop: lingered and idle, or out of time."""
        if self.started_at is None:
            return False
        elapsed = self.clock() - self.started_at
        return elapsed >= self.timeout or (elapsed >= self.linger and self._inflight == 0)

    def enter(self) -> bool:
        """Count a generation request in, unless draining (then False: refuse it)."""
        with self._lock:
            if self.started_at is not None:
                return False
            self._inflight += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._inflight -= 1


class DrainGuard:
    """Pure ASGI, outermost: readiness and liveness, the 503 refusals while draining, and the in-flight count (a
    streamed response counts until its last byte is sent). ``problem(live)``: why the server cannot serve (None:
    it can; runtime/core/health.py), ``live`` for the liveness probe's longer view."""

    def __init__(self, app, drain: Drain, problem: Callable[[bool], str | None]):
        self.app, self.drain, self.problem = app, drain, problem

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in (LIVE_PATH, READY_PATH):
            return await self.probe(path, send)
        if path not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if not self.drain.enter():
            body = error_body(
                "the server is shutting down; retry on another replica", "server_error", code="server_shutting_down"
            )
            return await _json(send, 503, body, self._retry() + [(b"connection", b"close")])
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()

    async def probe(self, path: str, send) -> None:
        """/health/live: only a dead scheduler or a long fault streak makes a restart worth it, draining or not;
        /health: 503 while draining, or while the scheduler cannot serve."""
        if path == LIVE_PATH:
            problem = self.problem(True)
            if problem:
                return await _json(send, 503, {"status": "unavailable", "reason": problem})
            return await _json(send, 200, {"status": "alive"})
        if self.drain.draining:
            return await _json(send, 503, {"status": "draining"}, self._retry())
        problem = self.problem(False)
        if problem:
            return await _json(send, 503, {"status": "unavailable", "reason": problem}, self._retry())
        return await _json(send, 200, {"status": "ok"})

    def _retry(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.drain.retry_after).encode())]


def probe_app(drain: Drain, problem: Callable[[bool], str | None]):
    """An ASGI app that answers only the probes, as DrainGuard does (runtime/serving/connections.py serves it on a
    port of its own); anything else is a 404."""
    guard = DrainGuard(None, drain, problem)

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] in (READY_PATH, LIVE_PATH):
            return await guard.probe(scope["path"], send)
        await _json(
            send,
            404,
            error_body(
                f"this port serves only {READY_PATH} and {LIVE_PATH}", "invalid_request_error", code="not_found"
            ),
        )

    return app


async def _json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": data})


class DrainingServer(uvicorn.Server):
    """uvicorn whose SIGTERM drains (``Drain``) instead of stopping at once; SIGINT (Ctrl-C) is uvicorn's as ever.

    uvicorn re-raises the signals it caught once it has stopped (so the process dies of them); a SIGTERM handled here
    is not recorded as caught, so the process exits 0 after a drain.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain, self._drain_logged = drain, False

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.should_exit:
            self.drain.begin()  # nothing else in a signal handler; on_tick logs it
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and not self._drain_logged:
            self._drain_logged = True
            log.info("SIGTERM: draining (%d requests in flight; up to %.0f s)", self.drain.inflight, self.drain.timeout)
        if self.drain.finished():
            if not self.should_exit:
                elapsed = self.drain.clock() - self.drain.started_at
                log.info(
                    "drained (%d requests still in flight) after %.1f s, %s: stopping",
                    self.drain.inflight,
                    elapsed,
                    "out of time" if elapsed >= self.drain.timeout else "idle",
                )
            self.should_exit = True
        return await super().on_tick(counter)
