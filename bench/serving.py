"""Latency and throughput through a local Triton vs the Python runtime alone, at 1 and N concurrent clients.

    python -m bench.serving BUNDLE [--threads 2] [--max-tokens 64] [--clients 16] [--requests 2]

Greedy decoding, so every answer is checked against the runtime's and token counts come from the runtime's run of
the same prompt. The runtime "alone" has no server: at 1 client it is ``generate`` in a loop; at N clients it is
either N requests one after another (a shared generator serves one request at a time) or one batched ``generate``
over N prompts (the best it can do without a server).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "Explain speculative decoding in one sentence.",
    "import numpy as np\n",
    "Once upon a time",
    "The three primary colors are",
    "SELECT name FROM users WHERE",
]


def _generate(url: str, prompt: str, max_tokens: int) -> tuple[str, float]:
    body = json.dumps({"text_input": prompt, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(
        f"{url}/v2/models/ensemble/generate", data=body, headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        text = json.loads(response.read())["text_output"]
    return text, time.perf_counter() - started


def _summary(name: str, latencies: list[float], tokens: int, wall: float) -> dict:
    ordered = sorted(latencies)
    return {
        "setup": name,
        "requests": len(latencies),
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tok_per_s": round(tokens / wall, 1),
        "p50_s": round(statistics.median(ordered), 3),
        "p90_s": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3),
    }


def run(bundle: str, threads: int = 2, max_tokens: int = 64, clients: int = 16, requests: int = 2) -> list[dict]:
    from runtime.api import SpeculativeGenerator
    from triton_repo.generate import RepoOptions, write_repository
    from triton_repo.server import start_server

    generator = SpeculativeGenerator.from_bundle(bundle, threads=threads)
    generator.generate(PROMPTS[0], max_new_tokens=4)  # warm up
    results, want = [], {}
    # runtime alone, one client
    latencies, tokens, started = [], 0, time.perf_counter()
    for prompt in PROMPTS:
        t0 = time.perf_counter()
        want[prompt] = generator.generate(prompt, max_new_tokens=max_tokens)
        latencies.append(time.perf_counter() - t0)
        tokens += len(want[prompt].token_ids)
    results.append(_summary("runtime, 1 client", latencies, tokens, time.perf_counter() - started))
    load = [PROMPTS[(c + i) % len(PROMPTS)] for c in range(clients) for i in range(requests)]
    load_tokens = sum(len(want[p].token_ids) for p in load)
    # runtime alone, N requests one after another
    latencies, started = [], time.perf_counter()
    for prompt in load:
        t0 = time.perf_counter()
        generator.generate(prompt, max_new_tokens=max_tokens)
        latencies.append(time.perf_counter() - t0 + (t0 - started))  # a queued client waits for those before it
    results.append(
        _summary(f"runtime, {clients} clients served in turn", latencies, load_tokens, time.perf_counter() - started)
    )
    # runtime alone, batched generate (chunks of N prompts)
    mismatches = 0  # answers that differ from the single-request runtime's (greedy: should be none)
    latencies, started = [], time.perf_counter()
    for i in range(0, len(load), clients):
        chunk = load[i : i + clients]
        batch = generator.generate(chunk, max_new_tokens=max_tokens)
        mismatches += sum(g.text != want[p].text for g, p in zip(batch, chunk))
        latencies += [time.perf_counter() - started] * len(chunk)
    results.append(
        _summary(f"runtime, batched generate of {clients}", latencies, load_tokens, time.perf_counter() - started)
    )
    del generator
    with tempfile.TemporaryDirectory(prefix="draftsmith-bench-") as tmp:
        repo = write_repository(
            bundle,
            Path(tmp) / "repo",  # the bench asks for exactly max_tokens
            RepoOptions(threads=threads, max_batch_size=clients, max_tokens_limit=max_tokens),
        )
        server = start_server(repo)
        try:
            _generate(server.url, PROMPTS[0], 4)  # warm up
            latencies, started = [], time.perf_counter()
            for prompt in PROMPTS:
                text, seconds = _generate(server.url, prompt, max_tokens)
                mismatches += text != want[prompt].text
                latencies.append(seconds)
            results.append(
                _summary(
                    "triton, 1 client",
                    latencies,
                    sum(len(want[p].token_ids) for p in PROMPTS),
                    time.perf_counter() - started,
                )
            )

            def client(c: int) -> list[float]:
                out = []
                for i in range(requests):
                    prompt = PROMPTS[(c + i) % len(PROMPTS)]
                    text, seconds = _generate(server.url, prompt, max_tokens)
                    out.append(-seconds if text != want[prompt].text else seconds)  # negative: a mismatch
                return out

            started = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                latencies = [s for batch in pool.map(client, range(clients)) for s in batch]
            mismatches += sum(s < 0 for s in latencies)
            latencies = [abs(s) for s in latencies]
            results.append(
                _summary(f"triton, {clients} clients", latencies, load_tokens, time.perf_counter() - started)
            )
        finally:
            server.stop()
    results.append({"setup": "answers differing from the single-request runtime", "mismatches": mismatches})
    return results


@click.command()
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--clients", type=int, default=16, show_default=True)
@click.option("--requests", type=int, default=2, show_default=True, help="Requests per client at N clients.")
def main(bundle, threads, max_tokens, clients, requests):
    """Benchmark BUNDLE through Triton against the Python runtime alone."""
    rows = run(bundle, threads=threads, max_tokens=max_tokens, clients=clients, requests=requests)
    click.echo(f"{'setup':42} {'reqs':>5} {'tokens':>7} {'wall s':>7} {'tok/s':>7} {'p50 s':>7} {'p90 s':>7}")
    for r in rows:
        if "mismatches" in r:
            click.echo(f"{r['setup']}: {r['mismatches']}")
            continue
        click.echo(
            f"{r['setup']:42} {r['requests']:5d} {r['tokens']:7d} {r['wall_s']:7.2f} {r['tok_per_s']:7.1f} "
            f"{r['p50_s']:7.3f} {r['p90_s']:7.3f}"
        )


if __name__ == "__main__":
    main()
