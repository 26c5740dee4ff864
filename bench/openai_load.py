"""Load an OpenAI-compatible server: concurrent streaming clients with mixed settings, some cancelled midway.

Each client (a thread with its own HTTP connection) sends streamed requests one after another until ``duration``
seconds have passed or ``max_requests`` were sent. Requests mix greedy and sampled decoding (seeded or not),
``max_tokens`` and stop strings; a fraction closes its stream after a few chunks. Outcomes:

- answered: the stream ended with a finish_reason and ``data: [DONE]``;
- cancelled: this driver closed it midway, as planned (a request that finished first counts as answered);
- failed: the server answered with an error (a status code, or an error event);
- lost: anything else (the connection dropped, timed out, or the stream ended without finishing).

Latencies: TTFT (request sent to first text) and inter-chunk latency, the gap between text chunks (a chunk carries
every token a step accepted, so one chunk may hold several tokens). Output tokens are the answered requests' usage.
``check_identical``: each deterministic answer (greedy, or sampled with a seed) is compared with the same request run
alone afterwards, one at a time; a mismatch means batching changed the output.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, replace

import click
import httpx

from bench.hostile_load import HealthProbe, HostileBodies, HostileConnections, format_body, metadata_body
from bench.openai_client import PROMPTS, Outcome, Spec, error_message, long_prompt_of, mixed_spec, run_one
from bench.openai_report import levels_report, run_report
from bench.procmem import RssSampler
from bench.server_metrics import draft_length_counts, lag_during, loop_lag_counts
import numpy as np


def run_load(
    url: str,
    clients: int = 8,
    duration: float = 30.0,
    max_requests: int | None = None,
    *,
    model: str | None = None,
    chat: bool = False,
    max_tokens: int = 64,
    cancel_fraction: float = 0.1,
    prompts: tuple[str, ...] = PROMPTS,
    seed: int = 0,
    api_key: str | None = None,
    pid: int | None = None,
    check_identical: bool = False,
    timeout: float = 300.0,
    max_draft_tokens: int = 0,
    long_prompt_tokens: int = 0,
    long_fraction: float = 0.1,
    check_limit: int = 0,
    draft_tokens: int | None = None,
    idle_connections: int = 0,
    slow_header_clients: int = 0,
    health_url: str | None = None,
    watch_stream: int = 0,
    hostile_format: dict | None = None,
    hostile_body_bytes: int = 0,
) -> dict:
    """Drive ``url`` (a server's base, with or without /v1) with ``clients`` concurrent streams; see the module
    docstring. Returns the report as a dict (counts, latency percentiles in seconds, tokens/s, RSS in MiB)."""
    if clients < (0 if watch_stream else 1) or duration <= 0 or (max_requests is not None and max_requests < 1):
        raise ValueError("clients (0 only with watch_stream) and max_requests must be >= 1 and duration > 0")
    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = model or _first_model(base, headers, timeout)
    outcomes: list[Outcome] = []
    lock, counter = threading.Lock(), iter(range(max_requests or 1 << 62))
    long_text = long_prompt_of(long_prompt_tokens) if long_prompt_tokens else ""
    try:
        rss = RssSampler(pid)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    lengths_before = draft_length_counts(base, headers, timeout)
    address = httpx.URL(base)
    hostile = HostileConnections(address.host, address.port or 80, idle_connections, slow_header_clients).start()
    probe = HealthProbe(health_url).start() if health_url else None
    attacker = _attacker(base, model, hostile_format, hostile_body_bytes, headers, timeout)
    lag_before = loop_lag_counts(base, headers, timeout)
    start = time.perf_counter()

    def client_loop() -> None:
        with httpx.Client(headers=headers, timeout=timeout) as client:
            while time.perf_counter() - start < duration:
                with lock:
                    index = next(counter, None)
                if index is None:
                    return
                spec = mixed_spec(
                    index,
                    seed,
                    max_tokens,
                    cancel_fraction,
                    prompts,
                    max_draft_tokens,
                    long_text,
                    long_fraction,
                    draft_tokens,
                )
                outcome = run_one(client, base, spec, model, chat)
                with lock:
                    outcomes.append(outcome)

    watched: list[float] = []
    clients_done = threading.Event()  # the watched stream stops with the clients (or at the duration without any)

    def watch_loop() -> None:
        """One more client, greedy, ``watch_stream`` tokens a request back to back: the gaps a running stream sees
        while the others' requests are admitted (a long prompt's prefill must not stall it)."""
        spec = Spec(prompt=prompts[0], max_tokens=watch_stream, temperature=0.0, num_draft_tokens=draft_tokens)
        with httpx.Client(headers=headers, timeout=timeout) as client:
            while True:  # at least one request, however soon the clients finish
                watched.extend(run_one(client, base, spec, model, chat).gaps)
                if time.perf_counter() - start >= duration or clients_done.is_set():
                    break

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(clients)]
    watcher = threading.Thread(target=watch_loop, daemon=True)
    for thread in threads + ([watcher] if watch_stream else []):
        thread.start()
    for thread in threads:
        thread.join()
    if clients:
        clients_done.set()
    if watch_stream:
        watcher.join()
    elapsed = time.perf_counter() - start
    rss.stop()
    report = _summary(outcomes, elapsed)
    if watch_stream:
        report["watched_stream_gap_s"] = _percentiles(watched)
    if idle_connections or slow_header_clients:
        report["hostile_connections"] = hostile.stop()
    if probe is not None:
        report["health"] = probe.stop()
    if attacker is not None:
        report["hostile_client"] = attacker.stop()
    lag = lag_during(lag_before, loop_lag_counts(base, headers, timeout))
    if lag:
        report["event_loop_lag"] = lag
    report.update(
        url=base, model=model, clients=clients, chat=chat, max_tokens=max_tokens, speculation=draft_tokens != 0
    )
    lengths = draft_length_counts(base, headers, timeout)
    if lengths:  # what the server's step plan chose while this run was going on
        chosen = {k: n - lengths_before.get(k, 0) for k, n in lengths.items() if n > lengths_before.get(k, 0)}
        total = sum(chosen.values())
        report["planned_draft_length"] = {
            "row_steps": {str(k): n for k, n in sorted(chosen.items())},
            "mean": sum(k * n for k, n in chosen.items()) / total if total else 0.0,
        }
    if rss.samples:
        values = [v for _, v in rss.samples]
        settled = [v for t, v in rss.samples if t >= 60.0] or values[-1:]
        report["server_rss_mib"] = {
            "start": values[0],
            "peak": max(values),
            "end": values[-1],
            "at_first_minute": settled[0],
            "peak_after_first_minute": max(settled),
            "growth_after_first_minute": max(settled) / settled[0] - 1,
        }
    if check_identical:
        report["identical"] = _check_identical(outcomes, base, model, chat, headers, timeout, check_limit)
    return report


def _attacker(base, model, fmt, body_bytes, headers, timeout) -> HostileBodies | None:
    """The one more client that sends a hostile body in a loop, started (None: neither option given)."""
    if fmt and body_bytes:
        raise ValueError("one hostile client at a time: a hostile format or a hostile body size, not both")
    if fmt:
        body, label = format_body(model, fmt)
        return HostileBodies(base, "/v1/completions", body, label, headers, timeout).start()
    if body_bytes:
        body, label = metadata_body(model, body_bytes)
        return HostileBodies(base, "/v1/chat/completions", body, label, headers, timeout).start()
    return None


def _summary(outcomes: list[Outcome], elapsed: float) -> dict:
    counts = {
        status: sum(o.status == status for o in outcomes) for status in ("answered", "cancelled", "failed", "lost")
    }
    tokens = sum(o.tokens for o in outcomes if o.status == "answered")
    return {
        "sent": len(outcomes),
        **counts,
        "duration_s": elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "ttft_s": _percentiles([o.ttft for o in outcomes if o.ttft is not None]),
        "itl_s": _percentiles([gap for o in outcomes for gap in o.gaps]),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
    }


def _check_identical(
    outcomes: list[Outcome], base: str, model: str, chat: bool, headers: dict, timeout: float, limit: int = 0
) -> dict:
    """Run each distinct deterministic answered request alone, one at a time, and compare the texts. ``limit``
    (0: none) bounds the distinct requests run alone, taken evenly over the run; every answer of those is checked."""
    answered = [o for o in outcomes if o.status == "answered" and o.spec.deterministic]
    distinct = list(dict.fromkeys(replace(o.spec, cancel_after=0) for o in answered))
    if limit and len(distinct) > limit:
        kept = {distinct[i] for i in np.linspace(0, len(distinct) - 1, limit).round().astype(int)}
        answered = [o for o in answered if replace(o.spec, cancel_after=0) in kept]
    alone: dict[Spec, Outcome] = {}
    with httpx.Client(headers=headers, timeout=timeout) as client:
        for o in answered:
            spec = replace(o.spec, cancel_after=0)
            if spec not in alone:
                alone[spec] = run_one(client, base, spec, model, chat)
    mismatches = [o for o in answered if alone[replace(o.spec, cancel_after=0)].text != o.text]
    return {
        "checked": len(answered),
        "distinct": len(alone),
        "distinct_in_run": len(distinct),
        "mismatches": len(mismatches),
        "examples": [
            {**asdict(o.spec), "under_load": o.text, "alone": alone[replace(o.spec, cancel_after=0)].text}
            for o in mismatches[:3]
        ],
    }


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0, "n": 0}
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "n": len(values)}


def _first_model(base: str, headers: dict, timeout: float) -> str:
    response = httpx.get(base + "/v1/models", headers=headers, timeout=timeout)
    if response.status_code != 200:
        raise click.ClickException(f"GET {base}/v1/models: HTTP {response.status_code}: {error_message(response.text)}")
    return response.json()["data"][0]["id"]


@click.command("openai-load")
@click.argument("url")
@click.option(
    "--clients",
    "client_levels",
    default="8",
    show_default=True,
    help="Concurrent streaming clients; a list (1,2,4,8,16) runs each level in turn.",
)
@click.option(
    "--speculation",
    type=click.Choice(["on", "off", "both"]),
    default="on",
    show_default=True,
    help="off: every request sends num_draft_tokens 0 (the same server with speculation off); both: "
    "each level runs with it on, then off, and the report gives the ratio.",
)
@click.option("--duration", type=float, default=30.0, show_default=True, help="Seconds to send requests for.")
@click.option("--requests", "max_requests", type=int, default=None, help="Stop after this many requests.")
@click.option(
    "--max-tokens",
    type=int,
    default=64,
    show_default=True,
    help="The largest max_tokens; requests ask for it, half or a quarter of it.",
)
@click.option(
    "--cancel-fraction",
    type=float,
    default=0.1,
    show_default=True,
    help="Fraction of requests that close their stream after 1-3 chunks.",
)
@click.option("--chat", is_flag=True, help="Use /v1/chat/completions (the prompt as one user message).")
@click.option("--model", default=None, help="Model name (default: the server's first).")
@click.option("--api-key", envvar="DRAFTSMITH_API_KEY", show_envvar=True, default=None)
@click.option("--pid", type=int, default=None, help="The server's process id, to report its RSS.")
@click.option(
    "--check-identical",
    is_flag=True,
    help="Afterwards, run each greedy or seeded request alone and count answers that differ.",
)
@click.option(
    "--check-limit",
    type=int,
    default=0,
    show_default=True,
    help="With --check-identical: run at most this many distinct requests alone (0: all).",
)
@click.option(
    "--max-draft-tokens",
    type=int,
    default=0,
    show_default=True,
    help="Half the requests send num_draft_tokens in 1..this (0: none do).",
)
@click.option(
    "--long-prompt-tokens",
    type=int,
    default=0,
    show_default=True,
    help="Some requests send a prompt of about this many tokens (e.g. near the context limit).",
)
@click.option(
    "--long-fraction",
    type=float,
    default=0.1,
    show_default=True,
    help="With --long-prompt-tokens: the fraction of requests that send it.",
)
@click.option(
    "--idle-connections",
    type=int,
    default=0,
    show_default=True,
    help="Connections held open beside the clients that never send a byte (reopened when closed).",
)
@click.option(
    "--slow-header-clients",
    type=int,
    default=0,
    show_default=True,
    help="Connections beside the clients that send a request's headers one byte every 2 s.",
)
@click.option(
    "--health-url",
    default=None,
    help="Time this health endpoint every 0.5 s during the run (a probe failing: not 200 within 1 s).",
)
@click.option(
    "--watch-stream",
    type=int,
    default=0,
    show_default=True,
    help="One more client streams greedy requests of this many tokens back to back; its gaps between "
    "chunks are reported apart (what a running stream sees while the others are admitted).",
)
@click.option(
    "--hostile-format",
    default=None,
    help="One more client sends this response_format (JSON) in short completions back to back, e.g. "
    '\'{"type": "regex", "regex": "a{250000}"}\'; its answers are reported apart (a refusal is the right one).',
)
@click.option(
    "--hostile-body-bytes",
    type=int,
    default=0,
    show_default=True,
    help="One more client sends chat bodies of about this many bytes, nearly all a metadata array of zeros, back "
    "to back; its answers are reported apart (a refusal is the right one; the server's event loop must not lag).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the request mix.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def openai_load(
    url,
    client_levels,
    speculation,
    duration,
    max_requests,
    max_tokens,
    cancel_fraction,
    chat,
    model,
    api_key,
    pid,
    check_identical,
    check_limit,
    max_draft_tokens,
    long_prompt_tokens,
    long_fraction,
    idle_connections,
    slow_header_clients,
    health_url,
    watch_stream,
    hostile_format,
    hostile_body_bytes,
    seed,
    as_json,
):
    """Load the OpenAI-compatible server at URL with concurrent streaming clients and report what came back."""
    try:
        levels = [int(c) for c in str(client_levels).split(",")]
    except ValueError:
        raise click.BadParameter(
            f"expected client counts like 1,2,4, received {client_levels!r}", param_hint="--clients"
        ) from None
    modes = {"on": [None], "off": [0], "both": [None, 0]}[speculation]
    fmt = _json_option(hostile_format, "--hostile-format") if hostile_format else None
    runs = []
    for clients in levels:  # interleaved: each level's runs back to back, so slow drifts hit both alike
        for draft_tokens in modes:
            runs.append(
                run_load(
                    url,
                    clients=clients,
                    duration=duration,
                    max_requests=max_requests,
                    model=model,
                    chat=chat,
                    max_tokens=max_tokens,
                    cancel_fraction=cancel_fraction,
                    seed=seed,
                    api_key=api_key,
                    pid=pid,
                    check_identical=check_identical,
                    check_limit=check_limit,
                    max_draft_tokens=max_draft_tokens,
                    long_prompt_tokens=long_prompt_tokens,
                    long_fraction=long_fraction,
                    draft_tokens=draft_tokens,
                    idle_connections=idle_connections,
                    slow_header_clients=slow_header_clients,
                    health_url=health_url,
                    watch_stream=watch_stream,
                    hostile_format=fmt,
                    hostile_body_bytes=hostile_body_bytes,
                )
            )
    if len(runs) == 1:
        click.echo(run_report(runs[0], as_json))
        return
    click.echo(levels_report(runs, as_json))


def _json_option(text: str, name: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise click.BadParameter(f"expected a JSON object: {err}", param_hint=name) from None
    if not isinstance(value, dict):
        raise click.BadParameter(f"expected a JSON object, received {text!r:.80}", param_hint=name)
    return value
