"""Stop a server mid-load and account for every request: the check behind a Kubernetes rolling update, as one
command over two experiments:

- ``--server openai`` (bench/drain_openai.py): two ``draftsmith serve-openai`` replicas behind a balancer, one
  stopped with SIGTERM per repetition; every request answered, or refused with 503 and answered by the other;
- ``--server triton`` (bench/drain_triton.py): one ``draftsmith serve`` under load, SIGTERM mid-run; every request
  answered in full, or refused before any work.

Each prints a JSON report: per repetition and in total (bench/drain_totals.py).

    python -m bench.drain BUNDLE --repetitions 5
"""

from __future__ import annotations

import json

import click

from bench.drain_openai import run_drain
from bench.drain_triton import run_triton_drain


@click.command()
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.option("--repetitions", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--clients", type=click.IntRange(min=1), default=6, show_default=True)
@click.option("--duration", type=float, default=6.0, show_default=True, help="Seconds of load per repetition.")
@click.option("--sigterm-after", type=float, default=2.0, show_default=True)
@click.option("--max-tokens", type=int, default=96, show_default=True)
@click.option("--threads", type=int, default=1, show_default=True, help="Each replica's ONNX Runtime threads.")
@click.option("--drain-linger", type=float, default=1.0, show_default=True)
@click.option(
    "--server",
    type=click.Choice(["openai", "triton"]),
    default="openai",
    show_default=True,
    help="triton: one draftsmith serve under load, SIGTERM mid-run (--duration unused).",
)
def main(bundle, repetitions, clients, duration, sigterm_after, max_tokens, threads, drain_linger, server):
    """Drain check: two replicas of BUNDLE under load, one stopped with SIGTERM per repetition; JSON report."""
    if server == "triton":
        report = run_triton_drain(
            bundle, repetitions, clients=clients, linger=drain_linger, max_tokens=min(max_tokens, 32), threads=threads
        )
    else:
        report = run_drain(
            bundle,
            repetitions,
            clients=clients,
            duration=duration,
            sigterm_after=sigterm_after,
            max_tokens=max_tokens,
            threads=threads,
            drain_linger=drain_linger,
        )
    click.echo(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
