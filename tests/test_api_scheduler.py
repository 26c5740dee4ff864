"""One ``SpeculativeGenerator`` holds one scheduler for its life (runtime/api.py): every call's batch runs on it,
with the call's own policy and plan, the call costs measured once, and a batch that fails or is left midway
cleared from it, so the next call gets what it would get from a fresh generator."""

from __future__ import annotations

import pytest

from runtime.api import SpeculativeGenerator
from runtime.decoding.step_costs import CostModel

PROMPT = "def add(a, b):"


def _fresh(generator) -> SpeculativeGenerator:
    """A generator over the same engines with nothing measured or made yet."""
    return SpeculativeGenerator(None, generator.target, generator.draft, generator.tokenizer, generator.eos_ids)


def test_every_call_runs_on_the_one_scheduler_with_its_own_policy_and_plan(generator):
    fresh = _fresh(generator)
    scheduler = fresh.scheduler
    want = generator.generate(PROMPT, max_new_tokens=12, k=3).token_ids
    assert fresh.generate(PROMPT, max_new_tokens=12, k=3).token_ids == want
    batch = fresh.generate([PROMPT, "The quick brown", "x"], max_new_tokens=12, k=3, plan=False)
    assert batch[0].token_ids == want
    assert fresh.generate(PROMPT, max_new_tokens=12, k=2, policy="throughput").finish_reason in ("length", "stop")
    assert fresh.generate(PROMPT, max_new_tokens=12, k=3).token_ids == want
    assert fresh.scheduler is scheduler and not scheduler.busy and scheduler.cache.batch == 0
    assert scheduler.counters["admitted"] == scheduler.counters["finished"] == 6


def test_the_call_costs_are_measured_once(generator, monkeypatch):
    measured = []
    calibrate = CostModel.calibrate
    monkeypatch.setattr(CostModel, "calibrate", lambda self, *a, **k: measured.append(a[2]) or calibrate(self, *a, **k))
    fresh = _fresh(generator)
    for _ in range(3):
        fresh.generate(PROMPT, max_new_tokens=4, k=2)
    fresh.generate(PROMPT, max_new_tokens=4, k=2, plan=False)  # not planned: nothing measured
    assert measured == [1]


def test_a_stream_left_midway_leaves_the_scheduler_clean(generator):
    fresh = _fresh(generator)
    pieces = fresh.stream(PROMPT, max_new_tokens=40, k=2)
    next(pieces)
    pieces.close()
    scheduler = fresh.scheduler
    assert not scheduler.busy and scheduler.cache.batch == 0
    want = generator.generate(PROMPT, max_new_tokens=12).token_ids
    assert fresh.generate(PROMPT, max_new_tokens=12).token_ids == want


def test_a_batch_that_fails_is_cleared_and_the_next_runs(generator, monkeypatch):
    fresh = _fresh(generator)
    forward = fresh.target.forward
    broken = {"once": True}

    def flaky(*args, **kwargs):
        if broken.pop("once", False):
            raise RuntimeError("boom")
        return forward(*args, **kwargs)

    monkeypatch.setattr(fresh.target, "forward", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        fresh.generate(PROMPT, max_new_tokens=8)
    assert not fresh.scheduler.busy and fresh.scheduler.cache.batch == 0
    assert fresh.generate(PROMPT, max_new_tokens=8).token_ids == generator.generate(PROMPT, max_new_tokens=8).token_ids
