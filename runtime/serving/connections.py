"""What an open TCP connection may cost the OpenAI server, whose address it counts as, and probes no client can
starve.

uvicorn bounds the connections (``limit_concurrency``: past it every request, the probes included, gets 503),
counting idle ones with those whose request runs, and starts no timer until a request has been answered (h11 has
none): 512 connections that send nothing (or trickle a header byte a second) filled the server, and 600 idle ones
from 12 addresses made a good request a 503 at the default limits. Here, on top of uvicorn's own protocol class
(``http=`` in its Config, public):

- two budgets: connections that have not sent a complete request (new ones, and kept-alive ones between requests)
  cost an asyncio server a socket and a few kilobytes, and have their own budget (``pending``); past it the one
  that has waited longest is closed, so a newcomer, a health probe included, always gets in. Requests in flight
  (headers in, answer not finished) are what costs: past ``max_connections`` of them a new one gets 503 with
  Retry-After (``InFlight``, what uvicorn's limit did, counting requests only);
- a header deadline: a connection's request line and headers must arrive within ``header_timeout`` seconds of
  its opening, or of the previous response (for keep-alive), however slowly the bytes come; otherwise it is closed
  (nginx's ``client_header_timeout``). The body has its own deadline (openai_server's BODY_SECONDS);
- a cap per client (``client_key``: the TCP peer, never a header; an IPv6 peer by its /64, which one host is given
  whole): past ``per_client`` open connections a new one is answered 503 with Retry-After and closed at once
  (HAProxy's ``conn_cur`` limit), so one client cannot take the server alone. Counted by transport, not by
  protocol callback, so a protocol swap (an upgrade) cannot leak a count; uvicorn runs with ``ws="none"`` anyway
  (this API serves no WebSocket);
- no proxy headers unless asked: uvicorn trusts ``X-Forwarded-For`` from loopback by default, which let any local
  client (a sidecar, ``kubectl port-forward``) claim a new address per request; ``trusted_proxies`` names the
  proxies whose header is believed;
- ``ProbeServer``: /health and /health/live on a port of their own, with their own small bounds, in a thread with
  its own event loop, so neither a full main port nor a busy main loop delays the kubelet's probes.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger("uvicorn.error")

HEADER_TIMEOUT_S = 10.0  # a request's line and headers, from the connection's opening (or the last response)
PER_CLIENT = 64  # open connections one client (an address; an IPv6 /64) may hold
PENDING = 4096  # connections without a complete request (new, or kept alive between requests); then the oldest goes
PROBE_IN_FLIGHT = 16  # the probe port's own bounds: the kubelet sends one probe at a time per kind
PROBE_PER_CLIENT = 8
PROBE_PENDING = 256


@dataclass(frozen=True)
class ConnectionLimits:
    """header_timeout: seconds a connection may take to send a request's headers; per_client: open connections
    one client (``client_key``) may hold (None: no cap); pending: connections that have not sent a complete
    request the server holds at once, past which the one waiting longest is closed."""

    header_timeout: float = HEADER_TIMEOUT_S
    per_client: int | None = PER_CLIENT
    pending: int = PENDING

    def __post_init__(self):
        if (
            not self.header_timeout > 0
            or (self.per_client is not None and self.per_client < 1)
            or not isinstance(self.pending, int)
            or self.pending < 1
        ):
            raise ValueError(
                f"expected header_timeout > 0, per_client >= 1 (or None) and pending >= 1, received "
                f"{self.header_timeout!r}, {self.per_client!r}, {self.pending!r}"
            )


def _error(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "rate_limit_error", "param": None, "code": code}}).encode()


def _refusal(body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "retry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


REFUSAL = _refusal(
    _error("too many open connections from this address; close some, or retry later", "too_many_connections")
)
BUSY = _error("too many requests in flight; retry later", "server_busy")


def client_key(host: str) -> str:
    """Whom per-client limits count a peer address as: an IPv4 address as it is, an IPv6 one by its /64 network (a
    host is given a whole /64 and can take a new address in it for every connection), an IPv4-mapped one
    (::ffff:a.b.c.d) as its IPv4 address; anything else (a Unix socket's name) as it is."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(address) >> 64 << 64, 64)))  # its scope (%eth0) dropped too
    return str(address)


def trusted_proxies(values) -> tuple[str, ...]:
    """``--trusted-proxy`` values checked: each an IP address or network (CIDR), whose ``X-Forwarded-For`` the
    server believes; ValueError naming the first that is neither ("*", a host name: trusting everyone, or a name
    that can change, would let any client claim any address)."""
    out = []
    for value in values:
        try:
            out.append(str(ipaddress.ip_network(str(value).strip(), strict=False)))
        except ValueError:
            raise ValueError(
                f"--trusted-proxy: expected an IP address or network (CIDR) of a proxy in front of this server, "
                f"received {value!r}"
            ) from None
    return tuple(out)


class InFlight:
    """ASGI: requests in flight past ``limit`` get 503 with Retry-After at once, before any work (uvicorn's
    ``limit_concurrency`` counted idle connections too; a connection still sending its headers is the pending
    budget's, ``guarded_protocol``)."""

    def __init__(self, app, limit: int):
        if limit < 1:
            raise ValueError(f"max_connections: expected requests in flight >= 1, received {limit!r}")
        self.app, self.limit, self.running = app, limit, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.running >= self.limit:
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(BUSY)).encode()),
                (b"retry-after", b"1"),
            ]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            return await send({"type": "http.response.body", "body": BUSY})
        self.running += 1  # the event loop is one thread: the count needs no lock
        try:
            await self.app(scope, receive, send)
        finally:
            self.running -= 1


def guarded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (h11's, or httptools' when installed) with a header deadline, the pending
    budget and a cap per client; one class (one count per client, one pending list) per server."""
    held: dict[str, set] = collections.defaultdict(set)  # client -> its open transports
    pending: collections.OrderedDict = collections.OrderedDict()  # connections awaiting headers, oldest first

    class Guarded(AutoHTTPProtocol):
        deadline: asyncio.TimerHandle | None = None
        counted: str | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = client_key(self.client[0]) if self.client else ""
            # counted by transport: one whose protocol was swapped (an upgrade) never calls connection_lost here,
            # so closed ones are dropped when their client next connects
            open_ = held[peer]
            open_.difference_update([t for t in open_ if t.is_closing()])
            if limits.per_client is not None and len(open_) >= limits.per_client:
                transport.write(REFUSAL)
                transport.close()
                return
            open_.add(transport)
            self.counted = peer
            self.arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle or self.transport.get_protocol() is not self:
                self.disarm()  # a request's headers are in (its body and answer have their own bounds), or swapped

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if self.cycle is cycle and not self.transport.is_closing():  # kept alive: the next request's headers
                self.arm()

        def connection_lost(self, exc) -> None:
            self.disarm()
            if self.counted is not None:
                held[self.counted].discard(self.transport)
                if not held[self.counted]:
                    del held[self.counted]
                self.counted = None
            super().connection_lost(exc)

        def arm(self) -> None:
            """Wait for a request's headers: the deadline runs, and the connection joins the pending budget (the
            one waiting longest leaves when it is full)."""
            self.disarm()
            self.deadline = self.loop.call_later(limits.header_timeout, self.expire)
            pending[self] = None
            while len(pending) > limits.pending:
                next(iter(pending)).expire()

        def disarm(self) -> None:
            pending.pop(self, None)
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def expire(self) -> None:
            """No whole request line and headers in time, or room made for a newer connection: close (nothing was
            asked, so nothing is answered)."""
            self.disarm()
            if not self.transport.is_closing():
                self.transport.close()

    return Guarded


def server_config(
    app,
    host: str,
    port: int,
    max_connections: int,
    limits: ConnectionLimits,
    log_level: str = "info",
    trusted: tuple[str, ...] = (),
    **options,
) -> uvicorn.Config:
    """uvicorn's Config for one of the server's ports: at most ``max_connections`` requests in flight
    (``InFlight``), the guarded protocol, idle keep-alive connections closed after 5 s, no WebSocket, and
    ``X-Forwarded-For`` believed only from the ``trusted`` proxies (``trusted_proxies``; none: never)."""
    options.setdefault("timeout_keep_alive", 5)
    options.setdefault("ws", "none")
    return uvicorn.Config(
        InFlight(app, max_connections),
        host=host,
        port=port,
        log_level=log_level,
        limit_concurrency=None,
        http=guarded_protocol(limits),
        proxy_headers=bool(trusted),
        forwarded_allow_ips=list(trusted) or None,
        **options,
    )


def raise_file_limit(needed: int) -> int:
    """The process's open-file limit (each connection is a file) raised to ``needed`` where its hard limit allows;
    the soft limit it has then. A server whose limit is short fails to accept (asyncio then pauses accepting)."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return needed
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return needed
    if soft >= needed:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft < needed:
        log.warning(
            "the open-file limit is %d, under the %d the connection bounds may need: raise it (ulimit -n) or lower "
            "--max-pending-connections",
            soft,
            needed,
        )
    return soft


class ProbeServer:
    """/health and /health/live (``app``) on a port of their own, served by a uvicorn of their own in a daemon
    thread (its own event loop, so a main loop busy with a burst of responses does not delay a probe)."""

    def __init__(self, app, host: str, port: int, log_level: str = "warning", sock: socket.socket | None = None):
        """``sock``: a socket already bound (a test's free port), else ``host``:``port`` is bound at start."""
        config = server_config(
            app,
            host,
            port,
            PROBE_IN_FLIGHT,
            ConnectionLimits(2.0, PROBE_PER_CLIENT, PROBE_PENDING),
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
