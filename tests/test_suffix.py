"""Suffix drafting: the trie's counts, the drafts it makes, exactness under sampling, greedy equivalence, and no
drafting from another request's responses."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from fakes import LENGTH, BigramEngine, assert_follows_target, copying_table, point_mass_laws, random_table, run_loop
from runtime.drafters.hybrid import HybridDrafter
from runtime.drafters.lookup import lookup
from runtime.decoding.sampling import SamplingParams, probabilities
from runtime.decoding.config import DecodeConfig
from batch_run import BatchRun
from runtime.drafters.model import ModelDrafter
from runtime.drafters.suffix import EDGE, HYBRID_SUFFIX, SuffixConfig, SuffixDrafter, SuffixTrie

GREEDY = SamplingParams()
# "2 0" occurred three times, always followed by 1; then 3 twice and 2 once (the latest): the majority is "1 3 2"
MAJORITY = [2, 0, 1, 3, 2, 0, 1, 3, 2, 0, 1, 2, 2, 0]


DEFAULT_CONFIG = SuffixConfig()


def draft_of(history: list[int], limit: int, config: SuffixConfig = DEFAULT_CONFIG) -> list[int]:
    drafter = SuffixDrafter(16, config=config)
    drafter.start([history])
    return drafter.propose([limit], GREEDY, [None]).tokens[0]


def node_of(trie: SuffixTrie, string) -> int | None:
    node = 0
    for token in string:
        node = trie.edges.get(node * EDGE + token)
        if node is None:
            return None
    return node


# --- what it drafts -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "history, limit, expected",
    [
        (MAJORITY, 3, [1, 3, 2]),  # the most frequent continuation, where lookup takes the latest (1 2 2)
        ([1, 2, 3, 9, 2, 4, 1, 2], 2, [3, 9]),  # the longest match ("1 2") decides, not the latest "2" (then 4)
        ([5, 6, 7, 8, 5, 6], 8, [7, 8, 5, 6]),  # a 2-token match drafts at most 2 * 2 tokens, up to the text's end
        ([4, 5, 4], 8, [5, 4]),  # a 1-token match: at most 2 tokens
        ([1, 2, 3, 4, 5], 3, []),  # nothing repeats
        ([1, 2, 1], 0, []),  # no room to draft
    ],
)
def test_suffix_draft_table(history, limit, expected):
    assert draft_of(history, limit) == expected


def test_the_majority_prompt_separates_suffix_drafting_from_lookup():
    assert lookup(MAJORITY, 3) == [1, 2, 2]


def test_the_draft_stops_where_its_continuation_turns_rare():
    # "7 8" is always followed by 9, and "7 8 9" by a different token each time: 9 is sure, what follows is 1 in 4
    history = [7, 8, 9, 1, 7, 8, 9, 2, 7, 8, 9, 3, 7, 8, 9, 4, 7, 8]
    assert draft_of(history, 4, SuffixConfig(min_frequency=0.3)) == [9]
    assert draft_of(history, 4, SuffixConfig(min_frequency=0.25)) == [9, 4, 7, 8]  # the latest of the tied four
    assert draft_of(history, 4, SuffixConfig(min_score=1.75)) == [9, 4, 7, 8]  # score 1 + 3/4
    assert draft_of(history, 4, SuffixConfig(min_score=1.8)) == []
    assert draft_of(history, 4, SuffixConfig(min_score=1.5, min_frequency=0.3)) == []  # score 1 < 1.5


def test_the_depth_cut_bounds_match_and_draft():
    text = list(range(10)) * 3  # a long repeat: the match is as long as the trie allows
    config = SuffixConfig(depth=6)
    drafter = SuffixDrafter(16, config=config)
    drafter.start([text])
    trie = drafter.rows[0].trie
    assert node_of(trie, text[:6]) is not None and node_of(trie, text[:7]) is None
    draft = drafter.draft(drafter.rows[0], 4)
    assert draft.match == 2 and draft.tokens == [0, 1, 2, 3]  # depth 6 - 4 draft tokens: a 2-token context
    assert drafter.draft(drafter.rows[0], 8).tokens == [0, 1]  # limit >= depth: a 1-token context, 2 tokens


@pytest.mark.parametrize(
    "field, value",
    [
        ("depth", 1),
        ("min_match", 0),
        ("min_frequency", 0.0),
        ("min_frequency", 1.5),
        ("per_match", 0.0),
        ("min_score", -1.0),
    ],
)
def test_out_of_range_settings_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SuffixConfig(**{field: value})


# --- the index: exact counts, built incrementally ---------------------------------------------------------------


def test_incremental_counts_equal_a_brute_force_count():
    rng = np.random.default_rng(0)
    text = [int(t) for t in rng.integers(0, 4, 300)]
    trie, frontier, depth = SuffixTrie(5), [0], 5
    for at, token in enumerate(text):
        before = trie.nodes
        frontier = trie.append(frontier, token)
        assert trie.nodes - before <= depth  # O(depth) per token, nothing rebuilt
        assert frontier[-1] == node_of(trie, text[max(0, at + 1 - depth) : at + 1])
    for size in range(1, depth + 1):
        occurrences = Counter(tuple(text[i : i + size]) for i in range(len(text) - size + 1))
        continued = Counter(tuple(text[i : i + size]) for i in range(len(text) - size))
        for string, count in occurrences.items():
            node = node_of(trie, string)
            assert trie.count[node] == count
            assert trie.out[node] == (continued[string] if size < depth else 0)
    assert trie.nodes == 1 + sum(
        len({tuple(text[i : i + s]) for i in range(len(text) - s + 1)}) for s in range(1, depth + 1)
    )


def test_drafting_after_each_step_equals_drafting_from_scratch():
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 5, 12)] for _ in range(3)]
    drafter = SuffixDrafter(5)
    drafter.start(prompts)
    texts = [list(p) for p in prompts]
    for _ in range(30):
        emitted = [[int(t) for t in rng.integers(0, 5, rng.integers(1, 4))] for _ in texts]
        drafter.settle([0] * len(texts), emitted)
        for text, out in zip(texts, emitted):
            text.extend(out)
        assert drafter.propose([4] * 3, GREEDY, [None] * 3).tokens == [draft_of(t, 4) for t in texts]
    drafter.keep_rows(np.array([2, 0]))
    drafter.observe([[1], [2]])
    texts = [texts[2] + [1], texts[0] + [2]]
    assert drafter.propose([4, 4], GREEDY, [None] * 2).tokens == [draft_of(t, 4) for t in texts]


# --- exact under sampling -----------------------------------------------------------------------------------------


def test_suffix_sampling_follows_the_target_distribution():
    """Point-mass proposals keep rejection sampling exact: 20,000 sequences of 4 tokens, the first step drafting the
    majority continuation 1 3 2."""
    vocab, table = 4, copying_table(4, 5, [0, 1, 3, 2])
    params = SamplingParams(1.0)
    n = 20000
    drafter = SuffixDrafter(vocab)
    loop = BatchRun(BigramEngine(table), drafter, [MAJORITY] * n, DecodeConfig(LENGTH, 3, params, seed=3))
    first = run_loop(loop)
    assert_follows_target(loop.rows, first, probabilities(table, params), 0, point_mass_laws([1, 3, 2], vocab))
    assert sum(row.stats.num_draft_tokens for row in loop.rows) > n


def test_hybrid_suffix_sampling_follows_the_target_distribution_from_both_sources():
    """Rows with a confident suffix draft take it (point mass), the others the draft model (its own q); both kinds
    follow the target exactly (20,000 sequences of 4 tokens of each kind, the first step drafting 3)."""
    vocab, table, draft_table = 4, copying_table(4, 5, [0, 1, 3, 2]), random_table(4, 9)
    params = SamplingParams(1.0)
    n = 20000
    drafter = HybridDrafter(
        ModelDrafter(BigramEngine(draft_table)), vocab, free=SuffixDrafter(vocab, config=HYBRID_SUFFIX)
    )
    loop = BatchRun(BigramEngine(table), drafter, [MAJORITY] * n + [[3]] * n, DecodeConfig(LENGTH, 3, params, seed=4))
    suffixed, modelled = run_loop(loop, groups=2)
    probs = probabilities(table, params)
    assert_follows_target(loop.rows[:n], suffixed, probs, 0, point_mass_laws([1, 3, 2], vocab))
    assert_follows_target(loop.rows[n:], modelled, probs, 3, [probabilities(draft_table, params)] * 3)
    assert n <= drafter.looked_up < drafter.proposed and drafter.model.calls > 0


# --- through the generator and the bench -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["suffix", "hybrid_suffix"])
def test_suffix_greedy_equals_target_only(generator, kind):
    for prompt in ("def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "The quick brown fox"):
        spec = generator.generate(prompt, max_new_tokens=30, drafter=kind, k=4, plan=False)
        plain = generator.generate(prompt, max_new_tokens=30, mode="target")
        assert spec.token_ids == plain.token_ids
    assert spec.stats.num_draft_tokens > 0


@pytest.mark.parametrize("kind", ["suffix", "hybrid_suffix"])
def test_a_request_drafts_as_if_it_were_the_first(generator, kind):
    """Nothing a request emitted reaches a later one's drafts (a corpus shared by a server's clients would show one
    client's outputs to another through draft counts and timing): the same request drafts the same, every time."""
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    runs = [generator.generate(prompt, max_new_tokens=30, drafter=kind, k=4, plan=False).stats for _ in range(3)]
    counts = {(s.num_steps, s.num_draft_tokens, s.num_accepted_tokens) for s in runs}
    assert len(counts) == 1 and runs[0].num_draft_tokens > 0


def test_the_generator_and_bench_build_suffix_drafters(generator):
    from bench.drafter_list import drafter_labels
    from bench.sweep import decode
    from runtime.bundle import BuildSpec
    from runtime.drafter_names import DRAFTERS

    assert {"suffix", "hybrid_suffix"} <= set(DRAFTERS)
    assert BuildSpec(target="t", drafter="suffix").drafter == "suffix"
    assert isinstance(generator.new_drafter("speculative", "suffix", 0.0), SuffixDrafter)
    hybrid = generator.new_drafter("speculative", "hybrid_suffix", 0.0)
    assert isinstance(hybrid, HybridDrafter) and isinstance(hybrid.free, SuffixDrafter)
    assert hybrid.free.config == HYBRID_SUFFIX
    assert drafter_labels("suffix,hybrid_suffix") == ["suffix", "hybrid_suffix"]  # the bench takes both
    ids = [generator.encode_prompt("def add(a, b):\n    return a + b\n\ndef add(a, b):\n", False)]
    # plan off: the drafter's earlier rows in this module (a random tiny model) may have priced drafting out
    records, _ = decode(generator, ids, "speculative", 4, 24, 0.0, 0, "suffix", plan=False)
    plain, _ = decode(generator, ids, "target", None, 24, 0.0, 0, "suffix")
    assert records[0].token_ids == plain[0].token_ids
    assert sum(drafted for drafted, *_ in records[0].steps) > 0
