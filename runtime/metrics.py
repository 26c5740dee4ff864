"""Speculative-decoding statistics, with vLLM's definitions, per request and cumulative; Prometheus text export."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field


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
        for name in ("draft_acceptance_rate", "mean_acceptance_length", "system_efficiency",
                     "acceptance_per_position", "tokens_per_second"):
            out[name] = getattr(self, name)
        return out

    def merge(self, other: "RequestStats") -> None:
        """Add another request's counters (cumulative metrics)."""
        for name in ("prompt_tokens", "num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                     "num_emitted_tokens", "verify_slots", "fallback_steps", "draft_time", "verify_time",
                     "total_time", "time_to_first_token"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, value in enumerate(theirs):
                mine[i] += value


class MetricsRegistry:
    """Cumulative counters across requests, thread-safe, exportable as Prometheus text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = RequestStats()
        self.requests = 0
        self.fallback_active = False

    def add(self, stats: RequestStats) -> None:
        with self._lock:
            self.total.merge(stats)
            self.requests += 1

    def prometheus(self, prefix: str = "draftsmith") -> str:
        with self._lock:
            t = self.total
            counters = {
                "requests_total": ("Requests completed", self.requests),
                "verify_steps_total": ("Target verify calls", t.num_steps),
                "drafts_total": ("Verify steps that checked at least one draft token", t.num_drafts),
                "draft_tokens_total": ("Draft tokens proposed", t.num_draft_tokens),
                "accepted_tokens_total": ("Draft tokens accepted", t.num_accepted_tokens),
                "emitted_tokens_total": ("Tokens generated", t.num_emitted_tokens),
                "fallback_steps_total": ("Target-only steps taken because acceptance fell low", t.fallback_steps),
            }
            gauges = {
                "draft_acceptance_rate": ("accepted / drafted", t.draft_acceptance_rate),
                "mean_acceptance_length": ("1 + accepted / drafts", t.mean_acceptance_length),
                "system_efficiency": ("emitted / (steps * (k + 1))", t.system_efficiency),
                "fallback_active": ("1 while decoding target-only because of low acceptance", int(self.fallback_active)),
            }
            lines = []
            for name, (help_text, value) in counters.items():
                lines += [f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} counter",
                          f"{prefix}_{name} {value}"]
            for name, (help_text, value) in gauges.items():
                lines += [f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} gauge",
                          f"{prefix}_{name} {value}"]
            for i, rate in enumerate(t.acceptance_per_position):
                if i == 0:
                    lines += [f"# HELP {prefix}_acceptance_by_position Acceptance rate of draft position i",
                              f"# TYPE {prefix}_acceptance_by_position gauge"]
                lines.append(f'{prefix}_acceptance_by_position{{position="{i + 1}"}} {rate}')
            return "\n".join(lines) + "\n"
