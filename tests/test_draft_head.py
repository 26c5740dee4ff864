"""A reduced-vocabulary draft head maps back to the full vocabulary exactly: q is 0 outside the kept ids, sampling
through it still follows the target's distribution, greedy output equals target-only, and a bundle carries it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from fakes import BigramEngine, DraftCounts, pair_frequencies, random_table
from runtime.engines.mapped import MappedVocabEngine
from runtime.decoding.sampling import SamplingParams, probabilities
from runtime.decoding.config import DecodeConfig
from batch_run import BatchRun
from conftest import EVAL_TOKENS
from runtime.drafters.model import ModelDrafter
from test_sampling import CASES, VOCAB, exact_pairs, total_variation

KEPT = np.array([0, 2, 3])  # tokens 1 and 4 are outside the draft's head


def reduced_draft(seed: int = 2, kept=KEPT, vocab: int = VOCAB) -> MappedVocabEngine:
    """A bigram draft whose head has one column per kept id (it still reads every token id as input)."""
    return MappedVocabEngine(BigramEngine(random_table(vocab, seed)[:, kept]), kept, vocab)


def test_logits_map_back_with_minus_infinity_elsewhere():
    table = random_table(VOCAB, 2)
    engine = reduced_draft()
    tokens = np.array([[0, 1, 4], [3, 2, 2]])
    full = engine.forward(engine.new_cache(2), tokens)
    assert full.shape == (2, 3, VOCAB)
    assert np.array_equal(full[..., KEPT], table[tokens][..., KEPT])
    assert np.all(full[..., [1, 4]] == -np.inf)
    q = probabilities(full, SamplingParams(1.0))
    assert np.all(q[..., [1, 4]] == 0.0) and np.allclose(q.sum(-1), 1.0)


@pytest.mark.parametrize("kept", [[], [0, 0, 1], [-1, 2], [1, 5]])
def test_bad_vocabulary_maps_are_refused(kept):
    with pytest.raises(ValueError):
        MappedVocabEngine(BigramEngine(np.zeros((VOCAB, 2))), kept, VOCAB)


def test_a_head_of_the_wrong_width_is_refused():
    engine = MappedVocabEngine(BigramEngine(np.zeros((VOCAB, 2))), [0, 1, 2], VOCAB)
    with pytest.raises(ValueError, match="logits"):
        engine.forward(engine.new_cache(1), np.array([[0]]))


def sample_pairs_reduced(target_table, params, n: int, k: int, seed: int) -> np.ndarray:
    """First-two-token frequencies; 3 new tokens so a first step at k=2 drafts two (at 2 it could draft one)."""
    loop = BatchRun(
        BigramEngine(target_table), ModelDrafter(reduced_draft()), [[0]] * n, DecodeConfig(3, k, params, seed=seed)
    )
    for _ in loop.run():
        pass
    counts = DraftCounts.of(loop.rows)
    assert k < 2 or counts.multi_token_steps_decided_both_ways()  # two-token drafts, accepted and rejected
    return pair_frequencies(loop.rows, VOCAB)


@pytest.mark.parametrize("params", CASES[:2], ids=["T=1", "T=0.7,top_k=3"])
def test_sampling_through_a_reduced_head_follows_the_target_distribution(params):
    target_table = random_table(VOCAB, 1)
    exact = exact_pairs(target_table, 0, params)
    observed = sample_pairs_reduced(target_table, params, n=20000, k=2, seed=7)
    assert total_variation(observed.sum(1), exact.sum(1)) < 0.02
    assert total_variation(observed, exact) < 0.03
    # the tokens the draft can never propose still come out as often as the target says (via the residual)
    outside = exact[[1, 4]].sum() + exact[:, [1, 4]].sum() - exact[np.ix_([1, 4], [1, 4])].sum()
    assert outside > 0.2
    seen = observed[[1, 4]].sum() + observed[:, [1, 4]].sum() - observed[np.ix_([1, 4], [1, 4])].sum()
    assert abs(seen - outside) < 0.02
    # and the draft really differs: a sampler that followed it would be far off
    draft_full = np.full((VOCAB, VOCAB), -np.inf)
    draft_full[:, KEPT] = random_table(VOCAB, 2)[:, KEPT]
    assert total_variation(exact_pairs(draft_full, 0, params), exact) > 0.15


def test_greedy_output_with_a_reduced_head_equals_target_only():
    vocab, kept = 12, np.array([0, 1, 2, 3, 5, 8, 9])
    target_table = random_table(vocab, 3)
    draft_table = target_table + np.random.default_rng(4).normal(0, 0.3, target_table.shape)  # mostly agrees
    prompts = [[t] for t in range(vocab)] + [[4, 7, 11], [6, 10]]
    config = DecodeConfig(24, 4)

    def run(drafter):
        loop = BatchRun(BigramEngine(target_table), drafter, prompts, config)
        for _ in loop.run():
            pass
        return [row.generated for row in loop.rows], sum(r.stats.num_accepted_tokens for r in loop.rows)

    alone, _ = run(None)
    drafter = ModelDrafter(MappedVocabEngine(BigramEngine(draft_table[:, kept]), kept, vocab))
    speculative, accepted = run(drafter)
    assert speculative == alone
    assert accepted > 0  # the draft did contribute
    assert any(t not in kept for out in alone for t in out)  # and the target went outside the kept ids


def test_a_reduced_head_draft_builds_and_decodes_like_the_target(tiny_pair, tmp_path):
    """Build a bundle from a draft folder with draft_vocab.json: the exported draft head has only the kept rows, the
    manifest names the map, and greedy speculative output equals target-only."""
    from builder.build import build
    from runtime.api import SpeculativeGenerator
    from runtime.bundle import BuildSpec

    target, draft = tiny_pair
    reduced = tmp_path / "draft"
    shutil.copytree(draft, reduced)
    kept = list(range(0, 320, 2))[:150] + [2]  # a stand-in for the most frequent ids; EOS (2) kept
    (reduced / "draft_vocab.json").write_text(json.dumps({"kept_ids": sorted(set(kept))}), encoding="utf-8")
    manifest = build(
        BuildSpec(
            target=str(target),
            draft=str(reduced),
            target_quant="fp32",
            draft_quant="fp32",
            k=3,
            max_context=128,
            eval_tokens=EVAL_TOKENS,
        ),
        tmp_path / "bundle",
    )
    assert manifest.draft.vocab_map == "draft/draft_vocab.json" and manifest.draft.vocab_size == 150
    assert manifest.target.vocab_size == 320 and not manifest.target.vocab_map
    assert manifest.report["draft_vocab"]["kept_ids"] == 150
    from click.testing import CliRunner

    from builder.cli import main as build_engines

    shown = CliRunner().invoke(build_engines, ["inspect", str(tmp_path / "bundle")])
    assert shown.exit_code == 0 and "n/a" in shown.output, shown.output  # no perplexity over a reduced head
    generator = SpeculativeGenerator.from_bundle(tmp_path / "bundle", threads=1)
    assert isinstance(generator.draft, MappedVocabEngine)
    for prompt in ("The quick brown fox", "def add(a, b):"):
        speculative = generator.generate(prompt, max_new_tokens=16)
        alone = generator.generate(prompt, max_new_tokens=16, mode="target")
        assert speculative.token_ids == alone.token_ids
    sampled = generator.generate("for i in range", max_new_tokens=8, temperature=1.0, seed=3)
    assert len(sampled.token_ids) >= 1
    from bench.sweep import Recorder, decode  # the bench times the draft's ONNX Runtime part through the map too

    recorder = Recorder(generator)
    try:
        decode(generator, [generator.encode_prompt("def add(a, b):", False)], "speculative", 3, 8, 0.0, 0, plan=False)
        calls = recorder.take()
    finally:
        recorder.close()
    drafts = [c for c in calls if c.role == "draft"]
    assert drafts and all(0 < c.ort_seconds <= c.seconds for c in drafts)
    assert type(generator.draft.engine.session).__name__ == "InferenceSession"
