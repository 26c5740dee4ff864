"""Speculative-decoding statistics, with vLLM's definitions, per request and cumulative (``MetricsRegistry``).

What is counted here; what is exported, under which names, is runtime/metric_families.py's one table, which both
servers render (the OpenAI server with prometheus_client, the Triton model with Triton's own metric API).
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import asdict, dataclass, field, replace


@dataclass
class RequestStats:
    """Counters of one sequence. A 'step' is one target call; a 'draft' is a step that verified >= 1 draft token."""

    prompt_tokens: int = 0
    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    verify_slots: int = 0  # sum over steps of (draft tokens + 1): what the target could have emitted
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: steps whose draft token i+1 was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: steps that proposed a draft token i+1
    fallback_steps: int = 0  # target-only steps taken because acceptance fell too low
    time_to_first_token: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    finish_reason: str = ""

    def record_step(self, drafted: int, accepted: int, emitted: int, fallback: bool) -> None:
        self.num_steps += 1
        self.verify_slots += drafted + 1
        self.num_emitted_tokens += emitted
        self.fallback_steps += int(fallback)
        if drafted:
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
            for counts, upto in ((self.drafted_per_position, drafted), (self.accepted_per_position, accepted)):
                counts.extend([0] * (drafted - len(counts)))
                for i in range(upto):
                    counts[i] += 1

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def system_efficiency(self) -> float:
        return self.num_emitted_tokens / self.verify_slots if self.verify_slots else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.num_emitted_tokens / self.total_time if self.total_time > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in (
            "draft_acceptance_rate",
            "mean_acceptance_length",
            "system_efficiency",
            "acceptance_per_position",
            "tokens_per_second",
        ):
            out[name] = getattr(self, name)
        return out

    def copy(self) -> "RequestStats":
        return replace(
            self,
            accepted_per_position=list(self.accepted_per_position),
            drafted_per_position=list(self.drafted_per_position),
        )

    def merge(self, other: "RequestStats") -> None:
        """Add another request's counters (cumulative metrics)."""
        for name in (
            "prompt_tokens",
            "num_steps",
            "num_drafts",
            "num_draft_tokens",
            "num_accepted_tokens",
            "num_emitted_tokens",
            "verify_slots",
            "fallback_steps",
            "draft_time",
            "verify_time",
            "total_time",
            "time_to_first_token",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in (
            (self.accepted_per_position, other.accepted_per_position),
            (self.drafted_per_position, other.drafted_per_position),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, value in enumerate(theirs):
                mine[i] += value


# Latency buckets (seconds): a CPU first token takes tens of milliseconds to seconds, a token after it milliseconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
RECENT = 256  # observations a histogram keeps as they were, for an exporter that can only observe (Triton's)


@dataclass
class LatencyHistogram:
    """Observations counted into fixed buckets (upper bounds, seconds), as a Prometheus histogram exports them.

    It also keeps its last ``RECENT`` observations (``recent``) and how many it ever had (``observed``): Triton's
    histograms cannot be set, only observed, so its exporter replays the observations made since its last look
    (runtime/metric_families.py ``TritonMetrics``)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # [i]: observations in (bounds[i-1], bounds[i]]; last: above all
    total: float = 0.0
    observed: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[self.bucket(seconds)] += 1
        self.total += seconds
        self.observed += 1
        self.recent.append(seconds)

    def bucket(self, seconds: float) -> int:
        """The index into ``counts`` of the bucket ``seconds`` falls in (Prometheus' ``le``: at or below a bound)."""
        return bisect.bisect_left(self.bounds, seconds)

    def copy(self) -> "LatencyHistogram":
        return LatencyHistogram(self.bounds, list(self.counts), self.total, self.observed, self.recent.copy())

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), +Inf last: a Prometheus histogram's buckets."""
        running, out = 0, []
        for bound, count in zip(self.bounds + (float("inf"),), self.counts):
            running += count
            out.append((bound, running))
        return out


@dataclass(frozen=True)
class Counts:
    """A consistent copy of a registry's counts (``MetricsRegistry.snapshot``): what an export reads, while the
    registry goes on counting."""

    total: RequestStats
    requests: int
    fallback_active: bool
    by_drafter: dict[str, tuple[int, int]]  # drafter kind -> (draft tokens, accepted tokens)
    ttft: LatencyHistogram
    inter_token: LatencyHistogram
    target_calls: int
    refused: int


class MetricsRegistry:
    """Cumulative counters across requests and latency histograms, thread-safe: one per loaded bundle, so two
    generators in one process count apart. Counted into by the output processor (``add``: every finished sequence),
    the scheduler (``fallback_active``; ``count_call``: its target's calls while it runs) and the front door
    (``count_refusal``); read by the exporters through ``snapshot``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = RequestStats()
        self.requests = 0
        self.fallback_active = False  # True while decoding target-only because acceptance fell low (on_fallback)
        self.ttft = LatencyHistogram(TTFT_BUCKETS)
        self.inter_token = LatencyHistogram(ITL_BUCKETS)
        self.by_drafter: dict[str, list[int]] = {}  # drafter kind -> [draft tokens, accepted tokens]
        self.target_calls = 0
        self.refused = 0  # requests the front door refused (a bad request)

    def add(self, stats: RequestStats, drafter: str = "") -> None:
        """Count a finished request: its counters, its time to first token and its inter-token latency, (total -
        TTFT) / (tokens - 1); with ``drafter`` (its kind), its draft and accepted tokens under that label too: the
        acceptance of each method a bundle serves."""
        with self._lock:
            self.total.merge(stats)
            if drafter:
                counts = self.by_drafter.setdefault(drafter, [0, 0])
                counts[0] += stats.num_draft_tokens
                counts[1] += stats.num_accepted_tokens
            self.requests += 1
            if stats.num_emitted_tokens:
                self.ttft.observe(stats.time_to_first_token)
            if stats.num_emitted_tokens > 1:
                self.inter_token.observe(
                    max(0.0, stats.total_time - stats.time_to_first_token) / (stats.num_emitted_tokens - 1)
                )

    def count_call(self, call) -> None:
        """A target engine's call (an engine observer: runtime/engines/base.py ``Call``): a batch step is one call,
        however many sequences it verifies; admitted prompts prefilled in place (``prefill_rows``) one each, as a
        fused target prefills each admitted row in calls of its own."""
        with self._lock:
            self.target_calls += call.rows if call.kind == "prefill_rows" else 1

    def count_refusal(self) -> None:
        """A request a server's front door refused (runtime/core/request.py ``FrontDoor.admit``)."""
        with self._lock:
            self.refused += 1

    def snapshot(self) -> Counts:
        """A copy of every count, taken under the lock: one consistent reading."""
        with self._lock:
            return Counts(
                self.total.copy(),
                self.requests,
                self.fallback_active,
                {kind: (c[0], c[1]) for kind, c in self.by_drafter.items()},
                self.ttft.copy(),
                self.inter_token.copy(),
                self.target_calls,
                self.refused,
            )


def peak_rss_bytes() -> int:
    """This process's peak resident memory. On Linux from VmHWM, which belongs to the program now running:
    getrusage's ru_maxrss is kept across exec, so a child started by a large parent would report the parent's size."""
    import resource
    import sys
    from pathlib import Path

    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)  # Linux reports KiB, macOS bytes


def available_memory_bytes() -> int | None:
    """The memory the system can give without swapping (Linux's MemAvailable); None where it cannot be read."""
    from pathlib import Path

    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None
