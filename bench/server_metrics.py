"""What a load run reads from the OpenAI server's /metrics before and after it: the draft lengths its step plan
chose (``draftsmith_scheduler_draft_length_total``) and its event loop's lag (``draftsmith_event_loop_lag_seconds``,
runtime/serving/loop_lag.py); the run reports the difference."""

from __future__ import annotations

import re

import httpx


def samples(base: str, headers: dict, timeout: float, family: str, label: str) -> list[tuple[str, float]]:
    """(label value, sample value) of the series ``family{label="..."}`` on the server's /metrics ([] where it has
    none, or no /metrics)."""
    try:
        text = httpx.get(f"{base}/metrics", headers=headers, timeout=timeout).text
    except httpx.HTTPError:
        return []
    pattern = rf'^{re.escape(family)}\{{{label}="([^"]+)"\}} ([0-9.e+]+)$'
    return [(value, float(n)) for value, n in re.findall(pattern, text, re.MULTILINE)]


def loop_lag_counts(base: str, headers: dict, timeout: float) -> dict[float, float]:
    """The server's event-loop lag histogram: {bucket's upper bound: samples at or below it}."""
    found = samples(base, headers, timeout, "draftsmith_event_loop_lag_seconds_bucket", "le")
    return {float(bound): n for bound, n in found}


def lag_during(before: dict[float, float], after: dict[float, float]) -> dict:
    """The lag samples taken during a run (the difference of two readings): how many, how many over 50 ms, and the
    upper bound of the highest bucket any reached (the lag was at most that)."""
    if not after:
        return {}
    during = {bound: n - before.get(bound, 0.0) for bound, n in sorted(after.items())}
    samples = during.get(float("inf"), 0.0)
    at_most_50ms = max((n for bound, n in during.items() if bound <= 0.05), default=0.0)
    below, highest = 0.0, 0.0
    for bound, n in during.items():
        if n > below:
            highest, below = bound, n
    return {"samples": int(samples), "over_50ms": int(samples - at_most_50ms), "max_at_most_s": highest}


def draft_length_counts(base: str, headers: dict, timeout: float) -> dict[int, float]:
    """Row-steps by the draft length the server's step plan chose."""
    return {int(k): n for k, n in samples(base, headers, timeout, "draftsmith_scheduler_draft_length_total", "k")}
