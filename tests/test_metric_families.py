"""The one table of metric families (runtime/metric_families.py) and its two renderings: the OpenAI server's
prometheus_client text and the Triton model's metric API give the same samples from the same reading.

Triton's side runs here through a fake ``triton_python_backend_utils`` that behaves as the 2.51 backend does where it
matters: a counter refuses a negative increment, a histogram metric needs its buckets (and only a histogram takes
them), labels are strings. The real server's /metrics is tests/test_triton_server.py's.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fakes import BigramEngine, random_table
from metric_readers import prometheus_samples, table_names, type_lines
from runtime.metric_families import COUNTER, FAMILIES, GAUGE, HISTOGRAM, Reading, TritonMetrics, prometheus_text, read
from runtime.api import SpeculativeGenerator
from runtime.errors import RequestError
from runtime.metrics import RECENT, MetricsRegistry, RequestStats
from runtime.core.handles import Overloaded, Unavailable

ROOT = Path(__file__).resolve().parents[1]


# --- a fake Triton Python backend ----------------------------------------------------------------------------------


class FakeMetric:
    def __init__(self, family: "FakeFamily", labels: dict, buckets: list | None):
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
        if (family.kind == FakeFamily.HISTOGRAM) != (buckets is not None):
            raise ValueError("Failed to create metric. Missing required buckets / Unexpected buckets found.")
        self.family, self.labels, self.buckets = family, labels, buckets
        self.value, self.observed = 0.0, []

    def increment(self, value: float) -> None:
        assert self.family.kind == FakeFamily.COUNTER
        if value < 0:
            raise ValueError("TRITONSERVER_METRIC_KIND_COUNTER can only be incremented monotonically")
        self.value += value

    def set(self, value: float) -> None:
        assert self.family.kind == FakeFamily.GAUGE
        self.value = value

    def observe(self, value: float) -> None:
        assert self.family.kind == FakeFamily.HISTOGRAM
        self.observed.append(value)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"

    def __init__(self, name: str, description: str, kind: str, made: list):
        assert "\n" not in description
        self.name, self.description, self.kind, self.metrics = name, description, kind, []
        made.append(self)

    def Metric(self, labels: dict, buckets: list | None = None) -> FakeMetric:  # noqa: N802 - Triton's name
        metric = FakeMetric(self, labels, buckets)
        self.metrics.append(metric)
        return metric


def fake_pb_utils() -> types.ModuleType:
    """The parts of triton_python_backend_utils the metrics and the model use; ``made``: every family made."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.made = []

    class MetricFamily(FakeFamily):
        def __init__(self, name, description, kind):
            super().__init__(name, description, kind, pb.made)

    class TritonError(Exception):
        CANCELLED, UNAVAILABLE = "CANCELLED", "UNAVAILABLE"

        def __init__(self, message, code=None):
            super().__init__(message)
            self.code = code

        def message(self):
            return str(self)

    pb.MetricFamily = MetricFamily
    pb.TritonError = TritonError
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.Tensor = lambda name, array: SimpleNamespace(name=name, array=array)
    pb.InferenceResponse = lambda output_tensors, error=None: SimpleNamespace(outputs=output_tensors, error=error)
    pb.get_input_tensor_by_name = lambda request, name: request.get(name)
    pb.Logger = SimpleNamespace(log_error=lambda message: None, log_info=lambda message: None)
    return pb


def triton_samples(made: list, own: tuple = ("model", "version")) -> dict:
    """{(sample name, labels without Triton's own): value} of the fake families, named as Prometheus' text names
    them (a histogram's _bucket, _count and _sum)."""
    from prometheus_client.utils import floatToGoString

    out = {}
    for family in made:
        for metric in family.metrics:
            labels = tuple(sorted((k, v) for k, v in metric.labels.items() if k not in own))
            if family.kind != FakeFamily.HISTOGRAM:
                out[(family.name, labels)] = metric.value
                continue
            for bound in [*metric.buckets, float("inf")]:
                le = labels + (("le", floatToGoString(bound)),)
                out[(f"{family.name}_bucket", tuple(sorted(le)))] = sum(v <= bound for v in metric.observed)
            out[(f"{family.name}_count", labels)] = len(metric.observed)
            out[(f"{family.name}_sum", labels)] = sum(metric.observed)
    return out


# --- a registry and a scheduler with something in them ---------------------------------------------------------------


class _Scheduler:
    """A running scheduler's view as the table reads it (runtime/core/scheduler.py: stats(), draft_lengths)."""

    def __init__(self, keys):
        self.counters = dict.fromkeys(keys, 0)
        self.draft_lengths = collections.Counter()

    def stats(self) -> dict:
        return dict(self.counters)


def _scheduler_keys() -> set[str]:
    """The keys a real Scheduler's stats() has (over scripted engines)."""
    from runtime.api import SpeculativeGenerator
    from runtime.core.scheduler import Scheduler

    table = random_table(7, 1)
    generator = SpeculativeGenerator(None, BigramEngine(table), BigramEngine(table), tokenizer=None, eos_ids=())
    return set(Scheduler(generator, max_batch=2, reserve=False).stats())


def _served(registry: MetricsRegistry, scheduler: _Scheduler, rng: np.random.Generator) -> None:
    """Some traffic: finished sequences (drafted to several positions, two drafters), target calls, refusals, the
    scheduler's counters and gauges."""
    for i in range(int(rng.integers(1, 4))):
        stats = RequestStats()
        for _ in range(int(rng.integers(1, 6))):
            drafted = int(rng.integers(0, 5))
            stats.record_step(drafted, int(rng.integers(0, drafted + 1)), 1 + drafted, fallback=False)
        stats.time_to_first_token, stats.total_time = float(rng.uniform(0, 2)), float(rng.uniform(2, 4))
        registry.add(stats, ("model", "string")[i % 2])
        registry.count_call(SimpleNamespace(kind="forward", rows=3))
        registry.count_call(SimpleNamespace(kind="prefill_rows", rows=2))
    registry.count_refusal()
    for key in scheduler.counters:
        scheduler.counters[key] += int(rng.integers(0, 3))
    scheduler.counters["running"] = int(rng.integers(0, 4))  # a gauge: it goes down too
    scheduler.draft_lengths[int(rng.integers(0, 4))] += 1


# --- tests ------------------------------------------------------------------------------------------------------


def test_the_table_is_one_set_of_well_formed_families():
    names = [f.exported for f in FAMILIES]
    assert len(names) == len(set(names))
    for family in FAMILIES:
        assert family.kind in (COUNTER, GAUGE, HISTOGRAM)
        assert not family.name.endswith("_total")  # a rendering adds it to a counter
        assert family.help and "\n" not in family.help and "\\" not in family.help  # Triton writes it unescaped
        assert family.kind != HISTOGRAM or not family.labels  # both renderings export a histogram unlabelled
        assert not {"model", "version", "le"} & set(family.labels)  # Triton's own labels, and a histogram's
    # what the Triton model exported under other names before: one name each now
    for gone in ("draftsmith_sequence_steps_total", "draftsmith_requests_cancelled_total", "draftsmith_running"):
        assert gone not in names


def test_every_scheduler_family_reads_a_key_the_scheduler_has():
    """A family reading a key stats() does not have would export 0 forever: each one read is a real key."""
    asked = set()

    class Recording(dict):
        def get(self, key, default=None):
            asked.add(key)
            return 1

    reading = Reading(MetricsRegistry().snapshot(), Recording(), {}, "m")
    for family in FAMILIES:
        family.value(reading)
    assert asked and asked <= _scheduler_keys()
    assert {"refused", "failed", "cancelled", "running", "waiting", "mean_draft_length"} <= asked


def test_both_renderings_give_the_same_samples_from_one_reading():
    """The OpenAI server's text and Triton's metrics, updated after each round of traffic (Triton's counters only
    grow by what changed; its histograms replay the new observations), carry the same samples."""
    registry, scheduler, rng = MetricsRegistry(), _Scheduler(_scheduler_keys()), np.random.default_rng(3)
    pb = fake_pb_utils()
    triton = TritonMetrics(pb, {"model": "speculative", "version": "1"})
    for _ in range(4):
        _served(registry, scheduler, rng)
        reading = read(registry, scheduler, "speculative")
        triton.update(reading)
        triton.update(reading)  # nothing changed: nothing counted twice
        text = prometheus_text(reading)
        want = prometheus_samples(text)
        got = triton_samples(pb.made)
        assert set(got) == set(want)
        assert got == pytest.approx(want)
    assert {f.name: f.kind.lower() for f in pb.made} == table_names() == type_lines(text)
    assert want[("draftsmith_request_errors_total", ())] == registry.refused + sum(
        scheduler.counters[k] for k in ("refused", "failed")
    )
    assert want[("draftsmith_target_calls_total", ())] == registry.target_calls > 0
    assert want[("vllm:num_requests_running", (("model_name", "speculative"),))] == scheduler.counters["running"]


def test_a_histogram_past_what_it_keeps_still_counts_every_observation():
    """More observations between two updates than a histogram keeps as they were: Triton's buckets still hold
    every one where it fell."""
    registry, pb = MetricsRegistry(), fake_pb_utils()
    triton = TritonMetrics(pb, {"model": "m", "version": "1"})
    for seconds in np.random.default_rng(5).uniform(0, 40, RECENT + 40):
        registry.add(RequestStats(num_emitted_tokens=1, time_to_first_token=float(seconds), total_time=40.0))
    reading = read(registry)
    triton.update(reading)
    got, want = triton_samples(pb.made), prometheus_samples(prometheus_text(reading))
    buckets = {k: v for k, v in want.items() if k[0].startswith("draftsmith_time_to_first_token_seconds_bucket")}
    assert buckets and {k: got[k] for k in buckets} == buckets
    assert got[("draftsmith_time_to_first_token_seconds_count", ())] == RECENT + 40


# --- the servers ----------------------------------------------------------------------------------------------------


def _load_triton_model():
    """triton_repo/models/speculative.py as Triton loads it: one file (its backend module faked by the caller)."""
    spec = importlib.util.spec_from_file_location("speculative_model", ROOT / "triton_repo/models/speculative.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _triton_request(prompt, max_tokens=8) -> dict:
    tensor = SimpleNamespace  # as_numpy() of a [1, 1] tensor
    return {
        "text_input": tensor(as_numpy=lambda: np.array([[prompt.encode()]], dtype=object)),
        "request_output_len": tensor(as_numpy=lambda: np.array([[max_tokens]], dtype=np.int32)),
    }


def _triton_model(bundle, pb, monkeypatch):
    """The Triton model over ``bundle`` (not decoupled), initialized through the fake backend ``pb``."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    module = _load_triton_model()
    parameters = dict(
        bundle=str(bundle), threads="1", max_tokens_limit="64", max_prompt_bytes="4096", max_stop_words="4",
        max_stop_word_bytes="64", policy="exact", max_batch="2", max_queue="8", plan="false",
    )  # fmt: skip
    config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_name": "speculative", "model_version": "1"})
    return model


def test_the_triton_model_exports_the_table_and_what_it_counts(tiny_bundle, monkeypatch):
    """The Triton model (through the fake backend, not decoupled): it declares exactly the table's families, and
    after a served request and a refused one its metrics are the OpenAI rendering's of the same reading."""
    pb = fake_pb_utils()
    model = _triton_model(tiny_bundle, pb, monkeypatch)
    try:
        assert {f.name: f.kind.lower() for f in pb.made} == table_names()
        (refused,) = model.execute([_triton_request("hi", 0)])  # refused alone: exported at its refusal
        assert refused.error is not None and "max_tokens" in str(refused.error)
        assert triton_samples(pb.made)[("draftsmith_request_errors_total", ())] == 1
        served, refused = model.execute([_triton_request("The quick brown fox"), _triton_request("hi", 10**6)])
        assert served.error is None and refused.error is not None and "max_tokens" in str(refused.error)
        reading = read(model.bundle.metrics, model.scheduler, "speculative")
        want = prometheus_samples(prometheus_text(reading))
        got = triton_samples(pb.made)
        assert set(got) <= set(want)  # Triton's labelled families appear with their first value
        assert got == pytest.approx({k: want[k] for k in got})
        assert got[("draftsmith_requests_total", ())] == 1
        assert got[("draftsmith_request_errors_total", ())] == 2  # the front door's refusals
        assert got[("draftsmith_target_calls_total", ())] >= 2  # its prefill and at least one step
        assert got[("draftsmith_scheduler_finished_total", ())] == 1
    finally:
        model.finalize()


def test_the_triton_model_refuses_a_full_queue_before_any_work(tiny_bundle, monkeypatch):
    """The Triton model's door asks the scheduler's room, as the OpenAI server's does: with the queue full a good
    request is refused before it is tokenized, with the code Triton's own full queue answers with (UNAVAILABLE),
    and counted as the scheduler's refusal; a bad request is still refused for what it is, and once there is room
    again a request is served."""
    pb = fake_pb_utils()
    model = _triton_model(tiny_bundle, pb, monkeypatch)
    try:
        tokenizer, encoded = model.bundle.tokenizer, []
        real = tokenizer.encode
        monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: encoded.append(a) or real(*a, **k))
        model.scheduler.max_queue = 0  # full: no request may wait
        (full,) = model.execute([_triton_request("The quick brown fox")])
        assert full.error.code == pb.TritonError.UNAVAILABLE and str(full.error).startswith("overloaded")
        assert not encoded  # refused before its tokenizing
        assert triton_samples(pb.made)[("draftsmith_scheduler_refused_total", ())] == 1
        (bad,) = model.execute([_triton_request("hi", 0)])
        assert "max_tokens" in str(bad.error) and bad.error.code is None
        model.scheduler.max_queue = 8
        (served,) = model.execute([_triton_request("The quick brown fox")])
        assert served.error is None and encoded
    finally:
        model.finalize()


def test_every_request_the_scheduler_fails_is_a_request_error():
    """A request that fails after the front door (here: the scheduler stops while it waits) is counted where it
    fails, so both servers export it alike."""
    from runtime.api import SpeculativeGenerator
    from runtime.core.request import Asked, decode_request
    from runtime.core.scheduler import Scheduler

    table = random_table(7, 1)
    generator = SpeculativeGenerator(None, BigramEngine(table), BigramEngine(table), tokenizer=None, eos_ids=())
    scheduler = Scheduler(generator, max_batch=2, reserve=False)
    admitted = generator.door.admit(Asked.tokenized([[1, 2, 3]], decode_request(max_new_tokens=4)))
    handles = scheduler.enqueue(admitted) + scheduler.enqueue(admitted)
    scheduler.stop()
    assert all(h.ready()[0].error is not None for h in handles)
    samples = prometheus_samples(prometheus_text(read(generator.metrics, scheduler, "m")))
    assert samples[("draftsmith_scheduler_failed_total", ())] == 2
    assert samples[("draftsmith_request_errors_total", ())] == 2


RUNTIME_FAILURE = (
    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running MatMul node. "
    "Name:'/model/layers.0/MatMul' in /home/ops/bundles/qwen/target/model.onnx"
)


def _triton_message(error, monkeypatch) -> tuple[str, list[str]]:
    """(what the Triton model tells a client for ``error``, what it logged)."""
    pb = fake_pb_utils()
    logged = []
    pb.Logger = SimpleNamespace(log_error=logged.append, log_info=logged.append)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    return _load_triton_model()._message(error), logged


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(RUNTIME_FAILURE),
        Unavailable(f"decoding this request failed: {RuntimeError(RUNTIME_FAILURE)!r}"),  # the scheduler's wrapping
        KeyError("/home/ops/bundles/qwen/manifest.json"),
        MemoryError(),
    ],
)
def test_the_triton_model_answers_its_own_failures_generically_and_logs_them(error, monkeypatch):
    """An error this model did not raise for the client (an engine's, the scheduler's wrapping of one) is logged with
    its details and answered with a generic message, as the OpenAI server's 500: no node names, no paths."""
    message, logged = _triton_message(error, monkeypatch)
    assert message == "the server failed while decoding this request; retry later"
    assert len(logged) == 1 and type(error).__name__ in logged[0] and str(error) in logged[0]


@pytest.mark.parametrize("kind", ["RequestInvalid", "RequestError", "Overloaded"])
def test_the_triton_model_tells_clients_what_is_wrong_with_their_request(kind, monkeypatch):
    said = "input 'max_tokens': expected an integer in [1, 64], received 0"
    pb = fake_pb_utils()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    module = _load_triton_model()
    error = {"RequestInvalid": module.RequestInvalid, "RequestError": RequestError, "Overloaded": Overloaded}[kind]
    assert module._message(error(said)) == said


def test_the_triton_model_says_when_it_is_stopping(monkeypatch):
    message, logged = _triton_message(Unavailable("the scheduler is stopping"), monkeypatch)
    assert message == "the server is shutting down; retry on another" and not logged


def test_metrics_definitions_and_prometheus_export():
    table = random_table(7, 1)
    gen = SpeculativeGenerator(None, BigramEngine(table), BigramEngine(table), tokenizer=_IdTokenizer(), eos_ids=())
    result = gen.generate("ab", max_new_tokens=11, k=4, plan=False)  # k every step: the definitions' counts
    s = result.stats
    assert s.num_emitted_tokens == 11
    assert s.draft_acceptance_rate == s.num_accepted_tokens / s.num_draft_tokens == 1.0
    assert s.mean_acceptance_length == 1 + s.num_accepted_tokens / s.num_drafts
    assert s.system_efficiency == pytest.approx(11 / s.verify_slots)
    assert s.acceptance_per_position[:4] == [1.0, 1.0, 1.0, 1.0]
    from prometheus_client.parser import text_string_to_metric_families

    text = gen.metrics_text()
    samples = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for family in text_string_to_metric_families(text)
        for x in family.samples
    }
    assert samples[("draftsmith_accepted_tokens_total", ())] == s.num_accepted_tokens
    assert samples[("draftsmith_requests_total", ())] == 1
    assert samples[("draftsmith_acceptance_by_position", (("position", "1"),))] == 1.0
    # vLLM's spec-decode counters carry the same counts under vLLM's names
    assert samples[("vllm:spec_decode_num_drafts_total", ())] == s.num_drafts
    assert samples[("vllm:spec_decode_num_draft_tokens_total", ())] == s.num_draft_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", ())] == s.num_accepted_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] == s.num_drafts
    # one request: one TTFT and one inter-token latency observation, (total - TTFT) / (tokens - 1)
    assert samples[("draftsmith_time_to_first_token_seconds_count", ())] == 1
    assert samples[("draftsmith_time_to_first_token_seconds_sum", ())] == pytest.approx(s.time_to_first_token)
    assert samples[("draftsmith_inter_token_latency_seconds_count", ())] == 1
    assert samples[("draftsmith_inter_token_latency_seconds_sum", ())] == pytest.approx(
        (s.total_time - s.time_to_first_token) / (s.num_emitted_tokens - 1)
    )


def test_metrics_registries_count_apart():
    """Each bundle has its own MetricsRegistry: two generators in one process never share counts (nor clash on
    names)."""
    from runtime.metric_families import prometheus_text, read
    from runtime.metrics import MetricsRegistry, RequestStats

    one, two = MetricsRegistry(), MetricsRegistry()
    one.add(RequestStats(num_emitted_tokens=1, time_to_first_token=0.2, total_time=0.2))

    def text(registry):
        return prometheus_text(read(registry))

    assert "draftsmith_requests_total 1.0" in text(one)
    assert "draftsmith_requests_total 0.0" in text(two)
    assert 'draftsmith_time_to_first_token_seconds_bucket{le="0.25"} 1.0' in text(one)
    assert 'draftsmith_time_to_first_token_seconds_bucket{le="0.1"} 0.0' in text(one)
    assert "draftsmith_inter_token_latency_seconds_count 0.0" in text(one)  # one token: no inter-token gap
    one.fallback_active = True
    assert "draftsmith_fallback_active 1.0" in text(one)


def test_decoding_never_imports_prometheus_client():
    """Triton's Python backend runs the runtime but cannot import prometheus_client (its ssl import fails in the
    stub's interpreter): only an export imports it."""
    code = (
        "import sys\nfrom runtime.metrics import MetricsRegistry, RequestStats\nimport runtime.api\n"
        "from runtime.metric_families import TritonMetrics, prometheus_text, read\n"
        "m = MetricsRegistry()\nm.add(RequestStats(num_emitted_tokens=3, total_time=1.0))\n"
        "assert 'prometheus_client' not in sys.modules\nprometheus_text(read(m))\n"
        "assert 'prometheus_client' in sys.modules\n"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})


class _IdTokenizer:
    """Characters 'a'.. map to ids 0..; enough for the metrics test over a bigram engine."""

    vocab_size = 7

    def encode(self, text):
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)

    def apply_chat_template(self, prompt):
        return prompt
