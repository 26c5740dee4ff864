"""Stop ``draftsmith serve`` (Triton) mid-load and account for every request: the drain unloads the models
(triton_repo/server.py), so a new request is refused before any work (404 unknown model, or a closed port) and the
client leaves this replica, as a balancer would; every other request must be answered in full, with the runtime's
own greedy text. Reported per repetition: the counts, the requests in flight at the signal that were answered, the
ensemble's readiness just after it, the exit code and the seconds from SIGTERM to exit.

    python -m bench.drain BUNDLE --server triton --repetitions 5   (the command: bench/drain.py)
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.drain_totals import drain_totals


def triton_drain_once(
    repo: str | os.PathLike,
    reference: dict[str, str],
    *,
    clients: int = 8,
    linger: float = 1.5,
    exit_timeout: int = 30,
    sigterm_after: float = 1.5,
    max_tokens: int = 32,
    log_dir: str | os.PathLike | None = None,
    startup_timeout: float = 180.0,
) -> dict:
    """``draftsmith serve REPO`` under load from ``clients`` greedy clients (prompts: ``reference``'s keys, each
    answer must equal its value), SIGTERM mid-run. The drain unloads the models (triton_repo/server.py), so a new
    request is refused before any work (404 unknown model, or a closed port), and the client then leaves this
    replica, as a balancer would; every other request must be answered in full. Reports the counts, the requests in
    flight at the signal that were answered, the ensemble's readiness just after it, the exit code and the seconds
    from SIGTERM to exit."""
    from triton_repo.server import free_port

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="draftsmith-triton-drain-"))
    ports = [free_port() for _ in range(3)]
    url = f"http://127.0.0.1:{ports[0]}"
    command = [
        sys.executable,
        "-m",
        "runtime.cli",
        "serve",
        str(repo),
        "--http-port",
        str(ports[0]),
        "--grpc-port",
        str(ports[1]),
        "--metrics-port",
        str(ports[2]),
        "--drain-linger",
        str(linger),
        "--exit-timeout",
        str(exit_timeout),
        "--log-file",
        str(log_dir / "tritonserver.log"),
    ]
    with open(log_dir / "serve.log", "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1]
        )
    try:
        _wait_triton(url, process, startup_timeout)
        return _triton_load(url, process, reference, clients, linger, sigterm_after, max_tokens, exit_timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def _wait_triton(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"draftsmith serve exited with {process.returncode}")
        try:
            if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"tritonserver at {url} was not ready after {timeout:.0f} s")


def _triton_load(
    url: str,
    process: subprocess.Popen,
    reference: dict[str, str],
    clients: int,
    linger: float,
    sigterm_after: float,
    max_tokens: int,
    exit_timeout: int,
) -> dict:
    outcomes, lock, stop = [], threading.Lock(), threading.Event()
    prompts = list(reference)

    def client_loop(c: int) -> None:
        with httpx.Client(timeout=120.0) as client:
            for i in itertools.count():
                if stop.is_set():
                    return
                prompt = prompts[(c + i) % len(prompts)]
                start = time.monotonic()
                try:
                    response = client.post(
                        url + "/v2/models/ensemble/generate", json={"text_input": prompt, "max_tokens": max_tokens}
                    )
                    text = response.json().get("text_output") if response.status_code == 200 else None
                    kind = (
                        "answered"
                        if text == reference[prompt]
                        else "truncated"
                        if text is not None
                        else "refused"
                        if response.status_code == 404 and "unknown model" in response.text
                        else f"HTTP {response.status_code}"
                    )  # 404 unknown model: unloaded, before any work
                except httpx.ConnectError:
                    kind = "refused"  # the port is closed: nothing was sent
                except httpx.HTTPError as err:
                    kind = f"lost: {type(err).__name__}"
                with lock:
                    outcomes.append((kind, start, time.monotonic()))
                if kind == "refused":
                    return  # as a balancer does: this replica is out of rotation, the client goes elsewhere

    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(sigterm_after)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    model_ready = _status(url + "/v2/models/ensemble/ready")  # the deployment's readiness probe
    try:
        code = process.wait(exit_timeout + 30)
    except subprocess.TimeoutExpired:
        code = None
    exit_s = time.monotonic() - signalled
    stop.set()
    for thread in threads:
        thread.join()
    counts = {kind: sum(o[0] == kind for o in outcomes) for kind in sorted({o[0] for o in outcomes})}
    return {
        "sent": len(outcomes),
        "outcomes": counts,
        "lost": sum(o[0] not in ("answered", "refused") for o in outcomes),
        "answered_after_sigterm": sum(o[0] == "answered" and o[1] < signalled < o[2] for o in outcomes),
        "model_ready_0_5_s_after_sigterm": model_ready,
        "exit_code": code,
        "sigterm_to_exit_s": round(exit_s, 3),
    }


def run_triton_drain(
    bundle: str | os.PathLike,
    repetitions: int = 5,
    *,
    clients: int = 8,
    linger: float = 1.5,
    max_tokens: int = 32,
    threads: int = 1,
    log_dir: str | os.PathLike | None = None,
) -> dict:
    """``repetitions`` runs of ``triton_drain_once`` on a repository written for ``bundle``, answers checked
    against the runtime's own greedy output."""
    from runtime.api import SpeculativeGenerator
    from triton_repo.generate import RepoOptions, write_repository

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="draftsmith-triton-drain-"))
    repo = write_repository(bundle, log_dir / "repo", RepoOptions(threads=threads, max_batch_size=4), overwrite=True)
    generator = SpeculativeGenerator.from_bundle(bundle, threads=threads)
    prompts = ("The quick brown fox", "def add(a, b):", "Speculative decoding keeps", "for i in range(10):")
    reference = {p: generator.generate(p, max_new_tokens=max_tokens).text for p in prompts}
    runs = []
    for repetition in range(repetitions):
        folder = log_dir / f"run{repetition}"
        folder.mkdir(exist_ok=True)
        runs.append(
            triton_drain_once(repo, reference, clients=clients, linger=linger, max_tokens=max_tokens, log_dir=folder)
        )
    total = drain_totals(runs, ("sent", "lost", "answered_after_sigterm"), "exit_code")
    return {
        "server": "triton",
        "repetitions": repetitions,
        "linger_s": linger,
        "clients": clients,
        "total": total,
        "runs": runs,
        "logs": str(log_dir),
    }


def _status(url: str) -> int | str:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError as err:
        return type(err).__name__
