"""Hardening IV, the connection side (items 3, 4, 8 and 9): who a client is, and what its connections may hold.

Real sockets against a real uvicorn (``server_config``, the server's own), as tests/test_server_connections.py does.
Before these fixes: uvicorn believed ``X-Forwarded-For`` from loopback (any local client could claim a new address
per request, escaping ``--max-rows-per-client``); an upgrade that swapped the connection's protocol never gave its
per-address count back (64 of them locked an address out); two addresses holding the probe port's 16 connections
made /health/live 503; IPv6 clients were counted per address, not per /64; and 600 idle connections from 12
addresses made a good request on the main port a 503 at the default limits. ``HOSTILE`` counts the distinct
hostile inputs sent here."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from runtime.serving import connections  # noqa: E402  (client_key, trusted_proxies: read where used)
from runtime.serving.connections import REFUSAL, ConnectionLimits, ProbeServer, server_config  # noqa: E402
from runtime.serving.drain import Drain, probe_app  # noqa: E402
from runtime.serving.health import scheduler_problem  # noqa: E402
from runtime.serving.openai_server import create_app  # noqa: E402
from runtime.serving.scheduler import Scheduler  # noqa: E402

MODEL = "tiny"
HOSTILE: dict[str, set] = {}


def hostile(kind: str, value) -> None:
    HOSTILE.setdefault(kind, set()).add(json.dumps(value, sort_keys=True, default=repr))


def bound() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


class Served:
    """uvicorn in a daemon thread on a free port, configured by the server's own ``server_config``."""

    def __init__(self, app, max_connections: int = 512, limits: ConnectionLimits | None = None, **options):
        sock = bound()
        self.port = sock.getsockname()[1]
        options.setdefault("log_level", "warning")
        self.config = server_config(
            app, "127.0.0.1", self.port, max_connections, limits or ConnectionLimits(), lifespan="off", **options
        )
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (ConnectionResetError, socket.timeout):
        pass
    return b"".join(chunks)


def request(port: int, raw: bytes, source: str = "127.0.0.1") -> tuple[int, bytes]:
    """(status, whole answer) of one raw request on a fresh connection; (0, b"") when closed unanswered."""
    with connect(port, source) as sock:
        sock.sendall(raw)
        data = read_all(sock)
    return (int(data.split()[1]), data) if data else (0, b"")


def get(port: int, path: str, source: str = "127.0.0.1", headers: str = "") -> int:
    raw = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Connection: close\r\n\r\n".encode()
    return request(port, raw, source)[0]


def completion(port: int, headers: str = "", source: str = "127.0.0.1") -> int:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}).encode()
    raw = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{headers}"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    return request(port, raw, source)[0]


@pytest.fixture(scope="module")
def scheduler(tiny_bundle):
    from runtime.api import SpeculativeGenerator

    scheduler = Scheduler(SpeculativeGenerator.from_bundle(tiny_bundle, threads=1), max_batch=2).start()
    yield scheduler
    scheduler.stop()


@pytest.fixture
def clients(scheduler, monkeypatch):
    """The client address every submitted request is given (what --max-rows-per-client and the fewest-rows order
    count by), recorded on the scheduler's public ``enqueue``."""
    seen: list[str] = []
    real = scheduler.enqueue

    def recording(*args, **kwargs):
        seen.append(kwargs.get("client"))
        return real(*args, **kwargs)

    monkeypatch.setattr(scheduler, "enqueue", recording)
    return seen


# --- item 3: X-Forwarded-For is believed only from named proxies ----------------------------------------------------

FORGED = [
    "X-Forwarded-For: 203.0.113.7\r\n",
    "X-Forwarded-For: 203.0.113.8, 198.51.100.2\r\n",
    "X-Forwarded-For: 127.0.0.2\r\n",
    "X-Forwarded-For: ::1\r\n",
    "X-Forwarded-For: [2001:db8::1]:443\r\n",
    "X-Forwarded-For: 192.0.2.1:80\r\n",
    "X-Forwarded-For: unknown\r\n",
    "X-Forwarded-For: " + ", ".join(f"10.0.{i}.1" for i in range(40)) + "\r\n",
    "X-Forwarded-For: 203.0.113.9\r\nX-Forwarded-For: 203.0.113.10\r\n",
    "X-Forwarded-For: 203.0.113.11\r\nX-Forwarded-Proto: https\r\n",
    "Forwarded: for=203.0.113.12\r\n",
    "X-Real-IP: 203.0.113.13\r\n",
]


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_forged_forwarded_for_from_loopback_changes_no_client_address(scheduler, clients):
    """From 127.0.0.1 each request once claimed the header's address: a new client for every request (past
    --max-rows-per-client, first in the fewest-rows order) and a forged address in the access log."""
    server = Served(create_app(scheduler, MODEL), log_level="info")
    access = Lines()
    logging.getLogger("uvicorn.access").addHandler(access)
    try:
        for forged in FORGED:
            hostile("forwarded header", forged)
            assert completion(server.port, forged) == 200
    finally:
        logging.getLogger("uvicorn.access").removeHandler(access)
        server.close()
    assert clients == ["127.0.0.1"] * len(FORGED)
    logged = [line for line in access.lines if "/v1/completions" in line]
    assert len(logged) == len(FORGED) and all(line.startswith("127.0.0.1:") for line in logged), logged
    assert server.config.proxy_headers is False


def test_a_named_proxys_forwarded_for_is_believed(scheduler, clients):
    server = Served(create_app(scheduler, MODEL), trusted=connections.trusted_proxies(["127.0.0.0/8"]))
    try:
        assert completion(server.port, "X-Forwarded-For: 203.0.113.7\r\n") == 200
        assert completion(server.port, "X-Forwarded-For: 2001:db8:5:6::9\r\n") == 200
        assert completion(server.port) == 200
    finally:
        server.close()
    assert clients == ["203.0.113.7", "2001:db8:5:6::/64", "127.0.0.1"]


BAD_PROXIES = ["*", "proxy.example.com", "", "10.0.0.0/33", "1.2.3", "127.0.0.1,10.0.0.1", "::1::", "0x7f.1"]


@pytest.mark.parametrize("value", BAD_PROXIES)
def test_a_trusted_proxy_must_be_an_address_or_a_network(tiny_bundle, value):
    from click.testing import CliRunner

    from runtime.cli import main

    hostile("trusted proxy", value)
    with pytest.raises(ValueError, match="--trusted-proxy"):
        connections.trusted_proxies([value])
    result = CliRunner().invoke(main, ["serve-openai", str(tiny_bundle), "--trusted-proxy", value, "--port", "1"])
    assert result.exit_code != 0 and "--trusted-proxy" in result.output


def test_trusted_proxies_are_normalised():
    assert connections.trusted_proxies(["127.0.0.1", " 10.0.0.0/8", "::1", "10.1.2.3/8"]) == (
        "127.0.0.1/32",
        "10.0.0.0/8",
        "::1/128",
        "10.0.0.0/8",
    )


# --- item 8: IPv6 clients by /64 ---------------------------------------------------------------------------------

ROTATING = ["2001:db8:1:2::1", "2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2:dead:beef::7", "2001:DB8:1:2::abcd"]


def test_an_ipv6_client_is_its_64():
    for address in ROTATING:
        hostile("ipv6 rotation", address)
        assert connections.client_key(address) == "2001:db8:1:2::/64"
    assert connections.client_key("2001:db8:1:3::1") == "2001:db8:1:3::/64"
    assert connections.client_key("::ffff:192.0.2.1") == "192.0.2.1"  # IPv4-mapped: the IPv4 client
    assert connections.client_key("fe80::1%eth0") == "fe80::/64"
    assert (
        connections.client_key("192.0.2.1") == "192.0.2.1"
        and connections.client_key("unix:/run/x.sock") == "unix:/run/x.sock"
    )


def test_requests_from_one_64_share_their_rows(scheduler, clients):
    """The scheduler's client of each request: one for the whole /64 (before: one per address, so a host rotating
    through its /64 escaped --max-rows-per-client)."""
    app = create_app(scheduler, MODEL)

    async def run(address: str) -> int:
        transport = httpx.ASGITransport(app=app, client=(address, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            return (await client.post("/v1/completions", json=body)).status_code

    assert [asyncio.run(run(a)) for a in ROTATING] == [200] * len(ROTATING)
    assert clients == ["2001:db8:1:2::/64"] * len(ROTATING)


# --- item 4: upgrades -----------------------------------------------------------------------------------------------

UPGRADES = [
    "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    "Sec-WebSocket-Version: 13\r\n",
    "Upgrade: WebSocket\r\nConnection: keep-alive, Upgrade\r\nSec-WebSocket-Version: 13\r\n",
    "Upgrade: websocket\r\nConnection: upgrade\r\n",
    "Upgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n",
    "Upgrade: websocket, h2c\r\nConnection: Upgrade\r\n",
]


class SwapProtocol(asyncio.Protocol):
    """A protocol an upgrade swaps in (uvicorn's ``ws=`` takes a class): it accepts the upgrade, then closes when
    the client does. The connection's first protocol never hears of its end."""

    def __init__(self, **state):
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if data.startswith(b"GET "):
            self.transport.write(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
            )

    def eof_received(self) -> None:
        self.transport.close()


def upgrade_and_close(port: int, headers: str) -> bytes:
    with connect(port) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode())
        sock.settimeout(5)
        return sock.recv(65536)


def test_websocket_upgrades_are_plain_requests_and_leave_no_count_behind(scheduler):
    """uvicorn runs with ws="none": an upgrade request is answered as the plain request it is, and 70 of them from
    one address (past its cap of 64) leave it served."""
    server = Served(create_app(scheduler, MODEL))
    try:
        for i in range(70):
            headers = UPGRADES[i % len(UPGRADES)]
            hostile("upgrade", headers)
            assert upgrade_and_close(server.port, headers).startswith(b"HTTP/1.1 200")
        time.sleep(0.2)
        assert get(server.port, "/health") == 200
        assert server.config.ws == "none"
    finally:
        server.close()


def test_a_protocol_swap_cannot_leak_the_per_client_count(scheduler):
    """Where an upgrade does swap the protocol (websockets or wsproto installed, with ws="auto"), the first protocol
    never sees its connection end; the count is of open transports, so 3 x the cap of swapped-and-closed
    connections leave the address served (before: refused for good after the cap)."""
    server = Served(create_app(scheduler, MODEL), limits=ConnectionLimits(30.0, 4), ws=SwapProtocol)
    try:
        for _ in range(12):
            assert upgrade_and_close(server.port, UPGRADES[0]).startswith(b"HTTP/1.1 101")
        time.sleep(0.2)
        assert get(server.port, "/health") == 200
        held = [connect(server.port) for _ in range(4)]  # the cap still holds for open connections
        try:
            with connect(server.port) as extra:
                extra.settimeout(5)
                assert read_all(extra) == REFUSAL
        finally:
            for sock in held:
                sock.close()
    finally:
        server.close()


# --- item 8: the probe port -----------------------------------------------------------------------------------------


def probes(scheduler) -> tuple[ProbeServer, int]:
    sock = bound()
    port = sock.getsockname()[1]
    drain = Drain(timeout=5, linger=0)
    server = ProbeServer(
        probe_app(drain, lambda live: scheduler_problem(scheduler, live)), "127.0.0.1", port, sock=sock
    )
    return server.start(), port


def test_probes_get_through_while_other_addresses_hold_the_probe_ports_connections(scheduler):
    """Two addresses at their cap of 8 idle connections each held the probe port's 16 and every probe got 503;
    past the pending budget the connection waiting longest is closed, so a probe always gets in."""
    server, port = probes(scheduler)
    held = []
    try:
        held += [connect(port, "127.0.0.2") for _ in range(8)] + [connect(port, "127.0.0.3") for _ in range(8)]
        time.sleep(0.1)
        assert get(port, "/health/live") == 200 and get(port, "/health") == 200
        sources = [f"127.0.1.{i}" for i in range(connections.PROBE_PENDING // 8 + 2)]
        held += [connect(port, source) for source in sources for _ in range(8)]  # past the pending budget
        time.sleep(0.2)
        assert get(port, "/health/live") == 200 and get(port, "/health") == 200
        first = held[0]
        first.settimeout(2)
        assert read_all(first) == b""  # the oldest was closed to make room
    finally:
        for sock in held:
            sock.close()
        server.stop()


# --- item 9: connections without a request have their own budget ----------------------------------------------------


def test_600_idle_connections_from_12_addresses_leave_the_main_port_serving(scheduler):
    """The issue's load at the default limits (512 requests in flight, 64 connections an address, a 10 s header
    deadline): 50 idle connections from each of 127.0.0.2-13, then good requests from 127.0.0.1 are served
    (before: 503, uvicorn counted the idle connections against --max-connections)."""
    server = Served(create_app(scheduler, MODEL))
    idle = []
    try:
        for a in range(12):
            idle += [connect(server.port, f"127.0.0.{2 + a}") for _ in range(50)]
        hostile("idle connections", "600 from 12 addresses")
        time.sleep(0.3)
        assert [completion(server.port) for _ in range(3)] == [200] * 3
        assert get(server.port, "/health") == 200
    finally:
        for sock in idle:
            sock.close()
        server.close()


def test_past_the_pending_budget_the_connection_waiting_longest_is_closed(scheduler):
    server = Served(create_app(scheduler, MODEL), limits=ConnectionLimits(30.0, None, 4))
    try:
        idle = [connect(server.port) for _ in range(4)]
        time.sleep(0.1)
        newer = connect(server.port)
        idle[0].settimeout(2)
        assert read_all(idle[0]) == b""  # closed, unanswered
        newer.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        newer.settimeout(5)
        assert read_all(newer).startswith(b"HTTP/1.1 200")
        for sock in idle[1:]:
            sock.settimeout(0.2)
            with pytest.raises(socket.timeout):  # still open: only the oldest made room
                sock.recv(1)
    finally:
        for sock in idle + [newer]:
            sock.close()
        server.close()


def test_requests_in_flight_past_max_connections_get_503_with_retry_after(scheduler):
    """Requests whose headers are in and whose body has not come are in flight (the body has its own deadline):
    past max_connections of them the next request is refused at once, and served once they leave."""
    server = Served(create_app(scheduler, MODEL), max_connections=2)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    waiting = []
    try:
        for _ in range(2):
            sock = connect(server.port)
            sock.sendall(head)
            waiting.append(sock)
        time.sleep(0.3)
        status, answer = request(server.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert status == 503 and b"retry-after: 1" in answer.lower() and b"server_busy" in answer
    finally:
        for sock in waiting:
            sock.close()
    time.sleep(0.3)
    try:
        assert get(server.port, "/health") == 200
    finally:
        server.close()


@pytest.mark.parametrize("soft, hard, want", [(1024, 1 << 20, 5120), (1024, 2048, 2048), (65536, 1 << 20, 65536)])
def test_the_open_file_limit_is_raised_to_what_the_bounds_need(monkeypatch, soft, hard, want):
    """4096 pending connections and 512 in flight need more files than a common soft limit of 1024: past it
    asyncio stops accepting (every client waits). Raised as far as the hard limit allows, with a warning short of
    it."""
    import resource

    limits = [(soft, hard)]
    monkeypatch.setattr(resource, "getrlimit", lambda kind: limits[-1])
    monkeypatch.setattr(resource, "setrlimit", lambda kind, value: limits.append(value))
    warnings = Lines()
    logging.getLogger("uvicorn.error").addHandler(warnings)  # uvicorn's logging config may stop propagation
    try:
        assert connections.raise_file_limit(5120) == want
    finally:
        logging.getLogger("uvicorn.error").removeHandler(warnings)
    assert limits[-1][0] == want
    assert any("open-file limit" in line for line in warnings.lines) == (want < 5120)


def test_connection_limits_are_checked():
    for bad in ((1.0, 1, 0), (1.0, 1, -5), (1.0, None, 1.5)):
        with pytest.raises(ValueError):
            ConnectionLimits(*bad)


def test_hostile_input_count():
    """Run last in this file: the distinct hostile inputs above, by class."""
    if len(HOSTILE) < 5:
        pytest.skip("counts only when the whole file runs")
    total = sum(len(v) for v in HOSTILE.values())
    print({k: len(v) for k, v in HOSTILE.items()}, total)
    assert total >= 30
