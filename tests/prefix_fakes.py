"""A scripted engine whose next-token logits depend on the whole live prefix (and so on the position), and the exact
laws it implies.

The bigram fake (fakes.BigramEngine) scores a position from its own token alone: a loop that forgot to roll back a
rejected draft token, fed a position twice, or dropped a pending token would still see the right logits, so no
distribution test could catch it. Here every live token before a position changes that position's logits, so any
such bug changes the law of the output, and ``assert_follows_prefix_target`` sees it.
"""

from __future__ import annotations

import itertools
import zlib
from functools import lru_cache

import numpy as np

from fakes import (
    LENGTH,
    DraftCounts,
    TokenCache,
    drawn_by_races,
    last_positions,
    raced_together,
    rate_bound,
    total_variation,
    tv_bound,
)
from runtime.engines.base import KVCache
from runtime.decoding.sampling import probabilities


class PrefixEngine(TokenCache):
    """Logits after a live prefix x_1..x_t: ``scale`` * a normal vector seeded by (seed, the prefix), plus
    ``bias[x_t]`` (a bigram table: a target that follows a path, for model-free drafters), plus ``base``'s logits
    (a draft that partly agrees with its target)."""

    def __init__(
        self,
        vocab: int,
        seed: int,
        scale: float = 1.5,
        bias: np.ndarray | None = None,
        base: "PrefixEngine | None" = None,
        max_context: int = 512,
    ):
        self.vocab_size, self.seed, self.scale, self.bias, self.base = vocab, seed, scale, bias, base
        self.max_context = max_context
        self.calls = 0
        self._logits = lru_cache(maxsize=None)(self._compute)

    def logits_after(self, prefix) -> np.ndarray:
        return self._logits(tuple(int(t) for t in prefix))

    def _compute(self, prefix: tuple) -> np.ndarray:
        key = zlib.crc32(np.asarray(prefix, np.int64).tobytes())
        logits = self.scale * np.random.default_rng([self.seed, key, len(prefix)]).normal(size=self.vocab_size)
        if self.bias is not None and prefix:
            logits = logits + self.bias[prefix[-1]]
        if self.base is not None:
            logits = logits + self.base.logits_after(prefix)
        return logits

    def compute(self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None = None, *, last=False, **_):
        valid = np.ones_like(tokens) if valid is None else valid
        live = [self.live_tokens(cache, b) for b in range(len(tokens))]
        out = np.zeros(tokens.shape + (self.vocab_size,))
        for b, row in enumerate(tokens):
            prefix = list(live[b])
            for j, token in enumerate(row):
                if valid[b, j]:
                    prefix.append(int(token))
                    out[b, j] = self.logits_after(prefix)
        cache.past = [np.concatenate([cache.past[0], tokens], axis=1)]
        cache.mask = np.concatenate([cache.mask, valid.astype(np.int64)], axis=1)
        cache.lengths = cache.lengths + valid.sum(axis=1)
        cache.calls += 1
        self.calls += 1
        return last_positions(out, valid) if last else out


def exact_joint(law, context: list[int], vocab: int, length: int = LENGTH) -> np.ndarray:
    """P(x_1..x_length | context) [vocab] * length, where law(prefix) is the next-token distribution."""
    joint = np.zeros((vocab,) * length)
    for seq in itertools.product(range(vocab), repeat=length):
        p, prefix = 1.0, list(context)
        for token in seq:
            p *= law(prefix)[token]
            prefix.append(token)
        joint[seq] = p
    return joint


def exact_acceptance(law, draft_law, context: list[int], vocab: int, depth: int, races: bool = False) -> np.ndarray:
    """P(draft tokens 1..j all accepted) in the first step: min(p, q) (a seeded row's races: ``raced_together``)
    chained over draft positions, where draft_law(prefix, j) is the draft's q at position j (after prefix = context +
    j - 1 accepted tokens)."""
    out = np.zeros(depth)
    joint = raced_together if races else np.minimum

    def walk(prefix: list[int], j: int, reach: float) -> None:
        if j == depth:
            return
        both = joint(law(prefix), draft_law(prefix, j))
        for token in range(vocab):
            if both[token] > 0:
                out[j] += reach * both[token]
                walk(prefix + [token], j + 1, reach * both[token])

    walk(list(context), 0, 1.0)
    return out


def observed_joint(rows, vocab: int, length: int = LENGTH) -> np.ndarray:
    firsts = np.array([row.generated[:length] for row in rows], dtype=np.int64)
    counts = np.bincount(np.ravel_multi_index(tuple(firsts.T), (vocab,) * length), minlength=vocab**length)
    return (counts / len(rows)).reshape((vocab,) * length)


def target_law(engine: PrefixEngine, params):
    return lambda prefix: probabilities(engine.logits_after(prefix)[None], params)[0]


def assert_follows_prefix_target(rows, first: DraftCounts, law, context: list[int], draft_law, depth: int):
    """The output's laws (x_1; x_1, x_2; x_1..x_3; all four; x_3, x_4) are the target's within sampling noise, the
    first step drafted ``depth`` tokens in every row and accepted each position as often as the exact value says,
    and multi-token drafts were both accepted and rejected."""
    n, vocab = len(rows), len(law(context))
    exact, observed = exact_joint(law, context, vocab), observed_joint(rows, vocab)
    for axes in ((1, 2, 3), (2, 3), (3,), (), (0, 1)):
        marginal = exact.sum(axes) if axes else exact
        got = observed.sum(axes) if axes else observed
        assert total_variation(got, marginal) < tv_bound(marginal, n), f"law of the tokens but {axes}"
    acceptance = exact_acceptance(law, draft_law, context, vocab, depth, races=drawn_by_races(rows))
    assert first.drafted[:depth].tolist() == [n] * depth and len(first.drafted) == depth, first.drafted
    assert np.abs(first.accepted[:depth] / n - acceptance).max() < rate_bound(n), (first.accepted / n, acceptance)
    assert DraftCounts.of(rows).multi_token_steps_decided_both_ways()
