"""The acceptance rule: hand-built cases, and speculative sampling tested as a distribution."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import (
    LENGTH,
    BigramEngine,
    assert_follows_target,
    drawn_by_races,
    exact_prefixes,
    prefix_frequencies,
    random_table,
    run_loop,
    total_variation,
    tv_bound,
)
from runtime.decoding import sampling
from runtime.errors import RequestError
from runtime.decoding.sampling import SamplingParams, probabilities, verify
from runtime.decoding.seeded import SeededNoise, race
from runtime.decoding.config import DecodeConfig
from batch_run import BatchRun
from runtime.drafters.model import ModelDrafter

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0)


def one_hot_logits(choices: list[int], vocab: int = 6) -> np.ndarray:
    logits = np.zeros((len(choices), vocab))
    logits[np.arange(len(choices)), choices] = 10.0
    return logits


# --- hand-built logits ------------------------------------------------------------------------------------------


def test_greedy_all_accepted_gives_bonus_token():
    assert verify([1, 2, 3], [None] * 3, one_hot_logits([1, 2, 3, 4]), GREEDY, None) == (3, 4)


def test_greedy_first_rejected_gives_recovered_token():
    assert verify([1, 2, 3], [None] * 3, one_hot_logits([5, 2, 3, 4]), GREEDY, None) == (0, 5)


def test_greedy_rejection_in_the_middle():
    assert verify([1, 2, 3], [None] * 3, one_hot_logits([1, 2, 0, 4]), GREEDY, None) == (2, 0)


def test_sampled_token_of_zero_target_probability_is_always_rejected():
    target = np.full((2, 4), -np.inf)
    target[:, 0] = 0.0  # the target only ever says token 0
    q = np.array([0.0, 1.0, 0.0, 0.0])  # the draft was sure of token 1
    for seed in range(50):
        n, token = verify([1], [q], target, SAMPLED, np.random.default_rng(seed))
        assert (n, token) == (0, 0)


def test_sampled_identical_distributions_always_accept():
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4]] * 3))
    q = probabilities(logits[0], SAMPLED)
    for seed in range(50):
        n, _ = verify([3, 2], [q, q], logits, SAMPLED, np.random.default_rng(seed))
        assert n == 2


def test_recovered_token_comes_from_the_residual():
    p = np.array([0.5, 0.5, 0.0])
    q = np.array([0.0, 1.0, 0.0])  # draft proposes 1: accepted with prob 0.5, else residual max(p-q,0) = token 0
    counts = np.zeros(3)
    rng = np.random.default_rng(0)
    for _ in range(4000):
        n, token = verify([1], [q], np.log(np.stack([p, p]) + 1e-300), SAMPLED, rng)
        counts[token if n == 0 else 1] += 1
    assert counts[2] == 0
    assert abs(counts[0] / counts.sum() - 0.5) < 0.03


@pytest.mark.parametrize(
    "params", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(temperature=float("nan"))]
)
def test_out_of_range_sampling_parameters(params):
    with pytest.raises(RequestError):
        SamplingParams(**params)


def test_top_k_and_top_p_processing():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert np.count_nonzero(probabilities(logits, SamplingParams(1.0, top_k=2))) == 2
    kept = probabilities(logits, SamplingParams(1.0, top_p=0.7))  # 0.5 + 0.3 reaches 0.7
    assert np.count_nonzero(kept) == 2 and abs(kept.sum() - 1) < 1e-12
    assert np.count_nonzero(probabilities(logits, SamplingParams(1.0, top_p=0.01))) == 1


# --- the distribution ---------------------------------------------------------------------------------------------
# Sequences of LENGTH = 4 tokens with k = 3: the budget rule (a step drafts at most max_new_tokens - generated - 1
# tokens, since it emits one more than it accepts) lets the first step draft all 3.

VOCAB = 5
N = 20000


def exact_pairs(table: np.ndarray, start: int, params: SamplingParams) -> np.ndarray:
    """P(x1, x2 | start) under the target alone."""
    return exact_prefixes(probabilities(table, params), start, 2)


def run_model_drafter(target_table, draft_table, params, n: int, k: int, seed: int):
    loop = BatchRun(
        BigramEngine(target_table),
        ModelDrafter(BigramEngine(draft_table)),
        [[0]] * n,
        DecodeConfig(LENGTH, k, params, seed=seed),
    )
    return loop, run_loop(loop)


CASES = [SamplingParams(1.0), SamplingParams(0.7, top_k=3), SamplingParams(1.3, top_p=0.8)]


@pytest.mark.parametrize(
    "params, draws",
    [(params, "races") for params in CASES] + [(CASES[2], "streams")],
    ids=["T=1", "T=0.7,top_k=3", "T=1.3,top_p=0.8", "T=1.3,top_p=0.8,streams"],
)
def test_speculative_sampling_follows_the_target_distribution(params, draws, request):
    """Both ways of sampling: seeded rows' races (acceptance: the coupling's) and streams (rejection sampling's; the
    suite's other distribution tests run seeded rows, so races)."""
    if draws == "streams":
        request.getfixturevalue("streams")
    target_table, draft_table = random_table(VOCAB, 1), random_table(VOCAB, 2)
    loop, first = run_model_drafter(target_table, draft_table, params, N, k=3, seed=7)
    assert drawn_by_races(loop.rows) == (draws == "races")
    p, q = probabilities(target_table, params), probabilities(draft_table, params)
    assert_follows_target(loop.rows, first, p, 0, [q] * 3)
    # the draft really differs: a sampler that followed it would be far off
    assert total_variation(exact_prefixes(q, 0, 2), exact_prefixes(p, 0, 2)) > 0.15


def test_the_budget_rule_lets_the_first_step_draft_all_but_one_new_token():
    """max_new_tokens=2 (the old distribution tests) leaves room for one draft token; 4 leaves room for 3."""
    for max_new_tokens, drafted in ((2, 1), (4, 3), (9, 5)):
        loop = BatchRun(
            BigramEngine(random_table(VOCAB, 1)),
            ModelDrafter(BigramEngine(random_table(VOCAB, 2))),
            [[0]] * 20,
            DecodeConfig(max_new_tokens, 5, SAMPLED, seed=3),
        )
        assert run_loop(loop).drafted.tolist() == [20] * drafted
        assert all(len(r.generated) == max_new_tokens for r in loop.rows)


def test_a_wrong_acceptance_rule_fails_the_distribution_test(monkeypatch, streams):
    """Resampling from p (not the residual max(0, p - q)) after a rejection is a classic bug: it must be caught."""

    def wrong_verify(tokens, draft_probs, logits, params, rng):
        target_probs = probabilities(logits, params)
        for i, token in enumerate(tokens):
            if rng.random() * draft_probs[i][token] < target_probs[i][token]:
                continue
            return i, sampling.sample(target_probs[i], rng)
        return len(tokens), sampling.sample(target_probs[len(tokens)], rng)

    monkeypatch.setattr("runtime.decoding.step.verify", wrong_verify)
    params = SamplingParams(1.0)
    target_table, draft_table = random_table(VOCAB, 1), random_table(VOCAB, 2)
    loop, first = run_model_drafter(target_table, draft_table, params, N, k=3, seed=7)
    p, q = probabilities(target_table, params), probabilities(draft_table, params)
    with pytest.raises(AssertionError, match="law of the tokens"):
        assert_follows_target(loop.rows, first, p, 0, [q] * 3)


def test_seeded_sampling_is_reproducible():
    target_table, draft_table = random_table(VOCAB, 1), random_table(VOCAB, 2)
    a, b, c = (run_model_drafter(target_table, draft_table, SAMPLED, 200, 3, seed)[0] for seed in (11, 11, 12))
    a, b, c = (prefix_frequencies(loop.rows, VOCAB, LENGTH) for loop in (a, b, c))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def sampled_rows(prompts, seed, max_new_tokens=20, k=3):
    """What each row of one loop generates (temperature 1, a draft that disagrees often: every kind of draw)."""
    target, draft = BigramEngine(random_table(VOCAB, 1)), BigramEngine(random_table(VOCAB, 2))
    loop = BatchRun(target, ModelDrafter(draft), prompts, DecodeConfig(max_new_tokens, k, SAMPLED, seed=seed))
    for _ in loop.run():
        pass
    return [row.generated for row in loop.rows]


def test_per_row_seeds_do_not_depend_on_the_batch():
    """Two identical seeded requests batched together (anywhere in the batch, with others) sample what each samples
    alone: each row has its own generator from its own seed."""
    alone = sampled_rows([[0]], seed=[5])[0]
    assert sampled_rows([[0]], seed=5)[0] == alone  # a lone request's int seed is the same stream
    other = sampled_rows([[2]], seed=[4])[0]
    batch = sampled_rows([[1], [0], [2], [0]], seed=[9, 5, 4, 5])
    assert batch[1] == batch[3] == alone
    assert batch[2] == other
    assert sampled_rows([[0]], seed=[6])[0] != alone  # the seed matters (so the equalities above could fail)


def test_one_seed_for_a_batch_still_gives_rows_their_own_streams():
    rows = sampled_rows([[0]] * 4, seed=5)
    assert len({tuple(r) for r in rows}) > 1  # identical prompts under one batch seed still differ


def test_bad_seeds_are_request_errors():
    with pytest.raises(RequestError, match="one seed per prompt"):
        sampled_rows([[0], [0]], seed=[1])
    with pytest.raises(RequestError, match="seed"):
        sampled_rows([[0]], seed=-1)


def test_top_p_on_a_large_vocabulary_is_the_full_sort_nucleus():
    """nucleus_ids() sorts only the most likely candidates when they hold the set: the same set, ties included."""
    from runtime.decoding.sampling import nucleus_ids

    rng = np.random.default_rng(0)
    for trial in range(60):
        probs = np.exp(rng.normal(0, [0.5, 3.0, 8.0][trial % 3], 5000))
        if trial % 4 == 0:
            probs[:300] = probs.max()  # a tie that straddles the candidate boundary
        if trial % 5 == 0:
            probs = np.round(probs, 1) + 1e-3  # many ties
        probs /= probs.sum()
        top_p = [0.3, 0.9, 0.99][trial % 3]
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        want = np.zeros(len(probs), bool)
        want[order[: max(1, int((before < top_p).sum()))]] = True
        got = np.zeros(len(probs), bool)
        got[nucleus_ids(probs, top_p)] = True
        assert np.array_equal(got, want), trial


# --- seeded rows: position-keyed races -----------------------------------------------------------------------------


def test_a_race_follows_its_distribution_and_its_key():
    """Over many keys a race picks each token as often as its probability; one key and position always pick the same."""
    small = np.array([0.05, 0.0, 0.5, 0.25, 0.2])
    large = np.zeros(5000)  # over BLOCK ids: a race between blocks, then within the winner (ids at blocks' edges)
    large[[3, 1023, 1024, 2047, 2500, 4999]] = [0.3, 0.1, 0.2, 0.15, 0.05, 0.2]
    for p in (small, large):
        picks = np.bincount([race(p, key, 3) for key in range(20000)], minlength=len(p)) / 20000
        assert total_variation(picks, p) < tv_bound(p, 20000) and not picks[p == 0].any()
        assert len({race(p, 77, 3) for _ in range(5)}) == 1
        assert len({race(p, 77, position) for position in range(40)}) > 1  # positions draw apart


def test_a_draft_that_races_on_the_target_law_is_always_accepted():
    """Drafted by the same races over the same law, every token is the target's choice: no rejection, ever."""
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4]] * 4))
    p = probabilities(logits[0], SAMPLED)
    for seed in range(50):
        noise = SeededNoise(np.random.SeedSequence(seed))
        draft = noise.at(10)
        tokens = [draft.choose(p) for _ in range(3)]
        assert verify(tokens, [p] * 3, logits, SAMPLED, noise.at(10))[0] == 3


def seeded_text(mode: str, k: int, plan: bool, seed=5, prompts=((0,),)) -> list[list[int]]:
    """Seeded sampled text (T = 1 and top-p, a draft that disagrees often) decoded with ``mode`` at ``k``."""
    target, draft = BigramEngine(random_table(VOCAB, 1)), BigramEngine(random_table(VOCAB, 2))
    params = SamplingParams(1.0, top_p=0.9)
    config = DecodeConfig(24, k, params, seed=seed, plan=plan)
    loop = BatchRun(target, ModelDrafter(draft) if mode == "speculative" else None, [list(p) for p in prompts], config)
    for _ in loop.run():
        pass
    return [row.generated for row in loop.rows]


def test_seeded_text_does_not_depend_on_the_draft():
    """A seeded row's text is the same at every draft length, planned or not, and without a draft at all: each
    token is the target's race at its position, whatever was drafted."""
    alone = seeded_text("target", 1, False)
    assert all(seeded_text("speculative", k, plan) == alone for k in (1, 2, 5) for plan in (False, True))
    assert seeded_text("target", 1, False, seed=6) != alone  # the seed matters (so the equalities above could fail)
    rows = seeded_text("speculative", 3, False, seed=[5, 9, 5], prompts=([0], [1], [0]))
    assert rows[0] == rows[2] == alone[0]
