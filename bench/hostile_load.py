"""What a soak holds open beside its well-behaved clients: idle connections that never send a byte, slow-header
clients that trickle their headers, and a probe that times the server's health endpoint the whole time
(``draftsmith openai-load --idle-connections N --slow-header-clients M --health-url URL``; issue 38's soak); and a
client that sends one hostile body in a loop: a ``response_format`` (``--hostile-format JSON``; issue 48's soak: a
regex whose masks would stall every stream) or a huge ``metadata`` (``--hostile-body-bytes N``; issue 54's soak).

Idle and slow connections come from loopback source addresses 127.0.0.2 and up, ``PER_SOURCE`` to an address, as
many hosts would open them; each is reopened as soon as the server closes it, so the server holds them all the time.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time

import httpx

PER_SOURCE = 50  # connections from one source address (under the server's per-client cap)
TRICKLE_S = 2.0  # a slow-header client sends one byte this often


class HostileConnections:
    """``idle`` connections that send nothing and ``slow`` ones that trickle a request's headers, to host:port,
    each reopened when the server closes it, until ``stop``. Counts the connections made and closed by the server."""

    def __init__(self, host: str, port: int, idle: int, slow: int):
        self.host, self.port, self.idle, self.slow = host, port, idle, slow
        self.opened = self.closed_by_server = self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> "HostileConnections":
        if self.idle or self.slow:
            self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        return {
            "idle": self.idle,
            "slow_header": self.slow,
            "opened": self.opened,
            "closed_by_server": self.closed_by_server,
            "refused": self.refused,
        }

    async def _main(self) -> None:
        kinds = [False] * self.idle + [True] * self.slow
        await asyncio.gather(*(self._hold(i, slow) for i, slow in enumerate(kinds)))

    async def _hold(self, index: int, slow: bool) -> None:
        source = f"127.0.0.{2 + index // PER_SOURCE}"
        while not self._stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port, local_addr=(source, 0))
            except OSError:
                self.refused += 1
                await asyncio.sleep(0.5)
                continue
            self.opened += 1
            await self._occupy(reader, writer, slow)

    async def _occupy(self, reader, writer, slow: bool) -> None:
        """Hold one connection until the server closes it (or the soak ends); a slow one trickles its headers."""
        request = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4096
        sent = 0
        while not self._stop.is_set():
            try:
                if slow and sent < len(request):
                    writer.write(request[sent : sent + 1])
                    sent += 1
                    await writer.drain()
                if await asyncio.wait_for(reader.read(1024), timeout=TRICKLE_S) == b"":
                    self.closed_by_server += 1
                    break
            except asyncio.TimeoutError:
                continue
            except OSError:
                self.closed_by_server += 1
                break
        writer.close()


class HostileBodies:
    """One more client that posts ``body`` (JSON bytes) to ``path`` back to back, until ``stop``; counts the
    answers by status code and times them. Its requests are not the soak's: a refusal (400) is what a fixed server
    answers, so they are reported apart from the clients' outcomes, under ``label`` (what the body holds).

    It runs in a process of its own (spawned), as an attacker would be: a refused request comes back in a few
    milliseconds, and a loop of them in the load tool's process would hold its interpreter lock and delay the
    measured clients' reading of their own streams (their gaps would grow on the client side)."""

    def __init__(self, base: str, path: str, body: bytes, label: str, headers: dict, timeout: float):
        import multiprocessing

        self.timeout, self.label, self.size = timeout, label, len(body)
        context = multiprocessing.get_context("spawn")
        self._stop, self._answered, self._results = context.Event(), context.Event(), context.Queue()
        arguments = (base + path, body, headers, timeout, self._stop, self._answered, self._results)
        self._process = context.Process(target=hostile_body_loop, args=arguments, daemon=True)

    def start(self) -> "HostileBodies":
        """Start the loop, and return once its first request was answered: the soak's clients then start beside a
        client already at it."""
        self._process.start()
        self._answered.wait(self.timeout)
        return self

    def stop(self) -> dict:
        self._stop.set()
        try:
            result = self._results.get(timeout=self.timeout)
        except queue.Empty:
            result = {"sent": 0, "by_status": {}, "max_latency_s": 0.0, "first_error": "the client process hung"}
        self._process.join(timeout=10)
        return {"sends": self.label, "body_bytes": self.size, **result}


def format_body(model: str, fmt: dict) -> tuple[bytes, str]:
    """A short completion whose response_format is ``fmt`` (issue 48's soak: a regex whose masks would stall every
    stream), and its label."""
    body = {"model": model, "prompt": "x", "max_tokens": 16, "response_format": fmt}
    return json.dumps(body).encode(), f"response_format {json.dumps(fmt)[:200]}"


def metadata_body(model: str, size: int) -> tuple[bytes, str]:
    """A short chat completion of about ``size`` bytes, nearly all of it a ``metadata`` array of zeros (issue 54's
    soak: a body that costs the server in proportion to its values, ~2M of them in 4 MB), and its label."""
    head = json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 16})
    zeros = max(1, (size - len(head) - 20) // 2)
    body = head[:-1] + ', "metadata": {"a": [' + ",".join("0" * zeros) + "]}}"
    return body.encode(), f"metadata of {zeros} values"


def hostile_body_loop(url, body, headers, timeout, stop, answered, results) -> None:
    """HostileBodies' process: the requests, until ``stop``; then its counts on ``results``."""
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    first_error = ""
    with httpx.Client(headers={**headers, "content-type": "application/json"}, timeout=timeout) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                response = client.post(url, content=body)
                status = str(response.status_code)
                if response.status_code != 200 and not first_error:
                    first_error = response.text[:300]
            except httpx.HTTPError as err:
                status = type(err).__name__
            latencies.append(time.perf_counter() - start)
            statuses[status] = statuses.get(status, 0) + 1
            answered.set()
    results.put(
        {
            "sent": len(latencies),
            "by_status": dict(sorted(statuses.items())),
            "max_latency_s": max(latencies, default=0.0),
            "first_error": first_error,
        }
    )


class HealthProbe:
    """GET ``url`` every ``every`` seconds until ``stop``: each answer's latency, and the probes that failed (not
    200, or no answer within ``limit`` seconds)."""

    def __init__(self, url: str, every: float = 0.5, limit: float = 1.0):
        self.url, self.every, self.limit = url, every, limit
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "HealthProbe":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            start = time.perf_counter()
            try:
                with httpx.Client(timeout=self.limit) as client:  # a new connection each time, as a kubelet's
                    status = client.get(self.url).status_code
                took = time.perf_counter() - start
                self.latencies.append(took)
                if status != 200 or took > self.limit:
                    self.failures.append(f"{status} in {took:.2f} s")
            except httpx.HTTPError as err:
                self.failures.append(type(err).__name__)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=5)
        worst = max(self.latencies, default=0.0)
        return {
            "url": self.url,
            "probes": len(self.latencies) + len(self.failures),
            "failed": len(self.failures),
            "max_latency_s": worst,
            "failures": self.failures[:5],
        }
