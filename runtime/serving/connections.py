"""What an open TCP connection may cost the OpenAI server, and probes no client can starve.

uvicorn bounds the connections (``limit_concurrency``: past it every request, the probes included, gets 503) but
starts no timer until a request has been answered, and h11 has none: 512 connections that send nothing (or trickle
a header byte a second) fill the server and Kubernetes restarts the pod for failing its probes. Here, on top of
uvicorn's own protocol class (``http=`` in its Config, public):

- a header deadline: a connection's request line and headers must arrive within ``header_timeout`` seconds of
  its opening, or of the previous response (for keep-alive), however slowly the bytes come; otherwise it is closed
  (nginx's ``client_header_timeout``). The body has its own deadline (openai_server's BODY_SECONDS);
- a cap per client address (the TCP peer, never a header): past ``per_client`` open connections a new one is
  answered 503 with Retry-After and closed at once (HAProxy's ``conn_cur`` limit), so one client cannot take the
  server's ``max_connections`` alone;
- ``ProbeServer``: /health and /health/live on a port of their own, with their own small bounds, in a thread with
  its own event loop, so neither a full main port nor a busy main loop delays the kubelet's probes.
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

HEADER_TIMEOUT_S = 10.0  # a request's line and headers, from the connection's opening (or the last response)
PER_CLIENT = 64  # open connections one client address may hold (of --max-connections, 512 by default)
PROBE_CONNECTIONS = 16  # the probe port's own bounds: the kubelet sends one probe at a time per kind
PROBE_PER_CLIENT = 8


@dataclass(frozen=True)
class ConnectionLimits:
    """header_timeout: seconds a connection may take to send a request's headers; per_client: open connections
    one peer address may hold (None: no cap)."""

    header_timeout: float = HEADER_TIMEOUT_S
    per_client: int | None = PER_CLIENT

    def __post_init__(self):
        if not self.header_timeout > 0 or (self.per_client is not None and self.per_client < 1):
            raise ValueError(
                f"expected header_timeout > 0 and per_client >= 1 (or None), received "
                f"{self.header_timeout!r}, {self.per_client!r}"
            )


def _refusal() -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": "too many open connections from this address; close some, or retry later",
                "type": "rate_limit_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "retry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


REFUSAL = _refusal()


def guarded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (h11's, or httptools' when installed) with a header deadline and a cap per
    client address; one class (one count of connections per address) per server."""
    held: collections.Counter[str] = collections.Counter()

    class Guarded(AutoHTTPProtocol):
        deadline: asyncio.TimerHandle | None = None
        counted: str | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = self.client[0] if self.client else ""
            if limits.per_client is not None and held[peer] >= limits.per_client:
                transport.write(REFUSAL)
                transport.close()
                return
            held[peer] += 1
            self.counted = peer
            self.arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers are in: its body and answer have their own bounds
                self.disarm()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if self.cycle is cycle and not self.transport.is_closing():  # kept alive: the next request's headers
                self.arm()

        def connection_lost(self, exc) -> None:
            self.disarm()
            if self.counted is not None:
                held[self.counted] -= 1
                if not held[self.counted]:
                    del held[self.counted]
                self.counted = None
            super().connection_lost(exc)

        def arm(self) -> None:
            self.disarm()
            self.deadline = self.loop.call_later(limits.header_timeout, self.expire)

        def disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def expire(self) -> None:
            """No whole request line and headers in time: close (nothing was asked, so nothing is answered)."""
            self.deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return Guarded


def server_config(
    app, host: str, port: int, max_connections: int, limits: ConnectionLimits, log_level: str = "info", **options
) -> uvicorn.Config:
    """uvicorn's Config for one of the server's ports: at most ``max_connections`` open, the guarded protocol,
    idle keep-alive connections closed after 5 s."""
    options.setdefault("timeout_keep_alive", 5)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        limit_concurrency=max_connections,
        http=guarded_protocol(limits),
        **options,
    )


class ProbeServer:
    """/health and /health/live (``app``) on a port of their own, served by a uvicorn of their own in a daemon
    thread (its own event loop, so a main loop busy with a burst of responses does not delay a probe)."""

    def __init__(self, app, host: str, port: int, log_level: str = "warning", sock: socket.socket | None = None):
        """``sock``: a socket already bound (a test's free port), else ``host``:``port`` is bound at start."""
        config = server_config(
            app,
            host,
            port,
            PROBE_CONNECTIONS,
            ConnectionLimits(2.0, PROBE_PER_CLIENT),
            log_level=log_level,
            lifespan="off",
            access_log=False,
            timeout_keep_alive=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock] if sock else None}, name="draftsmith-probes", daemon=True
        )

    def start(self, timeout: float = 10.0) -> "ProbeServer":
        """Start it and wait until it listens; ValueError when it cannot (the port is taken)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ValueError(f"the probe port {self.server.config.port} did not start (the log above says why)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
