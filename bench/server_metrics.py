"""What a load run reads from the OpenAI server's /metrics before and after it: the draft lengths its step plan
chose (``draftsmith_scheduler_draft_length_total``) and its event loop's lag (``draftsmith_event_loop_lag_seconds``,
runtime/serving/loop_lag.py); the run reports the difference."""

from __future__ import annotations

import re

import httpx


def loop_lag_counts(base: str, headers: dict, timeout: float) -> dict[float, float]:
    """The server's event-loop lag histogram from its /metrics: {bucket's upper bound: samples at or below it}
    ({} where it has none)."""
    try:
        text = httpx.get(f"{base}/metrics", headers=headers, timeout=timeout).text
    except httpx.HTTPError:
        return {}
    found = re.findall(r'^draftsmith_event_loop_lag_seconds_bucket\{le="([^"]+)"\} ([0-9.e+]+)$', text, re.MULTILINE)
    return {float(bound): float(n) for bound, n in found}


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
    """Row-steps by the draft length the server's step plan chose, from its /metrics ({} where it has none)."""
    try:
        text = httpx.get(f"{base}/metrics", headers=headers, timeout=timeout).text
    except httpx.HTTPError:
        return {}
    found = re.findall(r'^draftsmith_scheduler_draft_length_total\{k="(\d+)"\} ([0-9.e+]+)$', text, re.MULTILINE)
    return {int(k): float(n) for k, n in found}
