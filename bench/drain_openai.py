"""Stop a replica mid-load and account for every request: the check behind a Kubernetes rolling update.

Two ``draftsmith serve-openai`` processes serve one bundle; clients (bench/openai_load.py's ``run_one`` and
``mixed_spec``) send streamed requests spread over both through ``Balancer``, which does what a Service's endpoints
do: round-robin over the replicas in rotation, a replica leaving it when its readiness probe (``GET /health``) says
it is not ready (or does not answer three times in a row) or when it refused a request. Mid-run one replica gets
SIGTERM (runtime/serving/drain.py). Every request must then end one of two ways:

- answered: the stream ended with a finish_reason and ``[DONE]``, and a greedy or seeded answer is the same text
  the surviving replica gives the same request alone (else it counts as truncated);
- refused: HTTP 503 with Retry-After before any work, then sent again to the other replica and answered there.

Anything else is lost (an error, a dropped connection, a stream cut short). Reported per repetition: those counts,
how many requests the stopped replica held (running or waiting, from its /metrics) when the signal came, its exit code
and the seconds from SIGTERM to its exit.

    python -m bench.drain BUNDLE --repetitions 5   (the command: bench/drain.py)
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from bench.drain_totals import drain_totals
from bench.openai_client import Outcome, Spec, mixed_spec, run_one

MODEL = "drained"


@dataclass
class Replica:
    """One ``draftsmith serve-openai`` process."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_replica(
    bundle: str | os.PathLike,
    log_dir: Path,
    *,
    threads: int = 1,
    max_batch: int = 2,
    drain_timeout: float = 30.0,
    drain_linger: float = 1.0,
) -> Replica:
    """Start a server process on a free port (not waited for: see ``wait_ready``)."""
    port = _free_port()
    log_path = Path(log_dir) / f"replica-{port}.log"
    command = [
        sys.executable,
        "-m",
        "runtime.cli",
        "serve-openai",
        str(bundle),
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--max-batch",
        str(max_batch),
        "--model-name",
        MODEL,
        "--drain-timeout",
        str(drain_timeout),
        "--drain-linger",
        str(drain_linger),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).resolve().parents[1]
        )
    return Replica(f"http://127.0.0.1:{port}", process, log_path)


def wait_ready(replicas: list[Replica], timeout: float = 120.0) -> None:
    """Until every replica's /health answers 200; raises RuntimeError (with the log's tail) if one exits or is late."""
    deadline = time.monotonic() + timeout
    pending = list(replicas)
    while pending:
        for replica in list(pending):
            if replica.process.poll() is not None:
                raise RuntimeError(f"{replica.url} exited with {replica.process.returncode}:\n{replica.log()[-3000:]}")
            try:
                if httpx.get(replica.url + "/health", timeout=2).status_code == 200:
                    pending.remove(replica)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{pending[0].url} was not ready after {timeout:.0f} s:\n{pending[0].log()[-3000:]}")
        time.sleep(0.2)


def stop(replica: Replica, timeout: float = 30.0) -> None:
    if replica.process.poll() is None:
        replica.process.send_signal(signal.SIGINT)
        try:
            replica.process.wait(timeout)
        except subprocess.TimeoutExpired:
            replica.process.kill()
            replica.process.wait(10)


class Balancer:
    """A Service's view of the replicas: round-robin over those in rotation. A readiness probe (``GET /health``
    every ``period`` seconds) that answers anything but 200 takes a replica out at once, ``failures`` probes in a row
    without an answer in ``timeout`` seconds (a busy replica) do too, and a 200 brings it back; a replica that
    refused a request with 503 is out for good (it is stopping)."""

    def __init__(self, urls: list[str], period: float = 0.2, timeout: float = 2.0, failures: int = 3):
        self.urls, self.up, self.period, self.timeout, self.failures = list(urls), list(urls), period, timeout, failures
        self.removed_at: dict[str, float] = {}
        self._failed = dict.fromkeys(urls, 0)
        self._refused: set[str] = set()
        self._lock, self._turn, self._stop = threading.Lock(), itertools.count(), threading.Event()
        self._thread = threading.Thread(target=self._probe, daemon=True)
        self._thread.start()

    def pick(self) -> str | None:
        with self._lock:
            return self.up[next(self._turn) % len(self.up)] if self.up else None

    def refused(self, url: str) -> None:
        with self._lock:
            self._refused.add(url)
            self._take_out(url)

    def _take_out(self, url: str) -> None:
        if url in self.up:
            self.up.remove(url)
            self.removed_at.setdefault(url, time.monotonic())

    def _probe(self) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            while not self._stop.wait(self.period):
                for url in self.urls:
                    try:
                        status = client.get(url + "/health").status_code
                    except httpx.HTTPError:
                        status = None  # no answer in time: a busy replica, or a gone one
                    with self._lock:
                        self._failed[url] = 0 if status == 200 else self._failed[url] + 1
                        if status == 200 and url not in self.up and url not in self._refused:
                            self.up.append(url)
                        elif status is not None and status != 200 or self._failed[url] >= self.failures:
                            self._take_out(url)  # it said it is not ready (Kubernetes drops a stopping pod at once)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Served:
    """One request's fate: where each attempt went, and how the last one ended."""

    spec: Spec
    outcome: Outcome | None = None
    replica: str = ""  # the replica of the last attempt
    refused_by: list[str] = field(default_factory=list)  # replicas that answered 503 first
    start: float = 0.0
    end: float = 0.0


def _refused(outcome: Outcome) -> bool:
    return outcome.status == "failed" and outcome.error.startswith("HTTP 503")


def _pick(balancer: Balancer, patience: float = 5.0) -> str | None:
    """A replica in rotation, waiting up to ``patience`` seconds for one (a client's retry with backoff)."""
    deadline = time.monotonic() + patience
    while (url := balancer.pick()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return url


def _serve_one(client: httpx.Client, balancer: Balancer, spec: Spec, inflight: dict, lock: threading.Lock) -> Served:
    """Send ``spec`` where the balancer says; a 503 takes that replica out and the request goes to the next."""
    served = Served(spec, start=time.monotonic())
    for _ in range(3):
        url = _pick(balancer)
        if url is None:
            served.outcome = Outcome(spec, error="no replica in rotation for 5 s")
            break
        with lock:
            inflight[url] = inflight.get(url, 0) + 1
        try:
            outcome = run_one(client, url, spec, MODEL, chat=False)
        finally:
            with lock:
                inflight[url] -= 1
        served.outcome, served.replica = outcome, url
        if not _refused(outcome):
            break
        served.refused_by.append(url)
        balancer.refused(url)
    served.end = time.monotonic()
    return served


def drain_once(
    victim: Replica,
    survivor: Replica,
    *,
    clients: int = 6,
    duration: float = 6.0,
    sigterm_after: float = 2.0,
    max_tokens: int = 96,
    seed: int = 0,
    exit_timeout: float = 60.0,
) -> dict:
    """One run: load both replicas, SIGTERM ``victim`` after ``sigterm_after`` seconds, at a moment its batch is full
    and a request waits for a row; keep the load on until ``duration``; then check the answers (module docstring)."""
    balancer = Balancer([victim.url, survivor.url])
    results: list[Served] = []
    lock, counter, inflight = threading.Lock(), itertools.count(), {}  # inflight: the driver's view, per replica
    start = time.monotonic()

    def client_loop() -> None:
        with httpx.Client(timeout=120.0) as client:
            while time.monotonic() - start < duration:
                spec = mixed_spec(next(counter), seed, max_tokens, cancel_fraction=0.0)
                served = _serve_one(client, balancer, spec, inflight, lock)
                with lock:
                    results.append(served)

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    while time.monotonic() - start < sigterm_after:
        time.sleep(0.01)
    running = _wait_for_queue(victim.url, start + duration)
    signalled = time.monotonic()
    victim.process.send_signal(signal.SIGTERM)
    probe = _probe_refusal(victim.url)
    try:
        code = victim.process.wait(exit_timeout)
    except subprocess.TimeoutExpired:
        code = None
    exit_s = time.monotonic() - signalled
    for thread in threads:
        thread.join()
    balancer.close()
    report = _account(results, victim, survivor, signalled, running, probe, code, exit_s)
    # the balancer's reaction: a request the victim refuses after its linger, on a connection it is closing, is lost
    report["victim_out_of_rotation_s"] = round(balancer.removed_at.get(victim.url, float("nan")) - signalled, 3)
    return report


def _wait_for_queue(url: str, deadline: float) -> int:
    """Until the victim's scheduler has a request waiting for a row (so its batch is full, and that request cannot
    finish before the signal lands); returns its running + waiting count then."""
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            gauges = {}
            for line in client.get(url + "/metrics").text.splitlines():
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                    gauges[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
            if gauges.get("vllm:num_requests_waiting", 0) >= 1:
                return int(sum(gauges.values()))
            time.sleep(0.005)
    raise RuntimeError("the victim never had a request waiting; raise --clients or --duration")


def _probe_refusal(url: str) -> dict:
    """A request sent right after the signal: it must be refused with 503 and Retry-After."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 4}
    try:
        response = httpx.post(url + "/v1/completions", json=body, timeout=10)
        return {"status": response.status_code, "retry_after": response.headers.get("retry-after")}
    except httpx.HTTPError as err:
        return {"status": None, "error": f"{type(err).__name__}: {err}"}


def _account(
    results: list[Served],
    victim: Replica,
    survivor: Replica,
    signalled: float,
    running: int,
    probe: dict,
    code: int | None,
    exit_s: float,
) -> dict:
    answered = [r for r in results if r.outcome.status == "answered"]
    lost = [r for r in results if r.outcome.status != "answered"]
    truncated = _mismatches([r for r in answered if r.replica == victim.url or r.refused_by], survivor.url)
    on_victim = [r for r in answered if r.replica == victim.url]
    return {
        "sent": len(results),
        "answered": len(answered),
        "lost": len(lost),
        "truncated": len(truncated),
        "refused_503": sum(len(r.refused_by) for r in results),
        "refused_then_answered": sum(bool(r.refused_by) for r in answered),
        "answered_by_victim_after_sigterm": sum(r.end > signalled for r in on_victim),
        "victim_inflight_at_sigterm": running,
        "probe_after_sigterm": probe,
        "victim_exit_code": code,
        "victim_stop_line": _stop_line(victim.log()),
        "sigterm_to_exit_s": round(exit_s, 3),
        "errors": [
            f"{'victim' if r.replica == victim.url else 'survivor'}, {r.start - signalled:+.2f} s to "
            f"{r.end - signalled:+.2f} s from SIGTERM: {r.outcome.error}"
            for r in lost
        ][:5],
        "truncated_examples": truncated[:2],
    }


def _stop_line(log: str) -> str | None:
    """The server's own account of why it stopped (runtime/serving/drain.py): "drained (N requests still in
    flight) after S s, idle|out of time: stopping"; None if it never said."""
    lines = [line for line in log.splitlines() if "drained (" in line]
    return lines[-1].strip() if lines else None


def _mismatches(answered: list[Served], reference_url: str) -> list[dict]:
    """Deterministic answers (greedy or seeded) that differ from the same request run alone on ``reference_url``."""
    alone: dict[Spec, str] = {}
    problems = []
    with httpx.Client(timeout=120.0) as client:
        for r in answered:
            if not r.spec.deterministic:
                continue
            spec = replace(r.spec, cancel_after=0)
            if spec not in alone:
                reference = run_one(client, reference_url, spec, MODEL, chat=False)
                alone[spec] = reference.text if reference.status == "answered" else None
            if alone[spec] is not None and alone[spec] != r.outcome.text:
                problems.append({"prompt": spec.prompt, "got": r.outcome.text, "alone": alone[spec]})
    return problems


def run_drain(
    bundle: str | os.PathLike,
    repetitions: int = 5,
    *,
    clients: int = 6,
    duration: float = 6.0,
    sigterm_after: float = 2.0,
    max_tokens: int = 96,
    threads: int = 1,
    max_batch: int = 2,
    drain_linger: float = 1.0,
    drain_timeout: float = 30.0,
    log_dir: str | os.PathLike | None = None,
) -> dict:
    """``repetitions`` runs of ``drain_once``, a fresh victim each time beside one survivor; per run and in total."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="draftsmith-drain-"))
    options = dict(threads=threads, max_batch=max_batch, drain_linger=drain_linger, drain_timeout=drain_timeout)
    survivor = start_replica(bundle, log_dir, **options)
    runs = []
    try:
        for repetition in range(repetitions):
            victim = start_replica(bundle, log_dir, **options)
            try:
                wait_ready([survivor, victim])
                runs.append(
                    drain_once(
                        victim,
                        survivor,
                        clients=clients,
                        duration=duration,
                        sigterm_after=sigterm_after,
                        max_tokens=max_tokens,
                        seed=repetition,
                    )
                )
            finally:
                stop(victim)
    finally:
        stop(survivor)
    counted = (
        "sent",
        "answered",
        "lost",
        "truncated",
        "refused_503",
        "refused_then_answered",
        "victim_inflight_at_sigterm",
    )
    total = drain_totals(runs, counted, "victim_exit_code")
    return {
        "repetitions": repetitions,
        "drain_linger_s": drain_linger,
        "drain_timeout_s": drain_timeout,
        "clients": clients,
        "max_tokens": max_tokens,
        "max_batch": max_batch,
        "total": total,
        "runs": runs,
        "logs": str(log_dir),
    }
