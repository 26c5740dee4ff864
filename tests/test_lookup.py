"""Prompt-lookup drafting: table cases, exactness under sampling, greedy equivalence."""

from __future__ import annotations

import pytest

from fakes import LENGTH, BigramEngine, assert_follows_target, copying_table, point_mass_laws, random_table, run_loop
from runtime.errors import RequestError
from runtime.drafters.lookup import PromptLookupDrafter, lookup
from runtime.decoding.sampling import SamplingParams, probabilities
from runtime.decoding.config import DecodeConfig
from batch_run import BatchRun
from conftest import EVAL_TOKENS


@pytest.mark.parametrize(
    "history, k, expected",
    [
        ([1, 2, 3, 4, 1, 2], 2, [3, 4]),  # match found: what followed "1 2"
        ([1, 2, 3, 4, 5, 6], 3, []),  # no earlier occurrence of the suffix
        ([7, 1, 8, 1, 9, 1], 2, [9, 1]),  # several candidates for "1": the latest (before 9) wins, not the one before 8
        ([5, 6, 5, 6, 5, 6], 4, [5, 6]),  # match at the end of the text: the continuation runs into the suffix itself
        ([1, 2, 9, 3, 2], 2, [9, 3]),  # the longest n-gram fails ("3 2"), a shorter one ("2") matches
        ([4, 4, 4], 0, []),  # k = 0: nothing
        ([3], 2, []),  # too short to match anything
    ],
)
def test_lookup_table(history, k, expected):
    assert lookup(history, k) == expected


def test_longer_ngram_takes_precedence():
    # "2" alone last appeared before 5, but "1 2" appeared before 3
    assert lookup([1, 2, 3, 0, 2, 5, 1, 2], 1) == [3]


def test_lookup_sampling_follows_the_target_distribution():
    """Point-mass proposals keep rejection sampling exact: 20,000 sequences of 4 tokens, the first step drafting 3."""
    vocab, table = 4, copying_table(4, 5, [0, 1, 2, 3, 0])
    params = SamplingParams(1.0)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0]  # repetitive: lookup always proposes, first "1 2 3"
    n = 20000
    loop = BatchRun(
        BigramEngine(table), PromptLookupDrafter(vocab), [prompt] * n, DecodeConfig(LENGTH, 3, params, seed=1)
    )
    first = run_loop(loop)
    assert_follows_target(loop.rows, first, probabilities(table, params), 0, point_mass_laws([1, 2, 3], vocab))


def test_prompt_lookup_greedy_equals_target_only(generator):
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    spec = generator.generate(prompt, max_new_tokens=30, drafter="prompt_lookup", k=4, plan=False)
    plain = generator.generate(prompt, max_new_tokens=30, mode="target")
    assert spec.token_ids == plain.token_ids
    assert spec.stats.num_draft_tokens > 0


def test_hybrid_sampling_follows_the_target_distribution_from_both_sources():
    """Rows with a 2-gram match draft by lookup (point mass), the others with the draft model (its own q); sampling
    stays exact for both kinds of rows (20,000 sequences of 4 tokens of each kind, the first step drafting 3)."""
    from runtime.drafters.hybrid import HybridDrafter
    from runtime.drafters.model import ModelDrafter

    vocab, table, draft_table = 4, copying_table(4, 5, [0, 1, 2, 3, 0]), random_table(4, 9)
    params = SamplingParams(1.0)
    repetitive, fresh = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1], [3]  # the first always matches "0 1"; the second cannot
    n = 20000
    drafter = HybridDrafter(ModelDrafter(BigramEngine(draft_table)), vocab)
    loop = BatchRun(
        BigramEngine(table), drafter, [repetitive] * n + [fresh] * n, DecodeConfig(LENGTH, 3, params, seed=2)
    )
    looked_up, modelled = run_loop(loop, groups=2)
    probs = probabilities(table, params)
    assert_follows_target(loop.rows[:n], looked_up, probs, 1, point_mass_laws([2, 3, 0], vocab))
    assert_follows_target(loop.rows[n:], modelled, probs, 3, [probabilities(draft_table, params)] * 3)
    assert n <= drafter.looked_up < drafter.proposed  # lookup for the repetitive rows, the model for the rest
    assert drafter.model.calls > 0


def test_hybrid_greedy_equals_target_only(generator):
    for prompt in ("def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "The quick brown fox"):
        spec = generator.generate(prompt, max_new_tokens=30, drafter="hybrid", k=4, plan=False)
        plain = generator.generate(prompt, max_new_tokens=30, mode="target")
        assert spec.token_ids == plain.token_ids
        assert spec.stats.num_draft_tokens > 0


def test_the_bundle_names_its_default_drafter(tiny_pair, tmp_path):
    from builder.build import build
    from runtime.api import SpeculativeGenerator
    from runtime.bundle import BuildSpec, SpecError
    from runtime.drafters.hybrid import HybridDrafter
    from runtime.drafters.model import ModelDrafter

    target, draft = tiny_pair
    build(
        BuildSpec(
            target=str(target),
            draft=str(draft),
            target_quant="fp32",
            draft_quant="fp32",
            k=3,
            max_context=128,
            drafter="hybrid",
            draft_confidence=0.6,
            eval_tokens=EVAL_TOKENS,
        ),
        tmp_path / "b",
    )
    generator = SpeculativeGenerator.from_bundle(tmp_path / "b", threads=1)
    assert generator.default_drafter == "hybrid"
    assert isinstance(generator.new_drafter("speculative", None, None), HybridDrafter)
    assert generator.new_drafter("speculative", None, None).model.confidence == 0.6  # the bundle's confidence
    model = generator.new_drafter("speculative", "model", 0.0)  # a request may override both
    assert isinstance(model, ModelDrafter) and model.confidence == 0.0
    with pytest.raises(RequestError, match="draft_confidence"):
        generator.generate("hello", draft_confidence=1.5)
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    assert (
        generator.generate(prompt, max_new_tokens=20).token_ids
        == generator.generate(prompt, max_new_tokens=20, mode="target").token_ids
    )
    with pytest.raises(SpecError, match="drafter"):
        BuildSpec(target="t", drafter="ngram")
    with pytest.raises(SpecError, match="draft_confidence"):
        BuildSpec(target="t", draft_confidence=1.0)
