"""Drafts with a tokenizer of their own (runtime/drafters/cross_vocab.py): both methods exact, greedy and sampled.

Scripted engines over two small made-up vocabularies that share some tokens under other ids and each hold one the
other lacks, so the draft's context must travel as text and the intersection matters; then the tiny cross bundle
(a real byte-level BPE pair) end to end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from fakes import (
    LENGTH,
    BigramEngine,
    assert_follows_target,
    exact_prefixes,
    point_mass_laws,
    prefix_frequencies,
    random_table,
    run_loop,
    total_variation,
    tv_bound,
)
from door_path import submit
from runtime.decoding.config import DecodeConfig
from batch_run import BatchRun
from runtime.decoding.sampling import SamplingParams, probabilities
from runtime.drafters.cross_vocab import CrossVocabDrafter
from runtime.text.vocab_bridge import VocabBridge, split_utf8

TARGET_TOKENS = ["a", "b", "c", "d", "ab"]  # "ab": the target's alone
DRAFT_TOKENS = ["cd", "d", "c", "b", "a"]  # "cd": the draft's alone; the shared four under other ids


@dataclass
class _Encoding:
    ids: list[int]


class WordTokenizer:
    """Greedy longest match over a fixed list of tokens (the ``encode`` a VocabBridge calls)."""

    def __init__(self, tokens: list[str]):
        self.ids = {token: i for i, token in enumerate(tokens)}
        self.longest = max(len(t) for t in tokens)

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        ids, at = [], 0
        while at < len(text):
            for width in range(min(self.longest, len(text) - at), 0, -1):
                if text[at : at + width] in self.ids:
                    ids.append(self.ids[text[at : at + width]])
                    at += width
                    break
            else:
                at += 1  # a character neither vocabulary holds: dropped
        return _Encoding(ids)


def word_bridge() -> VocabBridge:
    def table(tokens):
        return [t.encode() for t in tokens], np.zeros(len(tokens), bool)

    return VocabBridge.from_tables(
        WordTokenizer(TARGET_TOKENS), WordTokenizer(DRAFT_TOKENS), table(TARGET_TOKENS), table(DRAFT_TOKENS)
    )


def cross_loop(method: str, target_table, draft_table, prompts, config: DecodeConfig) -> BatchRun:
    drafter = CrossVocabDrafter(BigramEngine(draft_table), word_bridge(), method, len(TARGET_TOKENS))
    return BatchRun(BigramEngine(target_table), drafter, prompts, config)


def target_only(target_table, prompt: list[int], new: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(new):
        last = int(np.argmax(target_table[last]))
        out.append(last)
    return out


# --- the bridge ---------------------------------------------------------------------------------------------------


def test_the_bridge_pairs_tokens_by_their_bytes_both_ways():
    bridge = word_bridge()
    assert bridge.shared == 4
    assert bridge.target_to_draft.tolist() == [4, 3, 2, 1, -1]
    assert bridge.draft_to_target.tolist() == [-1, 3, 2, 1, 0]
    assert bridge.overlap([0, 1, 4, 4]) == 0.5


def test_special_tokens_pair_only_with_special_tokens():
    target = ([b"<s>", b"x"], np.array([True, False]))
    draft = ([b"x", b"<s>"], np.array([False, False]))  # the draft's "<s>" is plain text
    bridge = VocabBridge.from_tables(None, None, target, draft)
    assert bridge.target_to_draft.tolist() == [-1, 0]


@pytest.mark.parametrize(
    "data, text, carry",
    [
        ("日本".encode()[:-1], "日", b"\xe6\x9c"),
        (b"ab\xff", "ab\ufffd", b""),
        ("é".encode(), "é", b""),
        (b"", "", b""),
        (b"\xc3", "", b"\xc3"),
    ],
)
def test_text_waits_only_for_a_character_cut_in_the_middle(data, text, carry):
    assert split_utf8(data) == (text, carry)


def test_the_real_pair_shares_its_special_tokens(tiny_cross_bundle):
    from runtime.api import SpeculativeGenerator

    generator = SpeculativeGenerator.from_bundle(tiny_cross_bundle, threads=1)
    bridge, tokenizer = generator.bridge, generator.tokenizer
    end = tokenizer.fast.token_to_id("<|im_end|>")
    assert bridge.target_to_draft[end] == bridge.draft_fast.token_to_id("<|im_end|>")
    assert 0 < bridge.shared < tokenizer.vocab_size


# --- greedy: the target's own output ------------------------------------------------------------------------------


def close_draft(target_table: np.ndarray, seed: int) -> np.ndarray:
    """A draft table over the draft's ids: the target's bigrams on the shared tokens, plus noise."""
    bridge = word_bridge()
    table = random_table(5, seed, scale=0.5)
    for d1, t1 in enumerate(bridge.draft_to_target):
        for d2, t2 in enumerate(bridge.draft_to_target):
            if t1 >= 0 and t2 >= 0:
                table[d1, d2] += target_table[t1, t2]
    return table


@pytest.mark.parametrize("method", ["tli", "string"])
def test_greedy_cross_drafting_equals_target_only(method):
    target_table = random_table(5, 1, scale=3.0)
    prompts = [[0], [1, 4], [4], [2, 3, 0]]
    loop = cross_loop(
        method, target_table, close_draft(target_table, 3), prompts, DecodeConfig(24, 3, SamplingParams(0.0))
    )
    steps = list(loop.run())
    assert [row.generated for row in loop.rows] == [target_only(target_table, p, 24) for p in prompts]
    assert sum(row.stats.num_accepted_tokens for row in loop.rows) > 0  # the draft really drafted
    assert len(steps) < 24  # and some steps took more than one token


# --- sampled: the target's law --------------------------------------------------------------------------------------

N = 20000
PARAMS = [SamplingParams(1.0), SamplingParams(0.8, top_k=3)]


def tli_law(draft_table: np.ndarray, bridge: VocabBridge, params: SamplingParams) -> np.ndarray:
    """q(b | a) over target ids: the draft's logits after a's draft id, on the shared tokens only, warped."""
    vocab = len(bridge.target_to_draft)
    logits = np.full((vocab, vocab), -np.inf)
    shared = np.flatnonzero(bridge.target_to_draft >= 0)
    for a in shared:
        logits[a, shared] = draft_table[bridge.target_to_draft[a], bridge.target_to_draft[shared]]
    logits[bridge.target_to_draft < 0] = 0.0  # never a draft's context inside one step
    return probabilities(logits, params)


@pytest.mark.parametrize("params", PARAMS, ids=["T=1", "T=0.8,top_k=3"])
def test_tli_sampling_follows_the_target_distribution(params):
    target_table, draft_table = random_table(5, 1), random_table(5, 2)
    loop = cross_loop("tli", target_table, draft_table, [[0]] * N, DecodeConfig(LENGTH, 3, params, seed=7))
    first = run_loop(loop)
    assert_follows_target(
        loop.rows, first, probabilities(target_table, params), 0, [tli_law(draft_table, word_bridge(), params)] * 3
    )


@pytest.mark.parametrize("params", PARAMS, ids=["T=1", "T=0.8,top_k=3"])
def test_string_sampling_follows_the_target_distribution(params):
    """The draft's greedy text re-tokenized (here: "a" then the draft's argmax chain) is a fixed proposal from the
    start: point masses, whose acceptance per position has an exact value."""
    target_table, draft_table = random_table(5, 1), random_table(5, 4)
    probe = CrossVocabDrafter(BigramEngine(draft_table), word_bridge(), "string", 5)
    probe.start([[0]])
    proposed = probe.propose([3], params, [np.random.default_rng(0)]).tokens[0]
    assert proposed  # the chain from "a" re-tokenizes to at least one target token
    loop = cross_loop("string", target_table, draft_table, [[0]] * N, DecodeConfig(LENGTH, 3, params, seed=7))
    first = run_loop(loop)
    probs = probabilities(target_table, params)
    if len(proposed) >= 2:
        assert_follows_target(loop.rows, first, probs, 0, point_mass_laws(proposed, 5))
    else:  # one token proposed: the law of the prefixes still, and it was accepted and rejected
        exact, observed = exact_prefixes(probs, 0, LENGTH), prefix_frequencies(loop.rows, 5, LENGTH)
        assert total_variation(observed, exact) < tv_bound(exact, N)
        assert 0 < first.accepted[0] < first.drafted[0]


def test_a_misstated_draft_law_fails_the_distribution_test(monkeypatch, streams):
    """Recording a q other than the law the token was drawn from (here 20% too small: the restricted law's mass
    before renormalising, roughly) is the bug exactness rests on: the distribution test must see it."""
    import runtime.drafters.cross_vocab as cross_vocab

    honest = cross_vocab.draw_next

    def understated(logits, tokens, probs, *args):
        token = honest(logits, tokens, probs, *args)
        probs[-1] = probs[-1] * 0.8
        return token

    monkeypatch.setattr(cross_vocab, "draw_next", understated)
    target_table, draft_table = random_table(5, 1), random_table(5, 2)
    params = SamplingParams(1.0)
    loop = cross_loop("tli", target_table, draft_table, [[0]] * N, DecodeConfig(LENGTH, 3, params, seed=7))
    first = run_loop(loop)
    with pytest.raises(AssertionError, match="law of the tokens"):
        assert_follows_target(
            loop.rows, first, probabilities(target_table, params), 0, [tli_law(draft_table, word_bridge(), params)] * 3
        )


# --- the real pair end to end ------------------------------------------------------------------------------------

PROMPTS = ["def add(a, b):", "The quick brown fox", "Ünïcödé café — 日本語の", "for i in range(10):"]


@pytest.mark.parametrize("drafter", ["tli", "string"])
def test_a_cross_bundle_decodes_exactly_with_both_methods(tiny_cross_bundle, drafter):
    from runtime.api import SpeculativeGenerator

    generator = SpeculativeGenerator.from_bundle(tiny_cross_bundle, threads=1)
    for prompt in PROMPTS:
        want = generator.generate(prompt, max_new_tokens=24, mode="target")
        got = generator.generate(prompt, max_new_tokens=24, drafter=drafter, k=3, plan=False)  # drafts every step
        assert got.token_ids == want.token_ids, (drafter, prompt)
        assert got.stats.num_draft_tokens > 0


def test_same_vocabulary_drafters_are_refused_on_a_cross_bundle_and_the_reverse(tiny_cross_bundle, generator):
    from runtime.api import SpeculativeGenerator
    from runtime.errors import RequestError

    cross = SpeculativeGenerator.from_bundle(tiny_cross_bundle, threads=1)
    assert cross.default_drafter == "tli"
    with pytest.raises(RequestError, match="tokenizer of its own"):
        cross.generate("hi", max_new_tokens=4, drafter="model")
    with pytest.raises(RequestError, match="shares the target's"):
        generator.generate("hi", max_new_tokens=4, drafter="tli")
    assert cross.generate("hi", max_new_tokens=4, drafter="prompt_lookup").token_ids  # model-free: any bundle


def test_the_scheduler_serves_both_methods_side_by_side_and_counts_each_apart(tiny_cross_bundle):
    """In-flight batching over a cross bundle: rows drafting with tli, string and nothing share steps; each answer is
    what the request gets alone, and the metrics count each method's draft and accepted tokens under its name."""
    from runtime.api import SpeculativeGenerator
    from runtime.core.scheduler import Scheduler

    generator = SpeculativeGenerator.from_bundle(tiny_cross_bundle, threads=1)
    scheduler = Scheduler(generator, max_batch=4)
    options = [dict(drafter="tli", k=3), dict(drafter="string", k=3), dict(mode="target"), dict(k=2)]
    handles = [submit(scheduler, p, max_new_tokens=16, **o) for p, o in zip(PROMPTS, options)]
    while scheduler.busy:
        scheduler.step()
    for prompt, option, handle in zip(PROMPTS, options, handles):
        assert handle.result().token_ids == generator.generate(prompt, max_new_tokens=16, **option).token_ids
    from runtime.metric_families import prometheus_text, read

    text = prometheus_text(read(generator.metrics))
    for method in ("tli", "string"):
        assert f'draftsmith_drafter_draft_tokens_total{{drafter="{method}"}}' in text
        assert f'draftsmith_drafter_accepted_tokens_total{{drafter="{method}"}}' in text


@pytest.mark.parametrize("method", ["tli", "string"])
def test_a_confidence_floor_drafts_less_and_stays_exact(method):
    """draft_confidence: after its first token a row stops where the draft's top probability is under the floor
    (both methods), so fewer tokens are drafted; the output is still the target's own."""
    target_table = random_table(5, 1, scale=3.0)
    prompts = [[0], [1, 4], [2, 3, 0]]
    drafted = []
    for confidence in (0.0, 0.95):
        drafter = CrossVocabDrafter(BigramEngine(close_draft(target_table, 3)), word_bridge(), method, 5, confidence)
        loop = BatchRun(BigramEngine(target_table), drafter, prompts, DecodeConfig(24, 4, SamplingParams(0.0)))
        list(loop.run())
        assert [row.generated for row in loop.rows] == [target_only(target_table, p, 24) for p in prompts]
        drafted.append(sum(row.stats.num_draft_tokens for row in loop.rows))
    assert 0 < drafted[1] < drafted[0]


# --- a row whose text outgrows the draft's context ----------------------------------------------------------------


def counting_bridge() -> tuple[VocabBridge, list[int]]:
    """The word bridge, recording the length of every text it tokenizes for the draft."""
    bridge, lengths = word_bridge(), []
    real = bridge.draft_ids

    def draft_ids(text: str) -> list[int]:
        lengths.append(len(text))
        return real(text)

    bridge.draft_ids = draft_ids
    return bridge, lengths


@pytest.mark.parametrize("method", ["tli", "string"])
def test_a_row_that_outgrows_the_drafts_context_stops_drafting_for_good(method):
    """The target's "ab" is two draft tokens, so the draft's count of a text outruns the target's: once the row's
    text no longer fits the draft's context it is done drafting. Before, every step re-tokenized its whole unread
    text (quadratic in the answer's length) and kept proposing nothing."""
    target_table = random_table(5, 1, scale=3.0)
    target_table[:, 4] += 6.0  # the target writes "ab" over and over: two draft tokens each
    bridge, lengths = counting_bridge()
    drafter = CrossVocabDrafter(BigramEngine(close_draft(target_table, 3), max_context=24), bridge, method, 5)
    proposed = []
    real_propose = drafter.propose
    drafter.propose = lambda *args, **kwargs: proposed.append(1) or real_propose(*args, **kwargs)
    loop = BatchRun(BigramEngine(target_table), drafter, [[0]], DecodeConfig(120, 3, SamplingParams(0.0)))
    steps = len(list(loop.run()))
    assert [row.generated for row in loop.rows] == [target_only(target_table, [0], 120)]
    assert drafter.can_draft() == [False] and drafter.unfed == [b""]
    assert sum(lengths) < 3 * 2 * 121  # each committed character tokenized about once (before: ~n^2 / 2)
    assert len(proposed) < steps / 2  # the planner stopped asking (before: every step)


def test_the_scheduler_plans_no_draft_for_a_row_done_drafting(tiny_cross_bundle, monkeypatch):
    """In-flight batching: a row whose text outgrew the draft's context gets draft length 0 from then on (before:
    k every step, for a proposal that was always empty); its answer is the target's own."""
    from runtime.api import SpeculativeGenerator
    from runtime.core.scheduler import Scheduler

    generator = SpeculativeGenerator.from_bundle(tiny_cross_bundle, threads=1)
    prompt = "The quick brown fox jumps over the lazy dog."
    want = generator.generate(prompt, max_new_tokens=60, mode="target").token_ids
    monkeypatch.setattr(generator.draft, "max_context", 40)  # a draft whose context the answer outgrows
    scheduler = Scheduler(generator, max_batch=2)
    handle = submit(scheduler, prompt, max_new_tokens=60, drafter="tli", k=3)
    while scheduler.busy:
        scheduler.step()
    assert handle.result().token_ids == want
    planned = scheduler.draft_lengths
    assert planned[0] > 2 * planned[3] and planned[3] > 0, planned
