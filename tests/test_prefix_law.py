"""Speculative sampling follows the target's law exactly, on a target whose logits depend on the whole prefix and
the position (tests/prefix_fakes.py): for every drafter, with top-k and top-p, k = 3 with rejections at every
position, and with draft confidence. A loop bug that the bigram fake cannot see (a rolled-back token left live, a
position fed twice, a pending token dropped) changes these laws."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import LENGTH, copying_table, run_loop
from prefix_fakes import PrefixEngine, assert_follows_prefix_target, target_law
from runtime.drafters.hybrid import HybridDrafter
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.decoding.sampling import SamplingParams, probabilities
from runtime.decoding.config import DecodeConfig
from batch_run import BatchRun
from runtime.drafters.model import ModelDrafter
from runtime.drafters.suffix import SuffixDrafter

VOCAB = 5
N = 12000
PARAMS = [SamplingParams(1.0), SamplingParams(0.7, top_k=3), SamplingParams(1.3, top_p=0.8)]
IDS = ["T=1", "T=0.7,top_k=3", "T=1.3,top_p=0.8"]


def engines(vocab: int = VOCAB, bias=None):
    target = PrefixEngine(vocab, seed=1, scale=1.5, bias=bias)
    draft = PrefixEngine(vocab, seed=2, scale=0.9, base=target)  # agrees in part: accepts and rejects
    return target, draft


def model_law(draft: PrefixEngine, params):
    return lambda prefix, j: probabilities(draft.logits_after(prefix)[None], params)[0]


def point_mass_law(proposal: list[int], vocab: int):
    return lambda prefix, j: np.eye(vocab)[proposal[j]]


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_a_model_drafter_follows_a_prefix_dependent_target(params):
    target, draft = engines()
    context = [3, 1, 4]
    loop = BatchRun(target, ModelDrafter(draft), [context] * N, DecodeConfig(LENGTH, 3, params, seed=11))
    first = run_loop(loop)
    assert_follows_prefix_target(loop.rows, first, target_law(target, params), context, model_law(draft, params), 3)


def test_the_prefix_target_catches_a_loop_that_forgets_to_roll_back(monkeypatch):
    """The same test fails when the target's rejected draft tokens stay live (a rollback bug the bigram fake hides)."""
    target, draft = engines()
    monkeypatch.setattr(PrefixEngine, "rollback", lambda self, cache, keep: None)
    params, context = PARAMS[0], [3, 1, 4]
    loop = BatchRun(target, ModelDrafter(draft), [context] * N, DecodeConfig(LENGTH, 3, params, seed=11))
    first = run_loop(loop)
    with pytest.raises(AssertionError):
        assert_follows_prefix_target(loop.rows, first, target_law(target, params), context, model_law(draft, params), 3)


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_prompt_lookup_follows_a_prefix_dependent_target(params):
    vocab, path = 4, [0, 1, 2, 3, 0]
    target = PrefixEngine(vocab, seed=3, scale=0.8, bias=copying_table(vocab, 5, path, boost=2.5, scale=0.0))
    context = [0, 1, 2, 3, 0, 1, 2, 3, 0]  # lookup proposes "1 2 3"
    loop = BatchRun(target, PromptLookupDrafter(vocab), [context] * N, DecodeConfig(LENGTH, 3, params, seed=1))
    first = run_loop(loop)
    assert_follows_prefix_target(
        loop.rows, first, target_law(target, params), context, point_mass_law([1, 2, 3], vocab), 3
    )


@pytest.mark.parametrize("params", PARAMS[1:], ids=IDS[1:])
def test_suffix_drafting_follows_a_prefix_dependent_target(params):
    vocab = 4
    target = PrefixEngine(vocab, seed=4, scale=0.8, bias=copying_table(vocab, 5, [0, 1, 3, 2], boost=2.5, scale=0.0))
    context = [2, 0, 1, 3, 2, 0, 1, 3, 2, 0, 1, 2, 2, 0]  # the majority continuation of "0" is "1 3 2"
    loop = BatchRun(target, SuffixDrafter(vocab), [context] * N, DecodeConfig(LENGTH, 3, params, seed=3))
    first = run_loop(loop)
    assert_follows_prefix_target(
        loop.rows, first, target_law(target, params), context, point_mass_law([1, 3, 2], vocab), 3
    )


@pytest.mark.parametrize("params", PARAMS[1:], ids=IDS[1:])
def test_the_hybrid_drafter_follows_a_prefix_dependent_target_from_both_sources(params):
    vocab, path = 4, [0, 1, 2, 3, 0]
    target = PrefixEngine(vocab, seed=3, scale=0.8, bias=copying_table(vocab, 5, path, boost=2.5, scale=0.0))
    draft = PrefixEngine(vocab, seed=9, scale=0.9, base=target)
    repetitive, fresh = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1], [3]
    drafter = HybridDrafter(ModelDrafter(draft), vocab)
    loop = BatchRun(target, drafter, [repetitive] * N + [fresh] * N, DecodeConfig(LENGTH, 3, params, seed=2))
    looked_up, modelled = run_loop(loop, groups=2)
    law = target_law(target, params)
    assert_follows_prefix_target(loop.rows[:N], looked_up, law, repetitive, point_mass_law([2, 3, 0], vocab), 3)
    assert_follows_prefix_target(loop.rows[N:], modelled, law, fresh, model_law(draft, params), 3)


def test_draft_confidence_keeps_the_law_exact():
    """A row stops drafting where the draft's top probability falls under the confidence: the law stays the
    target's, and the first step drafts fewer tokens than k in some rows (a varying draft length is exercised)."""
    target, draft = engines()
    params, context = SamplingParams(1.0), [3, 1, 4]
    loop = BatchRun(
        target, ModelDrafter(draft, confidence=0.45), [context] * N, DecodeConfig(LENGTH, 3, params, seed=13)
    )
    first = run_loop(loop)
    from prefix_fakes import exact_joint, observed_joint, total_variation, tv_bound

    law = target_law(target, params)
    exact, observed = exact_joint(law, context, VOCAB), observed_joint(loop.rows, VOCAB)
    assert total_variation(observed, exact) < tv_bound(exact, N)
    assert first.drafted[0] == N and 0 < first.drafted[1] < N  # some rows stopped after one draft token
