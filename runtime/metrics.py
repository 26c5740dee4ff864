"""Speculative-decoding statistics, with vLLM's definitions, per request and cumulative; Prometheus export.

prometheus_client writes the export (names, escaping, histograms, content type). It is imported on the first export
only: Triton's Python backend loads the runtime too, exports its own metrics there, and cannot import
prometheus_client (its ``ssl`` import fails in the backend stub's interpreter).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable


def __getattr__(name):  # CONTENT_TYPE: the Content-Type header of MetricsRegistry.prometheus()'s text, lazily
    if name == "CONTENT_TYPE":
        from prometheus_client import CONTENT_TYPE_LATEST

        return CONTENT_TYPE_LATEST
    raise AttributeError(name)


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
COUNTERS = {  # exported name (without _total) -> (help, RequestStats field or "requests")
    "requests": ("Requests completed", "requests"),
    "verify_steps": ("Target verify calls", "num_steps"),
    "drafts": ("Verify steps that checked at least one draft token", "num_drafts"),
    "draft_tokens": ("Draft tokens proposed", "num_draft_tokens"),
    "accepted_tokens": ("Draft tokens accepted", "num_accepted_tokens"),
    "emitted_tokens": ("Tokens generated", "num_emitted_tokens"),
    "fallback_steps": ("Target-only steps taken because acceptance fell low", "fallback_steps"),
}
# vLLM's spec-decode counters under vLLM's own names, so dashboards built for vLLM read ours: vllm-project/vllm
# vllm/v1/spec_decode/metrics.py (SpecDecodingProm), each exposed with _total; per position with a 0-based label.
VLLM_COUNTERS = {
    "vllm:spec_decode_num_drafts": ("Number of spec decoding drafts.", "num_drafts"),
    "vllm:spec_decode_num_draft_tokens": ("Number of draft tokens.", "num_draft_tokens"),
    "vllm:spec_decode_num_accepted_tokens": ("Number of accepted tokens.", "num_accepted_tokens"),
}
GAUGES = {  # exported name -> (help, RequestStats property of the cumulative counters)
    "draft_acceptance_rate": ("accepted / drafted", "draft_acceptance_rate"),
    "mean_acceptance_length": ("1 + accepted / drafts", "mean_acceptance_length"),
    "system_efficiency": ("emitted / (steps * (k + 1))", "system_efficiency"),
}


@dataclass
class LatencyHistogram:
    """Observations counted into fixed buckets (upper bounds, seconds), as a Prometheus histogram exports them."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # [i]: observations in (bounds[i-1], bounds[i]]; last: above all
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), +Inf last: a Prometheus histogram's buckets."""
        running, out = 0, []
        for bound, count in zip(self.bounds + (float("inf"),), self.counts):
            running += count
            out.append((bound, running))
        return out


class MetricsRegistry:
    """Cumulative counters across requests and latency histograms, thread-safe, exported for Prometheus.

    Each registry exports through its own prometheus_client ``CollectorRegistry`` (no process-global state: two
    generators in one process count apart), made on the first export. The one registry of a process's metrics: what
    serves them passes its own families to ``prometheus`` (a server: its scheduler's), so every metric is exported the
    same way. (A Triton model reports through Triton's own metric API: its backend cannot serve this text.)
    """

    def __init__(self, prefix: str = "draftsmith") -> None:
        self._lock = threading.Lock()
        self.prefix = prefix
        self.total = RequestStats()
        self.requests = 0
        self.fallback_active = False  # True while decoding target-only because acceptance fell low (on_fallback)
        self.ttft = LatencyHistogram(TTFT_BUCKETS)
        self.inter_token = LatencyHistogram(ITL_BUCKETS)
        self.by_drafter: dict[str, list[int]] = {}  # drafter kind -> [draft tokens, accepted tokens]
        self._registry = None

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

    def prometheus(self, more: Callable[[], list] | None = None) -> str:
        """Every metric in Prometheus' text exposition format (served with ``runtime.metrics.CONTENT_TYPE``), and
        the families ``more()`` gives for this export (prometheus_client metric families: a server's scheduler's)."""
        from prometheus_client import CollectorRegistry, generate_latest

        with self._lock:
            if self._registry is None:
                self._registry = CollectorRegistry(auto_describe=False)
                self._registry.register(self)
        text = generate_latest(self._registry).decode("utf-8")
        if more is not None:
            extra = CollectorRegistry(auto_describe=False)
            extra.register(_Families(more))
            text += generate_latest(extra).decode("utf-8")
        return text

    def collect(self) -> list:
        """prometheus_client's collector protocol: the metric families of one consistent snapshot."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        with self._lock:
            t, p = self.total, self.prefix
            counted = {"requests": self.requests, **{f: getattr(t, f) for _, f in COUNTERS.values() if f != "requests"}}
            out = [CounterMetricFamily(f"{p}_{name}", text, value=counted[f]) for name, (text, f) in COUNTERS.items()]
            out += [CounterMetricFamily(name, text, value=counted[f]) for name, (text, f) in VLLM_COUNTERS.items()]
            per_pos = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=["position"],
            )
            for i, count in enumerate(t.accepted_per_position):
                per_pos.add_metric([str(i)], count)
            out.append(per_pos)
            out += [
                GaugeMetricFamily(f"{p}_{name}", help_text, value=getattr(t, f))
                for name, (help_text, f) in GAUGES.items()
            ]
            out.append(
                GaugeMetricFamily(
                    f"{p}_fallback_active",
                    "1 while decoding target-only because of low acceptance",
                    value=int(self.fallback_active),
                )
            )
            by_position = GaugeMetricFamily(
                f"{p}_acceptance_by_position", "Acceptance rate of draft position i", labels=["position"]
            )
            for i, rate in enumerate(t.acceptance_per_position):
                by_position.add_metric([str(i + 1)], rate)
            out.append(by_position)
            out += self._by_drafter()
            for name, help_text, histogram in (
                (
                    "time_to_first_token_seconds",
                    "Seconds from a request's start (prefill included) to its first token",
                    self.ttft,
                ),
                ("inter_token_latency_seconds", "A request's mean seconds per token after its first", self.inter_token),
            ):
                out.append(
                    HistogramMetricFamily(
                        f"{p}_{name}",
                        help_text,
                        sum_value=histogram.total,
                        buckets=[(floatToGoString(b), c) for b, c in histogram.cumulative()],
                    )
                )
        return out

    def _by_drafter(self) -> list:
        from prometheus_client.core import CounterMetricFamily

        families = [
            CounterMetricFamily(f"{self.prefix}_{name}", text, labels=["drafter"])
            for name, text in (
                ("drafter_draft_tokens", "Draft tokens proposed, by drafter kind"),
                ("drafter_accepted_tokens", "Draft tokens accepted, by drafter kind"),
            )
        ]
        for drafter, counts in sorted(self.by_drafter.items()):
            for family, count in zip(families, counts):
                family.add_metric([drafter], count)
        return families


class _Families:
    """A prometheus_client collector over a function that gives metric families."""

    def __init__(self, families: Callable[[], list]) -> None:
        self.collect = families


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
