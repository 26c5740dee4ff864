"""The step plan (runtime/decoding/step_costs.py): how far each row drafts, 0 included, from measured call costs and
each row's acceptance, and what the loops do with it."""

from __future__ import annotations

import pytest

from fakes import BigramEngine, random_table
from runtime.decoding.step_costs import PROBE_EVERY, CostModel, PlanInputs, plan_draft_lengths, with_probes


def costs(call: dict, draft: dict | None = None) -> CostModel:
    return CostModel(call=dict(call), draft=dict(draft or {}))


def test_call_costs_interpolate_over_rows_and_width_and_extrapolate_past_them():
    model = costs({(1, 1): 1.0, (1, 3): 2.0, (4, 1): 2.0, (4, 3): 6.0})
    assert model.call_cost([1]) == pytest.approx(1.0)
    assert model.call_cost([2]) == pytest.approx(1.5)
    assert model.call_cost([1, 3, 1, 1]) == pytest.approx(6.0)  # a ragged call: its widest row, every row
    assert model.call_cost([5]) == pytest.approx(3.0)  # past the widest: the last slope goes on
    assert model.call_cost([1] * 8) == pytest.approx(4.0)  # past the largest batch: its cost per row
    model.observe(predicted=1.0, measured=2.0)
    assert model.call_cost([1]) == pytest.approx(1.2)  # a fifth of the way to twice as slow


def test_a_verify_as_cheap_as_a_plain_call_drafts_as_far_as_allowed():
    flat = costs({(1, 1): 1.0, (1, 9): 1.0, (4, 1): 1.0, (4, 9): 1.0})
    inputs = PlanInputs([0.7] * 4, [3, 5, 0, 2], shared_drafter=True)
    assert plan_draft_lengths(flat, inputs) == [3, 5, 0, 2]


def test_when_each_scored_token_costs_a_call_no_row_drafts():
    linear = costs({(4, 1): 4.0, (4, 9): 36.0, (1, 1): 1.0, (1, 9): 9.0})  # compute-bound: cost per token
    inputs = PlanInputs([0.6] * 4, [4] * 4, shared_drafter=True, min_width=1, plain_width=1)
    assert plan_draft_lengths(linear, inputs) == [0, 0, 0, 0]


def test_rows_are_probed_only_where_drafting_could_pay_at_all():
    """A probe makes a model draft catch up on every token since it last drafted: where the costs would not let a
    row draft even were its drafts accepted 9 times in 10 (a compute-bound batch), it is never probed."""
    from runtime.decoding.planner import probe_limits

    linear = costs({(4, 1): 4.0, (4, 9): 36.0, (1, 1): 1.0, (1, 9): 9.0}, {4: 0.5})
    dear = PlanInputs([0.2] * 4, [4] * 4, shared_drafter=True, min_width=1, plain_width=1)
    assert probe_limits(linear, dear) == [0, 0, 0, 0]
    cheap = costs({(1, 1): 1.0, (1, 5): 1.2}, {1: 0.1})
    hopeful = PlanInputs([0.05], [4], shared_drafter=True, min_width=1, plain_width=1)
    assert plan_draft_lengths(cheap, hopeful) == [0] and probe_limits(cheap, hopeful) == [4]  # kept out, probed


def test_a_row_whose_drafts_fail_stops_paying_for_them_while_the_others_draft():
    model = costs({(1, 1): 1.0, (1, 5): 1.2, (4, 1): 1.0, (4, 5): 1.3}, {1: 0.1})
    inputs = PlanInputs([0.9, 0.02, 0.85, 0.9], [4] * 4, shared_drafter=False)
    ks = plan_draft_lengths(model, inputs)
    assert ks[1] == 0 and all(k > 0 for i, k in enumerate(ks) if i != 1)


def test_uncalibrated_costs_leave_every_row_its_limit():
    assert plan_draft_lengths(CostModel(), PlanInputs([0.1, 0.9], [3, 2], shared_drafter=True)) == [3, 2]


class Row:
    undrafted = 0


def test_a_row_kept_from_drafting_probes_again_every_so_many_steps():
    rows = [Row(), Row()]
    drafted = []
    for _ in range(3 * PROBE_EVERY):
        drafted.append(with_probes([0, 2], [4, 4], rows))
    probes = [step for step, ks in enumerate(drafted) if ks[0]]
    assert probes == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 3 * PROBE_EVERY - 1]
    assert all(ks[1] == 2 for ks in drafted) and rows[1].undrafted == 0


def test_a_planned_batch_is_greedy_exact_and_drafts_less_where_drafts_fail(tiny_bundle):
    """BatchRun over a batch with costs: every row's greedy output equals target-only decoding, and a
    draft that is mostly wrong drafts far less than its k."""
    from runtime.api import SpeculativeGenerator
    from batch_run import BatchRun
    from runtime.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_bundle / "tokenizer")
    vocab = tokenizer.vocab_size
    target = BigramEngine(random_table(vocab, 1, scale=3.0), max_context=128)
    wrong = BigramEngine(random_table(vocab, 9, scale=3.0), max_context=128)
    generator = SpeculativeGenerator(None, target, wrong, tokenizer, max_k=8)
    config = generator_config(generator, max_new_tokens=40, k=4)
    prompts = [tokenizer.encode(p) for p in ("the cat", "a b c d", "hello there", "def f(x):")]
    model = costs({(1, 1): 1.0, (1, 5): 1.5, (4, 1): 1.0, (4, 5): 1.6}, {1: 0.2, 4: 0.25})
    reference = BatchRun(target, None, prompts, config)
    for _ in reference.run():
        pass
    drafted = {}
    for planned in (None, model):
        loop = BatchRun(target, generator.new_drafter("speculative", None, None), prompts, config, planned)
        for _ in loop.run():
            pass
        drafted[planned is not None] = sum(row.stats.num_draft_tokens for row in loop.rows)
        assert [row.generated for row in loop.rows] == [row.generated for row in reference.rows]
    assert drafted[True] < drafted[False] / 3


def generator_config(generator, **options):
    """The DecodeConfig the generator's front door makes of ``options`` (its one call, on a one-token prompt)."""
    from runtime.core.request import Asked, DecodeRequest

    return generator.door.admit(Asked.tokenized([[1]], DecodeRequest(**options))).config


def test_a_lone_row_drafts_as_far_as_the_measured_verify_curve_pays():
    """Batch 1 is planned too: a verify nearly as cheap as a plain step drafts the whole limit, one that costs a
    step per token drafts nothing (plain decoding), whatever the draft's acceptance."""
    lone = PlanInputs([0.7], [4], shared_drafter=True, min_width=1, plain_width=1)
    flat = costs({(1, 1): 1.0, (1, 5): 1.1}, {1: 0.05})
    assert plan_draft_lengths(flat, lone) == [4]
    linear = costs({(1, 1): 1.0, (1, 5): 5.0}, {1: 0.05})
    assert plan_draft_lengths(linear, lone) == [0]
    padded = PlanInputs([0.7], [4], shared_drafter=True, min_width=2, plain_width=2)  # "exact": width 2 either way
    assert plan_draft_lengths(costs({(1, 1): 1.0, (1, 2): 2.0, (1, 5): 5.0}, {1: 0.05}), padded) == [1]


def test_a_lone_planned_row_is_greedy_exact_and_drafts_less_where_drafts_fail(tiny_bundle):
    from runtime.api import SpeculativeGenerator
    from batch_run import BatchRun
    from runtime.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_bundle / "tokenizer")
    vocab = tokenizer.vocab_size
    target = BigramEngine(random_table(vocab, 1, scale=3.0), max_context=128)
    wrong = BigramEngine(random_table(vocab, 9, scale=3.0), max_context=128)
    generator = SpeculativeGenerator(None, target, wrong, tokenizer, max_k=8)
    config = generator_config(generator, max_new_tokens=60, k=4)
    prompt = [tokenizer.encode("hello there")]
    model = costs({(1, 1): 1.0, (1, 5): 1.6}, {1: 0.2})
    reference = BatchRun(target, None, prompt, config)
    for _ in reference.run():
        pass
    drafted = {}
    for planned in (None, model):
        loop = BatchRun(target, generator.new_drafter("speculative", "model", None), prompt, config, planned)
        for _ in loop.run():
            pass
        drafted[planned is not None] = loop.rows[0].stats.num_draft_tokens
        assert loop.rows[0].generated == reference.rows[0].generated
    assert drafted[True] < drafted[False] / 3


def test_the_hybrid_takes_the_free_proposal_only_where_it_pays():
    """Each source's expected tokens (the row's own acceptance of it) over what its step would cost by the measured
    curve: a free draft beats a cheap, sure model only when it is as sure; it always wins without costs."""
    from runtime.drafters.hybrid import HybridDrafter
    from runtime.drafters.model import ModelDrafter

    hybrid = HybridDrafter(ModelDrafter(BigramEngine(random_table(12, 2))), 12)
    hybrid.start([[1, 2, 3, 1, 2]])
    assert hybrid.free_pays(0, 3, [3])  # no costs: the free proposal wherever there is one
    hybrid.use_costs(costs({(1, 1): 1.0, (1, 4): 1.2}, {1: 0.05}))
    hybrid.rates[0] = [0.2, 0.9]  # the free source is rarely right here, the model mostly
    assert not hybrid.free_pays(0, 3, [3])
    hybrid.rates[0] = [0.9, 0.2]
    assert hybrid.free_pays(0, 3, [3])
    hybrid.use_costs(costs({(1, 1): 1.0, (1, 4): 1.2}, {1: 2.0}))  # a draft call dearer than a step
    hybrid.rates[0] = [0.3, 0.9]
    assert hybrid.free_pays(0, 3, [3])


def test_a_model_free_drafter_is_charged_no_draft_calls():
    """Prompt lookup and the suffix trie draft without the draft engine: the plan prices their drafts at the verify
    alone, so a draft engine dearer than a step does not keep them from drafting."""
    from runtime.drafters.lookup import PromptLookupDrafter
    from runtime.drafters.suffix import SuffixDrafter

    dear = costs({(1, 1): 1.0, (1, 5): 1.2}, {1: 3.0})
    paid = PlanInputs([0.6], [4], shared_drafter=True, min_width=1, plain_width=1, paid=[True])
    free = PlanInputs([0.6], [4], shared_drafter=True, min_width=1, plain_width=1, paid=[False])
    assert plan_draft_lengths(dear, paid) == [0] and plan_draft_lengths(dear, free) == [4]
    assert not PromptLookupDrafter(8).calls_draft_engine and not SuffixDrafter(8).calls_draft_engine


def test_a_draft_that_must_catch_up_costs_its_catch_up_spread_over_the_steps_it_buys():
    """A draft that has not drafted for a while (or at all) feeds every token it has not seen before drafting: the
    plan charges that call's width, spread over the steps left, and predicts it whole."""
    from runtime.decoding.step_costs import step_cost

    model = costs({(1, 1): 1.0, (1, 2): 1.3, (1, 9): 3.0}, {1: 0.2})
    caught_up = PlanInputs([0.8], [1], shared_drafter=True, min_width=1, plain_width=1, backlog=[1])
    behind = PlanInputs([0.8], [1], shared_drafter=True, min_width=1, plain_width=1, backlog=[9], horizon=10.0)
    assert step_cost(model, [1], caught_up) == pytest.approx(0.2 + 1.3)
    assert step_cost(model, [1], behind) == pytest.approx(0.6 + 1.3)  # the draft's call at width 9: 3x its one
    usual = 0.2 * 1.3  # a drafting row's usual first call (two tokens), beyond which the catch-up is spread
    assert step_cost(model, [1], behind, planning=True) == pytest.approx(usual + (0.6 - usual) / 10 + 1.3)
    assert plan_draft_lengths(model, behind) == [1]
    assert plan_draft_lengths(model, PlanInputs([0.8], [1], True, 1, 1, backlog=[9], horizon=1.0)) == [0]


def test_drafting_steps_that_run_dearer_than_predicted_stop_the_plan_from_drafting_at_that_batch():
    """Drafting steps follow their own measured / predicted ratio, per batch size, apart from plain steps: a plan
    whose drafting steps keep costing more than the calibration says stops drafting there, and only there."""
    model = costs({(2, 1): 1.0, (2, 2): 1.2, (1, 1): 1.0, (1, 2): 1.2}, {1: 0.1, 2: 0.1})
    inputs = PlanInputs([0.8] * 2, [1, 1], shared_drafter=True, min_width=1, plain_width=1)
    assert plan_draft_lengths(model, inputs) == [1, 1]
    for _ in range(10):
        model.observe(predicted=1.4, measured=2.6, drafting_rows=2)
    assert model.scale == 1.0 and model.drafting_factor(2) > 1.5
    assert plan_draft_lengths(model, inputs) == [0, 0]
    alone = PlanInputs([0.8], [1], shared_drafter=True, min_width=1, plain_width=1)
    assert plan_draft_lengths(model, alone) == [1]


def test_an_acceptance_estimate_counts_the_tokens_a_verification_tested():
    """A draft rejected at its first token tested one token, not all it proposed: the estimate falls as for one."""
    from runtime.decoding.config import DecodeConfig
    from runtime.decoding.step import DecodeRow, learn_acceptance, tested

    assert tested(3, 0) == 1 and tested(3, 2) == 3 and tested(3, 3) == 3
    one, three = (DecodeRow(prompt=[1], config=DecodeConfig(8, 3)) for _ in range(2))
    learn_acceptance(one, 1, 0)
    learn_acceptance(three, 3, 0)
    assert one.acceptance == pytest.approx(three.acceptance) and one.acceptance < one.prior


def test_a_new_row_starts_from_what_its_drafter_achieved_in_the_rows_before_it():
    from runtime.decoding.step import ACCEPTANCE_PRIOR, AcceptancePrior

    priors = AcceptancePrior()
    assert priors.of("model") == ACCEPTANCE_PRIOR
    for _ in range(200):
        priors.learn("model", 3, 3)  # every token accepted
        priors.learn("prompt_lookup", 3, 0)  # the first rejected
    assert priors.of("model") > 0.9 and priors.of("prompt_lookup") < 0.1 and priors.of("suffix") == ACCEPTANCE_PRIOR
