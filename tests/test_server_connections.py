"""Connections that send nothing, or trickle their headers, cannot take the OpenAI server down: real sockets against
a real uvicorn (small limits, so each test runs in seconds). Before the header deadline, N idle connections filled
``limit_concurrency`` with no timer running and /health answered 503 until they left; now they also have a budget
of their own and never count against the requests in flight (tests/test_server_addresses.py)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from runtime.serving.connections import REFUSAL, ConnectionLimits, ProbeServer, server_config  # noqa: E402
from runtime.serving.drain import Drain, probe_app  # noqa: E402
from runtime.core.health import scheduler_problem  # noqa: E402
from runtime.serving.openai_server import create_app  # noqa: E402
from runtime.core.scheduler import Scheduler  # noqa: E402

MODEL = "tiny"
SLOW: set[str] = set()  # distinct hostile connection patterns sent (the table)


def bound() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


class Served:
    """uvicorn in a daemon thread on a free port, with the server's own connection guard."""

    def __init__(self, app, max_connections: int, limits: ConnectionLimits):
        sock = bound()
        self.port = sock.getsockname()[1]
        config = server_config(
            app, "127.0.0.1", self.port, max_connections, limits, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
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
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    return sock


def get(port: int, path: str, source: str = "127.0.0.1") -> tuple[int, bytes]:
    """(status, body) of one GET on a fresh connection; (0, b"") when the server closed it unanswered."""
    with connect(port, source) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        data = read_all(sock)
    if not data:
        return 0, b""
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (ConnectionResetError, socket.timeout):
        pass
    return b"".join(chunks)


def closed_by_server(sock: socket.socket, guard: float = 10.0) -> bool:
    """Whether the server closed ``sock`` (EOF or reset) before ``guard`` seconds: a hang guard, far past any
    deadline a test sets, so False means the server never closed it."""
    sock.settimeout(guard)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    return True


@pytest.fixture(scope="module")
def scheduler(tiny_bundle):
    from runtime.api import SpeculativeGenerator

    scheduler = Scheduler(SpeculativeGenerator.from_bundle(tiny_bundle, threads=1), max_batch=2).start()
    yield scheduler
    scheduler.stop()


@pytest.fixture
def served(scheduler, request):
    max_connections, timeout, per_client = request.param
    server = Served(create_app(scheduler, MODEL), max_connections, ConnectionLimits(timeout, per_client))
    yield server
    server.close()


@pytest.mark.parametrize("served", [(6, 0.5, None)], indirect=True)
def test_idle_connections_are_closed_at_the_deadline_and_never_block_a_request(served):
    idle = [connect(served.port) for _ in range(6)]
    SLOW.add("idle x6")
    time.sleep(0.1)
    assert get(served.port, "/health")[0] == 200  # idle ones are not requests in flight (before: 503)
    assert all(closed_by_server(sock) for sock in idle)  # uvicorn alone keeps a silent connection for ever
    assert get(served.port, "/health") == (200, b'{"status":"ok"}')


def trickle(sock: socket.socket, pieces: list[bytes], every: float, stop: threading.Event, sent: list) -> None:
    """Send ``pieces`` one every ``every`` seconds until the server closes the socket; ``sent`` gets each piece."""
    for piece in pieces:
        if stop.is_set():
            return
        try:
            sock.sendall(piece)
        except OSError:
            return
        sent.append(piece)
        time.sleep(every)


SLOW_CLIENTS = {
    "nothing": (b"", 0.0),
    "one byte": (b"G", 0.0),
    "request line only": (b"GET /health HTTP/1.1\r\n", 0.0),
    "headers without the blank line": (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n", 0.0),
    "a byte every 0.1 s": (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 200, 0.1),
    "a header line every 0.1 s": (b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 40, 0.0),
    "a long path a byte every 0.1 s": (b"GET /" + b"a" * 300, 0.1),
    "a POST's headers trickled": (
        b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10\r\nX-Pad: " + b"z" * 200,
        0.1,
    ),
}


@pytest.mark.parametrize("served", [(32, 0.5, None)], indirect=True)
@pytest.mark.parametrize("name", list(SLOW_CLIENTS))
def test_slow_header_clients_are_cut_at_the_deadline_however_they_trickle(served, name):
    data, every = SLOW_CLIENTS[name]
    SLOW.add(name)
    if name == "a header line every 0.1 s":
        pieces, every = data.splitlines(keepends=True), 0.1
    else:
        pieces = [bytes([byte]) for byte in data] if every else [data]
    sock, stop, sent = connect(served.port), threading.Event(), []
    sender = threading.Thread(target=trickle, args=(sock, pieces, every, stop, sent), daemon=True)
    sender.start()
    try:
        closed = closed_by_server(sock)
    finally:
        stop.set()
        sock.close()
    assert closed  # the header deadline cut it: nothing else would (it never sends a whole request)
    if every:  # and trickling did not keep it open: the cut came before the client had sent everything
        assert len(sent) < len(pieces), (len(sent), len(pieces))


@pytest.mark.parametrize("served", [(32, 0.5, None)], indirect=True)
def test_a_kept_alive_connection_must_send_its_next_headers_in_time_too(served):
    SLOW.add("keep-alive then trickle")
    with connect(served.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next request starts (uvicorn's keep-alive timer stops)
        assert closed_by_server(sock)


@pytest.mark.parametrize("served", [(32, 0.5, None)], indirect=True)
def test_a_slow_answer_is_not_cut_by_the_header_deadline(served):
    """The deadline covers the headers only: a request that takes longer to answer than header_timeout is answered."""
    with connect(served.port) as sock:
        body = json.dumps(
            {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 60, "temperature": 0}
        ).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        time.sleep(0.8)  # the body late: past the header deadline, within the body's own
        sock.sendall(body)
        sock.settimeout(30)
        assert read_all(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("served", [(50, 30.0, 3)], indirect=True)
def test_one_client_address_holds_at_most_its_cap(served):
    idle = [connect(served.port) for _ in range(3)]
    SLOW.add("over the per-client cap")
    try:
        with connect(served.port) as extra:
            extra.settimeout(5)
            assert read_all(extra) == REFUSAL  # 503, Retry-After, closed at once
        assert get(served.port, "/health", source="127.0.0.2")[0] == 200  # another address is served
        idle.pop().close()
        time.sleep(0.1)
        assert get(served.port, "/health")[0] == 200  # a freed slot is reused
    finally:
        for sock in idle:
            sock.close()


def test_the_probe_port_answers_while_the_main_port_is_full(scheduler):
    main = Served(create_app(scheduler, MODEL), 4, ConnectionLimits(30.0, None))
    drain = Drain(timeout=5, linger=0)
    sock = bound()
    port = sock.getsockname()[1]
    probes = ProbeServer(
        probe_app(drain, lambda live: scheduler_problem(scheduler, live)), "127.0.0.1", port, sock=sock
    ).start()
    idle = [connect(main.port) for _ in range(4)]
    for held in idle:  # requests in flight: headers in, the body never comes (its own 30 s deadline)
        held.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50\r\n\r\n"
        )
    SLOW.add("requests in flight on the main port while probing")
    try:
        time.sleep(0.1)
        assert get(main.port, "/health")[0] == 503
        assert get(port, "/health") == (200, b'{"status": "ok"}')
        assert get(port, "/health/live")[0] == 200
        assert get(port, "/v1/models")[0] == 404
        held = [connect(port) for _ in range(8)]  # the probe port's own cap per address
        try:
            assert get(port, "/health")[0] == 503
            assert get(port, "/health", source="127.0.0.3")[0] == 200
        finally:
            for s in held:
                s.close()
        drain.begin()
        assert get(port, "/health")[0] == 503 and get(port, "/health/live")[0] == 200
    finally:
        for s in idle:
            s.close()
        probes.stop()
        main.close()


def test_connection_limits_are_checked():
    for bad in ((0, 1), (-1, None), (1.0, 0)):
        with pytest.raises(ValueError):
            ConnectionLimits(*bad)
    assert len(SLOW) >= 1
