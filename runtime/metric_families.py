"""The one table of the metric families both servers export (``FAMILIES``: each one's name, kind, help, labels and
where its value comes from), and its two renderings: prometheus_client's text for the OpenAI server's /metrics
(``prometheus_text``) and Triton's own metric API for the Triton model (``TritonMetrics``).

Every value is read from one ``Reading``: the bundle's registry (runtime/metrics.py: the sequences that ended, the
target's calls, the front door's refusals) and the serving scheduler's counters and gauges (runtime/serving/
scheduler.py ``stats``), taken together so one export is consistent. Without a scheduler (a Python API's registry)
the scheduler's families read zero, so every export has the same families.

Names are the registry's and the scheduler's (``draftsmith_*``), and vLLM's (``vllm:*``, vllm/v1/spec_decode/
metrics.py and its queue gauges) where vLLM has the same series, so dashboards built for vLLM read ours. A counter's
name is without ``_total``: each rendering adds it (as prometheus_client does).

Triton's side, as its 2.51 server (the nvidia-pytriton wheel) behaves: ``pb_utils.MetricFamily`` has the kinds
COUNTER, GAUGE and HISTOGRAM, string labels per metric, a histogram's buckets given when its metric is made, and
names with ':'; a counter can only be incremented (by a value >= 0) and a histogram only observed. So ``TritonMetrics``
keeps what it last exported and applies the difference: a counter increments by it, a gauge is set, a histogram
replays the observations made since (``LatencyHistogram.recent``). Triton writes a help text as it is, unescaped: a
newline in one breaks its /metrics text (and with a '"' too it aborted the server), so every help here is one line.

prometheus_client is imported by ``prometheus_text`` alone: Triton's Python backend runs the runtime but cannot import
it (its ``ssl`` import fails in the backend stub's interpreter).
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

from runtime.metrics import Counts, LatencyHistogram, MetricsRegistry

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the text format prometheus_client's generate_latest writes


@dataclass(frozen=True)
class Reading:
    """One consistent reading of everything the table exports."""

    counts: Counts  # the registry's (MetricsRegistry.snapshot)
    scheduler: dict  # the scheduler's stats() ({}: no scheduler, its families read 0)
    draft_lengths: dict[int, int]  # the scheduler's row-steps by planned draft length
    model_name: str  # the served model's name (vLLM's queue gauges' label)

    def stat(self, key: str) -> float:
        return self.scheduler.get(key, 0)


def read(registry: MetricsRegistry, scheduler=None, model_name: str = "") -> Reading:
    """A reading for one export: ``registry``'s counts and, for a server, its scheduler's (anything with ``stats()``
    and ``draft_lengths``: runtime/core/scheduler.py's Scheduler) under ``model_name``."""
    if scheduler is None:
        return Reading(registry.snapshot(), {}, {}, model_name)
    lengths = dict(scheduler.draft_lengths)  # one C-level copy: the scheduler's thread may add a length meanwhile
    return Reading(registry.snapshot(), scheduler.stats(), dict(sorted(lengths.items())), model_name)


@dataclass(frozen=True)
class Family:
    """One metric family: ``value`` gives, from a reading, a number, or with ``labels`` {label values: number}, or
    for a histogram a LatencyHistogram."""

    name: str  # a counter's without "_total"
    kind: str  # COUNTER, GAUGE or HISTOGRAM
    help: str  # one line (Triton writes it unescaped)
    value: Callable[[Reading], Any]
    labels: tuple[str, ...] = ()

    @property
    def exported(self) -> str:
        """The family's name on /metrics (a counter's with ``_total``)."""
        return f"{self.name}_total" if self.kind == COUNTER else self.name


def _total(field: str) -> Callable[[Reading], Any]:
    return lambda r: getattr(r.counts.total, field)


def _stat(key: str) -> Callable[[Reading], Any]:
    return lambda r: r.stat(key)


def _by_position(r: Reading) -> dict:
    return {(str(i + 1),): rate for i, rate in enumerate(r.counts.total.acceptance_per_position)}


def _accepted_per_pos(r: Reading) -> dict:
    return {(str(i),): n for i, n in enumerate(r.counts.total.accepted_per_position)}  # 0-based, as vLLM counts


def _by_drafter(index: int) -> Callable[[Reading], Any]:
    return lambda r: {(kind,): counts[index] for kind, counts in sorted(r.counts.by_drafter.items())}


def _queue(key: str) -> Callable[[Reading], Any]:
    return lambda r: {(r.model_name,): r.stat(key)}


def _errors(r: Reading) -> float:
    return r.counts.refused + r.stat("refused") + r.stat("failed")


FAMILIES = (
    # what ended sequences counted (runtime/core/outputs.py: MetricsRegistry.add), per sequence
    Family("draftsmith_requests", COUNTER, "Requests whose decoding ended (finished, cancelled or timed out)",
           lambda r: r.counts.requests),
    Family("draftsmith_verify_steps", COUNTER,
           "Target verify steps summed over sequences (above target_calls when requests share a batch)",
           _total("num_steps")),
    Family("draftsmith_drafts", COUNTER, "Verify steps that checked at least one draft token", _total("num_drafts")),
    Family("draftsmith_draft_tokens", COUNTER, "Draft tokens proposed to the target", _total("num_draft_tokens")),
    Family("draftsmith_accepted_tokens", COUNTER, "Draft tokens the target accepted", _total("num_accepted_tokens")),
    Family("draftsmith_emitted_tokens", COUNTER, "Tokens generated", _total("num_emitted_tokens")),
    Family("draftsmith_fallback_steps", COUNTER, "Target-only steps taken because acceptance fell low",
           _total("fallback_steps")),
    Family("draftsmith_draft_acceptance_rate", GAUGE, "accepted / drafted", _total("draft_acceptance_rate")),
    Family("draftsmith_mean_acceptance_length", GAUGE, "1 + accepted / drafts", _total("mean_acceptance_length")),
    Family("draftsmith_system_efficiency", GAUGE, "emitted / (steps * (k + 1))", _total("system_efficiency")),
    Family("draftsmith_acceptance_by_position", GAUGE, "Acceptance rate of draft position i", _by_position,
           ("position",)),
    Family("draftsmith_drafter_draft_tokens", COUNTER, "Draft tokens proposed, by drafter kind", _by_drafter(0),
           ("drafter",)),
    Family("draftsmith_drafter_accepted_tokens", COUNTER, "Draft tokens accepted, by drafter kind", _by_drafter(1),
           ("drafter",)),
    Family("draftsmith_time_to_first_token_seconds", HISTOGRAM,
           "Seconds from a request's start (prefill included) to its first token", lambda r: r.counts.ttft),
    Family("draftsmith_inter_token_latency_seconds", HISTOGRAM, "A request's mean seconds per token after its first",
           lambda r: r.counts.inter_token),
    # vLLM's spec-decode counters under vLLM's names (vllm/v1/spec_decode/metrics.py SpecDecodingProm)
    Family("vllm:spec_decode_num_drafts", COUNTER, "Number of spec decoding drafts.", _total("num_drafts")),
    Family("vllm:spec_decode_num_draft_tokens", COUNTER, "Number of draft tokens.", _total("num_draft_tokens")),
    Family("vllm:spec_decode_num_accepted_tokens", COUNTER, "Number of accepted tokens.",
           _total("num_accepted_tokens")),
    Family("vllm:spec_decode_num_accepted_tokens_per_pos", COUNTER, "Accepted tokens per draft position.",
           _accepted_per_pos, ("position",)),
    # the registry's other counts: the scheduler's target calls (an engine observer), the front door's refusals
    Family("draftsmith_target_calls", COUNTER,
           "Target engine calls (prefill and verify); one call covers a whole batch", lambda r: r.counts.target_calls),
    Family("draftsmith_request_errors", COUNTER,
           "Requests answered with an error: refused at the front door, refused as overloaded, or failed", _errors),
    Family("draftsmith_fallback_active", GAUGE, "1 while decoding target-only because of low acceptance",
           lambda r: int(r.counts.fallback_active)),
    # the scheduler's own (runtime/core/scheduler.py stats)
    Family("draftsmith_scheduler_steps", COUNTER, "Scheduler steps (each advances every running row once)",
           _stat("steps")),
    Family("draftsmith_scheduler_speculative_steps", COUNTER, "Steps that drafted and verified",
           _stat("speculative_steps")),
    Family("draftsmith_scheduler_row_steps", COUNTER, "Rows advanced, summed over steps", _stat("row_steps")),
    Family("draftsmith_scheduler_admitted", COUNTER, "Requests admitted into the batch", _stat("admitted")),
    Family("draftsmith_scheduler_finished", COUNTER, "Requests finished (stop, length or context)", _stat("finished")),
    Family("draftsmith_scheduler_cancelled", COUNTER,
           "Requests cancelled (their client cancelled or went away); decoding stopped at the next step",
           _stat("cancelled")),
    Family("draftsmith_scheduler_timed_out", COUNTER, "Requests that ran past their deadline", _stat("timed_out")),
    Family("draftsmith_scheduler_refused", COUNTER,
           "Requests refused as overloaded (queue full, or waited too long)", _stat("refused")),
    Family("draftsmith_scheduler_failed", COUNTER,
           "Requests that failed after the front door (admission or decoding failed, or the scheduler stopped)",
           _stat("failed")),
    Family("draftsmith_scheduler_step_seconds", COUNTER, "Seconds spent in steps", _stat("step_time")),
    Family("draftsmith_scheduler_engine_seconds", COUNTER, "Seconds spent in engine calls within steps",
           _stat("engine_time")),
    Family("draftsmith_scheduler_draft_length", COUNTER,
           "Row-steps by the draft length the step plan chose (0: the row did not draft)",
           lambda r: {(str(k),): n for k, n in r.draft_lengths.items()}, ("k",)),
    Family("draftsmith_scheduler_running", GAUGE, "Requests in the running batch", _stat("running")),
    Family("draftsmith_scheduler_waiting", GAUGE, "Requests waiting for a row", _stat("waiting")),
    Family("draftsmith_scheduler_mean_batch", GAUGE, "Mean rows per step", _stat("mean_batch")),
    Family("draftsmith_scheduler_mean_draft_length", GAUGE, "Mean draft length the step plan chose per row-step",
           _stat("mean_draft_length")),
    Family("vllm:num_requests_running", GAUGE, "Requests running (vLLM's name)", _queue("running"), ("model_name",)),
    Family("vllm:num_requests_waiting", GAUGE, "Requests waiting (vLLM's name)", _queue("waiting"), ("model_name",)),
)  # fmt: skip


# --- prometheus_client: the OpenAI server's /metrics -------------------------------------------------------------


def prometheus_text(reading: Reading) -> str:
    """Every family of the table in Prometheus' text format (served with ``CONTENT_TYPE``)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(reading))
    return generate_latest(registry).decode("utf-8")


class _Collector:
    """prometheus_client's collector protocol over one reading."""

    def __init__(self, reading: Reading) -> None:
        self.reading = reading

    def collect(self) -> list:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        out = []
        for family in FAMILIES:
            value = family.value(self.reading)
            if family.kind == HISTOGRAM:
                buckets = [(floatToGoString(bound), n) for bound, n in value.cumulative()]
                out.append(HistogramMetricFamily(family.name, family.help, buckets=buckets, sum_value=value.total))
                continue
            make = CounterMetricFamily if family.kind == COUNTER else GaugeMetricFamily
            if not family.labels:
                out.append(make(family.name, family.help, value=value))
                continue
            metric = make(family.name, family.help, labels=list(family.labels))
            for labels, number in value.items():
                metric.add_metric(list(labels), number)
            out.append(metric)
        return out


# --- Triton's metric API: the Triton model's /metrics ------------------------------------------------------------


class TritonMetrics:
    """The table through Triton's metric API: every family made once (here: the model's ``initialize``), a metric
    per label set made when it first has a value (the unlabelled ones at once), and ``update`` applying a reading
    (see the module docstring). ``pb_utils``: the Python backend's module (the runtime cannot import it); ``labels``:
    on every metric (Triton's ``model`` and ``version``). Thread-safe: the scheduler's thread and Triton's
    ``execute`` both update."""

    def __init__(self, pb_utils, labels: dict[str, str]) -> None:
        kinds = {
            COUNTER: pb_utils.MetricFamily.COUNTER,
            GAUGE: pb_utils.MetricFamily.GAUGE,
            HISTOGRAM: pb_utils.MetricFamily.HISTOGRAM,
        }
        self.labels = dict(labels)
        self.families = {
            f.name: pb_utils.MetricFamily(name=f.exported, description=f.help, kind=kinds[f.kind]) for f in FAMILIES
        }
        self.metrics: dict[tuple, Any] = {}  # (family name, label values) -> Triton's metric
        self.last: dict[tuple, Any] = {}  # (family name, label values) -> what it last exported
        self._lock = threading.Lock()
        for family in FAMILIES:
            if not family.labels:
                self._metric(family, ())

    def update(self, reading: Reading) -> None:
        """Export ``reading``: each counter incremented by what it grew since the last update, each gauge set, each
        histogram given the observations made since."""
        with self._lock:
            for family in FAMILIES:
                value = family.value(reading)
                if family.kind == HISTOGRAM:
                    self._observe(family, value)
                elif family.labels:
                    for labels, number in value.items():
                        self._apply(family, labels, number)
                else:
                    self._apply(family, (), value)

    def _metric(self, family: Family, labels: tuple):
        key = (family.name, labels)
        metric = self.metrics.get(key)
        if metric is None:
            named = {**self.labels, **dict(zip(family.labels, labels))}
            if family.kind == HISTOGRAM:
                bounds = family.value(_EMPTY).bounds
                metric = self.families[family.name].Metric(labels=named, buckets=list(bounds))
            else:
                metric = self.families[family.name].Metric(labels=named)
            self.metrics[key] = metric
        return metric

    def _apply(self, family: Family, labels: tuple, number: float) -> None:
        key, metric = (family.name, labels), self._metric(family, labels)  # made at its first value, 0 included
        if family.kind == GAUGE:
            if self.last.get(key) != number:
                metric.set(float(number))
                self.last[key] = number
            return
        grown = number - self.last.get(key, 0)
        if grown > 0:
            metric.increment(float(grown))
            self.last[key] = number

    def _observe(self, family: Family, histogram: LatencyHistogram) -> None:
        key = (family.name, ())
        seen, counts = self.last.get(key, (0, [0] * len(histogram.counts)))
        if histogram.observed == seen:
            return
        metric = self._metric(family, ())
        for seconds in replayed(histogram, seen, counts):
            metric.observe(seconds)
        self.last[key] = (histogram.observed, list(histogram.counts))


_EMPTY = Reading(MetricsRegistry().snapshot(), {}, {}, "")  # a histogram family's buckets, read before any count


def replayed(histogram: LatencyHistogram, seen: int, seen_counts: list[int]) -> list[float]:
    """The observations ``histogram`` had after its first ``seen`` (when its buckets held ``seen_counts``), oldest
    first: as they were where it still keeps them (``recent``), the older ones at their bucket's upper bound (the
    last bucket's: just above the last bound), so the bucket counts come out exact and the sum close."""
    new = histogram.observed - seen
    kept = list(itertools.islice(reversed(histogram.recent), new))[::-1]
    if len(kept) == new:
        return kept
    missing = [now - before for now, before in zip(histogram.counts, seen_counts)]
    for seconds in kept:
        missing[histogram.bucket(seconds)] -= 1
    edges = (*histogram.bounds, math.nextafter(histogram.bounds[-1], math.inf))
    return [edge for edge, n in zip(edges, missing) for _ in range(n)] + kept
