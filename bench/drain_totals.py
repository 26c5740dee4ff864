"""How the runs of a drain experiment add up, the same for both (bench/drain_openai.py, bench/drain_triton.py):
one report's total over its repetitions."""

from __future__ import annotations


def drain_totals(runs: list[dict], counted: tuple[str, ...], exit_code_key: str) -> dict:
    """The ``counted`` figures summed over ``runs``, the exit codes seen (under ``exit_code_key`` in each run), and
    the seconds from SIGTERM to exit (min, max, mean)."""
    exits = [r["sigterm_to_exit_s"] for r in runs]
    total = {key: sum(r[key] for r in runs) for key in counted}
    total.update(
        exit_codes=sorted({r[exit_code_key] for r in runs}, key=str),
        sigterm_to_exit_s={"min": min(exits), "max": max(exits), "mean": sum(exits) / len(exits)},
    )
    return total
