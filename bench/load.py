"""Load a real tritonserver serving a Draftsmith repository, and account for every request.

    draftsmith load REPO_OR_BUNDLE --clients 8 --duration 30 --max-requests 1000 [--stream-fraction 0.5] [--json OUT]
    draftsmith load --url http://127.0.0.1:8000 --grpc-url 127.0.0.1:8001 --clients 4 --duration 10

Given a bundle, a repository is written to a temporary folder; given a repository (or a bundle), a tritonserver is
started on loopback and stopped at the end. With ``--url`` an already running server is driven instead.

Each of N client threads sends requests one after another until the duration is over or ``--max-requests`` have been
sent in all. A request is streamed over a gRPC bidirectional stream (``stream=true``; text arrives piece by piece) with
probability ``--stream-fraction``, else sent to HTTP ``/v2/models/ensemble/generate`` (the two clients:
``bench/triton_clients.py``; the server's memory from /proc: ``bench/procmem.py``). Prompts of mixed lengths and
mixed parameters (greedy and sampled, top-k/top-p, draft length, max_tokens, stop words) are drawn from a seeded RNG.

Every request sent ends in exactly one of:

* answered: a final response, well formed (``text_output`` a string; acceptance in [0, 1]; accepted <= drafted);
* failed: the server (or the connection) answered with an error;
* lost: neither, within ``--request-timeout`` seconds (or an answer that is not well formed).

``lost`` must be 0; the command exits 1 otherwise. Also reported: latency p50/p95/p99 of answered requests, the time
to first text of streamed ones, tokens/s (from the server's ``draftsmith_emitted_tokens_total``) and the resident
memory of the server (tritonserver and its Python backend stubs, summed from /proc) at the start and after every
``--rss-every`` finished requests.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from bench.procmem import find_server_pid, rss_bytes
from bench.triton_clients import GrpcStreamClient, Record, http_request

PROMPTS = {  # short, medium, long: mixed prompt lengths
    "short": ["Hi", "def add(a, b):", "The quick brown fox", "SELECT name FROM users", "日本語の"],
    "medium": [
        "Speculative decoding keeps the target's output exactly, and the draft proposes",
        "for i in range(10): print(i * i)\ndef square(x):\n    return",
        "Ünïcödé café — naïve façade, emoji 🙂 and a sentence that goes on for a while",
    ],
    "long": [
        "The quick brown fox jumps over the lazy dog. " * 2 + "def add(a, b):\n    return a + b\n",
        "Speculative decoding keeps the target's output exactly. " * 2 + "for i in range(10): print(i * i)\n",
    ],
}


# --- requests: a seeded mix of lengths and parameters -----------------------------------------------------


def draw_request(rng: random.Random, max_tokens: int, stream: bool) -> tuple[str, dict]:
    """(prompt class, request fields): mixed lengths and parameters, all valid."""
    prompt_class = rng.choice(["short", "short", "medium", "long"])
    body: dict = {
        "text_input": rng.choice(PROMPTS[prompt_class]),
        "max_tokens": rng.choice([max(1, max_tokens // 4), max(1, max_tokens // 2), max_tokens]),
    }
    if rng.random() < 0.3:
        body.update(temperature=0.8, seed=rng.randrange(1 << 31))
        if rng.random() < 0.5:
            body["top_k"] = 20
        if rng.random() < 0.5:
            body["top_p"] = 0.9
    if rng.random() < 0.2:
        body["num_draft_tokens"] = rng.choice([0, 1, 2])
    if stream and rng.random() < 0.2:
        body["stop_words"] = ["\n\n"]
    return prompt_class, body


# --- the load ---------------------------------------------------------------------------------------------------


@dataclass
class Endpoints:
    url: str
    grpc_url: str
    metrics_url: str | None = None
    server_pid: int | None = None


def scrape(metrics_url: str | None) -> dict[str, float]:
    if not metrics_url:
        return {}
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    found: dict[str, float] = {}
    for name, value in re.findall(r"^(draftsmith_\w+)(?:\{[^}]*\})? (\S+)$", text, re.M):
        found[name] = found.get(name, 0.0) + float(value)
    return found


_REQUEST_ID = re.compile(r"\[request id: [^]]*\] ")  # errors differ by it alone: count them together


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


@dataclass
class LoadResult:
    clients: int
    duration_s: float
    sent: int
    answered: int
    failed: int
    lost: int
    wall_s: float
    latency_s: dict
    ttft_s: dict
    tokens: int | None
    tokens_per_s: float | None
    requests_per_s: float
    rss: list = field(default_factory=list)  # [{"requests": n, "rss_mb": x}]
    errors: dict = field(default_factory=dict)  # first message -> count
    records: list = field(default_factory=list)
    origin: float = 0.0  # the time.perf_counter() reading the records' started/ended are seconds after

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("records")
        out.pop("origin")
        return out


def run_load(
    endpoints: Endpoints,
    clients: int = 4,
    duration: float = 10.0,
    max_requests: int = 1000,
    stream_fraction: float = 0.5,
    max_tokens: int = 32,
    request_timeout: float = 60.0,
    seed: int = 0,
    rss_every: int = 100,
    stop: threading.Event | None = None,
) -> LoadResult:
    """Drive ``endpoints`` with ``clients`` threads for ``duration`` s or ``max_requests`` requests, whichever first."""
    if clients < 1 or duration <= 0 or max_requests < 1 or not 0.0 <= stream_fraction <= 1.0:
        raise ValueError("clients >= 1, duration > 0, max_requests >= 1 and 0 <= stream_fraction <= 1")
    stop = stop or threading.Event()
    lock = threading.Lock()
    records: list[Record] = []
    rss: list[dict] = []
    finished = [0]
    before = scrape(endpoints.metrics_url)
    if endpoints.server_pid:
        rss.append({"requests": 0, "rss_mb": round(rss_bytes(endpoints.server_pid) / 2**20, 1)})
    t0 = time.perf_counter()
    end = t0 + duration

    def client(c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        grpc = GrpcStreamClient(endpoints.grpc_url)
        try:
            while not stop.is_set() and time.perf_counter() < end:
                stream = rng.random() < stream_fraction
                prompt_class, body = draw_request(rng, max_tokens, stream)
                with lock:
                    if len(records) >= max_requests:
                        return
                    record = Record(
                        c, "grpc-stream" if stream else "http", prompt_class, time.perf_counter() - t0, body=body
                    )
                    records.append(record)
                if stream:
                    grpc.request(body, request_timeout, record, t0)
                else:
                    http_request(endpoints.url, body, request_timeout, record, t0)
                if record.outcome == "failed":
                    time.sleep(0.05)  # a server that is down refuses at once: do not spin
                with lock:
                    finished[0] += 1
                    sample = endpoints.server_pid and finished[0] % rss_every == 0
                    done = finished[0]
                if sample:
                    entry = {"requests": done, "rss_mb": round(rss_bytes(endpoints.server_pid) / 2**20, 1)}
                    with lock:
                        rss.append(entry)
        finally:
            grpc.close()

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(duration + request_timeout + 30)
    wall = time.perf_counter() - t0
    if endpoints.server_pid:
        rss.append({"requests": finished[0], "rss_mb": round(rss_bytes(endpoints.server_pid) / 2**20, 1)})
    after = scrape(endpoints.metrics_url)
    with lock:
        done = list(records)
    answered = [r for r in done if r.outcome == "answered"]
    latencies = [r.latency for r in answered]
    ttfts = [r.ttft for r in answered if r.ttft is not None]
    errors: dict[str, int] = {}
    for r in done:
        if r.outcome != "answered":
            key = r.outcome + ": " + _REQUEST_ID.sub("", r.error)[:160]
            errors[key] = errors.get(key, 0) + 1
    tokens = None
    if "draftsmith_emitted_tokens_total" in after:
        tokens = int(after["draftsmith_emitted_tokens_total"] - before.get("draftsmith_emitted_tokens_total", 0))

    def dist(values):
        return {f"p{q}": None if not values else round(percentile(values, q), 4) for q in (50, 95, 99)} | {
            "mean": round(statistics.fmean(values), 4) if values else None
        }

    return LoadResult(
        clients=clients,
        duration_s=duration,
        sent=len(done),
        answered=len(answered),
        failed=sum(r.outcome == "failed" for r in done),
        lost=sum(r.outcome == "lost" for r in done),
        wall_s=round(wall, 2),
        latency_s=dist(latencies),
        ttft_s=dist(ttfts),
        tokens=tokens,
        tokens_per_s=None if tokens is None else round(tokens / wall, 1),
        requests_per_s=round(len(answered) / wall, 2),
        rss=rss,
        errors=errors,
        records=done,
        origin=t0,
    )


def deterministic(body: dict) -> bool:
    """Greedy, or sampled with a seed: the same request alone must give the same text."""
    return not body.get("temperature") or "seed" in body


def check_identical(url: str, records: list[Record], timeout: float) -> dict:
    """Send each answered deterministic request again, alone and one at a time, and count texts that differ."""
    checked, mismatches = 0, []
    for record in records:
        if record.outcome != "answered" or not deterministic(record.body):
            continue
        alone = Record(-1, "http", record.prompt_class, 0.0, body=record.body)
        http_request(url, record.body, timeout, alone, time.perf_counter())
        checked += 1
        if alone.outcome != "answered" or alone.text != record.text:
            mismatches.append({"body": record.body, "under_load": record.text[:200], "alone": alone.text[:200]})
    return {"checked": checked, "mismatches": len(mismatches), "examples": mismatches[:3]}


def rss_growth(result: LoadResult, first: int = 200) -> dict | None:
    """RSS after the first ``first`` requests vs at the end (the last samples), in MiB."""
    samples = [s for s in result.rss if s["requests"] > 0]
    if len(samples) < 2:
        return None
    early = min(samples, key=lambda s: abs(s["requests"] - first))
    late = samples[-1]
    return {
        "after_requests": early["requests"],
        "rss_mb": early["rss_mb"],
        "final_requests": late["requests"],
        "final_rss_mb": late["rss_mb"],
        "growth_mb": round(late["rss_mb"] - early["rss_mb"], 1),
    }


def _print(result: LoadResult) -> None:
    lat, ttft = result.latency_s, result.ttft_s
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    click.echo(
        f"clients {result.clients}, {result.wall_s:.1f} s: sent {result.sent}, answered {result.answered}, "
        f"failed {result.failed}, lost {result.lost}"
    )
    click.echo(
        f"latency s  p50 {fmt(lat['p50'])}  p95 {fmt(lat['p95'])}  p99 {fmt(lat['p99'])}   "
        f"(streamed, first text: p50 {fmt(ttft['p50'])}  p95 {fmt(ttft['p95'])})"
    )
    click.echo(
        f"throughput {result.requests_per_s} req/s, "
        f"{'-' if result.tokens_per_s is None else result.tokens_per_s} tok/s ({result.tokens} tokens)"
    )
    if result.rss:
        click.echo("server RSS MiB: " + ", ".join(f"{s['requests']}:{s['rss_mb']}" for s in result.rss))
    for error, count in list(result.errors.items())[:10]:
        click.echo(f"  {count} x {error}")


@click.command("load")
@click.argument("target", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--url", default=None, help="Drive a running server's HTTP endpoint (e.g. http://127.0.0.1:8000).")
@click.option("--grpc-url", default=None, help="With --url: its gRPC endpoint (default: host:8001).")
@click.option("--metrics-url", default=None, help="With --url: its metrics (default: http://host:8002/metrics).")
@click.option("--clients", type=int, default=4, show_default=True, help="Concurrent clients.")
@click.option("--duration", type=float, default=10.0, show_default=True, help="Seconds of load.")
@click.option("--max-requests", type=int, default=1000, show_default=True, help="Requests in all, at most.")
@click.option(
    "--stream-fraction",
    type=float,
    default=0.5,
    show_default=True,
    help="Share of requests streamed over gRPC (the rest: HTTP generate).",
)
@click.option("--max-tokens", type=int, default=32, show_default=True, help="Largest max_tokens of a request.")
@click.option(
    "--request-timeout",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds after which a request without an answer counts as lost.",
)
@click.option(
    "--threads",
    type=int,
    default=0,
    show_default=True,
    help="Given a bundle: ONNX Runtime threads of the served model (0: all cores).",
)
@click.option("--max-batch-size", type=int, default=16, show_default=True, help="Given a bundle: batch size.")
@click.option(
    "--policy",
    type=click.Choice(["exact", "throughput"]),
    default="exact",
    show_default=True,
    help="Given a bundle: the scheduler's policy (runtime/core/scheduler.py).",
)
@click.option("--rss-every", type=int, default=100, show_default=True, help="Sample the server's RSS every N requests.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--check-identical",
    "identical",
    is_flag=True,
    help="Afterwards, send each greedy or seeded request again alone and count answers that differ.",
)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the report here.")
def load(
    target,
    url,
    grpc_url,
    metrics_url,
    clients,
    duration,
    max_requests,
    stream_fraction,
    max_tokens,
    request_timeout,
    threads,
    max_batch_size,
    policy,
    rss_every,
    seed,
    identical,
    json_out,
):
    """Drive a Triton server on REPO_OR_BUNDLE (started here on loopback) or at --url with concurrent clients."""
    from urllib.parse import urlparse
    from triton_repo.server import ServerError, start_server

    if (target is None) == (url is None):
        raise click.UsageError("give a repository or bundle, or --url of a running server (one of them)")
    server, tmp = None, None
    try:
        if url:
            parsed = urlparse(url)
            host = parsed.hostname or "127.0.0.1"
            endpoints = Endpoints(
                url.rstrip("/"),
                grpc_url or f"{host}:8001",
                metrics_url or f"http://{host}:8002/metrics",
                find_server_pid(parsed.port or 80) if host in ("127.0.0.1", "localhost") else None,
            )
        else:
            repo = Path(target)
            if (repo / "manifest.json").is_file():  # a bundle: write its repository first
                from triton_repo.generate import RepoOptions, write_repository

                tmp = tempfile.mkdtemp(prefix="draftsmith-load-")
                repo = write_repository(
                    repo, Path(tmp) / "repo", RepoOptions(threads=threads, max_batch_size=max_batch_size, policy=policy)
                )
            elif not (repo / "ensemble" / "config.pbtxt").is_file():
                raise click.UsageError(
                    f"{target} is neither a bundle (manifest.json) nor a Triton repository (ensemble/config.pbtxt)"
                )
            click.echo(f"starting tritonserver on {repo} ...", err=True)
            server = start_server(repo)
            endpoints = Endpoints(server.url, server.grpc_url, server.metrics_url, server.process.pid)
        result = run_load(
            endpoints,
            clients=clients,
            duration=duration,
            max_requests=max_requests,
            stream_fraction=stream_fraction,
            max_tokens=max_tokens,
            request_timeout=request_timeout,
            seed=seed,
            rss_every=rss_every,
        )
        identity = check_identical(endpoints.url, result.records, request_timeout) if identical else None
    except (ServerError, ValueError) as err:
        raise click.ClickException(str(err)) from None
    finally:
        if server is not None:
            server.stop()
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    _print(result)
    summary = result.summary()
    summary["rss_growth"] = rss_growth(result)
    if identity is not None:
        summary["identical"] = identity
        click.echo(
            f"identical alone: {identity['checked'] - identity['mismatches']} of {identity['checked']} "
            "deterministic answers"
        )
    if json_out:
        Path(json_out).write_text(json.dumps(summary, indent=2))
    if result.lost:
        raise SystemExit(1)


if __name__ == "__main__":
    load()
