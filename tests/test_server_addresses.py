"""Who a client is and what its connections may hold: the Host names and addresses a loopback server answers, the
API key, the body a request must come with (runtime/serving/openai_server.py's door, called in-process); then, over
real sockets against a real uvicorn (``server_config``, the server's own, as tests/test_server_connections.py does),
X-Forwarded-For believed only from named proxies, IPv6 clients counted by /64, upgrades, the probe port, and
connections without a request (runtime/serving/connections.py).

Before the connection bounds: uvicorn believed ``X-Forwarded-For`` from loopback (any local client could claim a new
address per request, escaping ``--max-rows-per-client``); an upgrade that swapped the connection's protocol never
gave its per-address count back (64 of them locked an address out); two addresses holding the probe port's 16
connections made /health/live 503; IPv6 clients were counted per address, not per /64; and 600 idle connections
from 12 addresses made a good request on the main port a 503 at the default limits. ``hostile`` tallies the
distinct hostile inputs sent here, by class."""

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

from hostile_tally import HostileTally  # noqa: E402
from openai_asgi import call  # noqa: E402
from runtime.core.request import MAX_BODY_BYTES, Limits  # noqa: E402
from runtime.serving import connections  # noqa: E402  (client_key, trusted_proxies: read where used)
from runtime.serving import openai_server  # noqa: E402
from runtime.serving.connections import REFUSAL, ConnectionLimits, ProbeServer, server_config  # noqa: E402
from runtime.serving.drain import Drain, probe_app  # noqa: E402
from runtime.core.health import scheduler_problem  # noqa: E402
from runtime.serving.openai_server import create_app, host_name  # noqa: E402
from runtime.core.scheduler import Scheduler  # noqa: E402

MODEL = "tiny"
hostile = HostileTally()


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


# --- loopback: every loopback address, and only loopback Host names -------------------------------------------------


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


@pytest.mark.parametrize(
    "host",
    ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "attacker.localhost.evil", "0.0.0.0", "[::2]:8000", ""],
)
def test_a_loopback_server_refuses_other_host_names(app, host):
    response = call(app, "GET", "/v1/models", headers={"host": host})
    assert response.status_code == 421 and response.json()["error"]["code"] == "misdirected_request"


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]:8000", "::1"])
def test_a_loopback_server_answers_loopback_names(app, host):
    assert call(app, "GET", "/v1/models", headers={"host": host}).status_code == 200


@pytest.mark.parametrize("host", ["127.0.0.2:8000", "[::ffff:127.0.0.1]:8000", "127.0.0.3"])
def test_a_loopback_server_answers_every_loopback_address(app, host):
    assert call(app, "GET", "/v1/models", headers={"host": host}).status_code == 200


def test_a_server_bound_to_another_loopback_address_checks_host_names(monkeypatch):
    assert openai_server.allowed_hosts_for("127.0.0.2") is not None
    assert openai_server.allowed_hosts_for("::ffff:127.0.0.1") is not None
    assert openai_server.allowed_hosts_for("0.0.0.0") is None


@pytest.mark.parametrize(
    "header,name",
    [
        (b"127.0.0.1:80", "127.0.0.1"),
        (b"[::1]:8000", "::1"),
        (b"::1", "::1"),
        (b"LocalHost", "localhost"),
        (b"[::1", "[::1"),
    ],
)
def test_host_name(header, name):
    assert host_name(header) == name


# --- the API key ----------------------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_api_key_is_refused_not_taken_as_none(tiny_bundle, key, monkeypatch):
    from click.testing import CliRunner

    from runtime.cli import main

    monkeypatch.setenv("DRAFTSMITH_API_KEY", key)
    monkeypatch.setattr(openai_server, "serve", lambda *a, **k: pytest.fail("the server started"))
    result = CliRunner().invoke(main, ["serve-openai", str(tiny_bundle), "--port", "1"])
    assert result.exit_code != 0 and "API key is empty" in result.output


# --- a request's body: JSON, sent in time, under the cap ------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonp"],
)
def test_a_post_that_a_browser_could_send_cross_site_is_refused(app, content_type):
    headers = {"content-type": content_type} if content_type else {}
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    response = call(app, "POST", "/v1/completions", content=body, headers=headers)
    assert response.status_code == 415


def test_json_with_a_charset_is_json(app):
    response = call(
        app,
        "POST",
        "/v1/completions",
        content=b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}',
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert response.status_code == 200


def test_a_body_that_never_finishes_arriving_is_a_408(app, monkeypatch):
    monkeypatch.setattr(openai_server, "BODY_SECONDS", 0.2)
    sent = []

    async def run():
        async def receive():
            if not sent:
                sent.append(1)
                return {"type": "http.request", "body": b'{"model": ', "more_body": True}
            await asyncio.sleep(3600)

        messages = []

        async def send(message):
            messages.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), (b"content-length", b"100")],
            "query_string": b"",
            "http_version": "1.1",
            "scheme": "http",
            "server": ("127.0.0.1", 8000),
            "client": ("127.0.0.1", 1),
            "root_path": "",
        }
        await asyncio.wait_for(app(scope, receive, send), 5)
        return messages

    messages = asyncio.run(run())
    assert messages[0]["status"] == 408


def test_the_body_limit_has_an_absolute_cap():
    assert Limits.for_context(1 << 22).max_body_bytes == MAX_BODY_BYTES
    assert Limits.for_context(2048).max_body_bytes < MAX_BODY_BYTES


# --- X-Forwarded-For is believed only from named proxies ------------------------------------------------------------

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


# --- IPv6 clients by /64 --------------------------------------------------------------------------------------------

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


# --- upgrades -------------------------------------------------------------------------------------------------------

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


# --- the probe port -------------------------------------------------------------------------------------------------


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


# --- connections without a request have their own budget ------------------------------------------------------------


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
    hostile.check(classes=8, at_least=75)
