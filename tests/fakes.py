"""A scripted engine: a bigram 'language model' with a tiny vocabulary, behind the same Engine interface.

Its KV cache is the slot tokens themselves, rolled back through the same live-slot mask as OnnxEngine, so the loop's
control flow, rollback and call counts are tested without ONNX models, and exact target distributions are known.
"""

from __future__ import annotations

import numpy as np

from runtime.engine import KVCache, live_keep_mask


class BigramEngine:
    def __init__(self, table: np.ndarray, max_context: int = 512):
        self.table = np.asarray(table, dtype=np.float64)  # [V, V]: logits of the next token given the previous one
        self.vocab_size = self.table.shape[0]
        self.max_context = max_context
        self.calls = 0
        self.tokens_fed = 0

    def new_cache(self, batch: int) -> KVCache:
        return KVCache([np.zeros((batch, 0), np.int64)], np.zeros((batch, 0), np.int64), np.zeros(batch, np.int64))

    def forward(self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
        valid = np.ones_like(tokens) if valid is None else valid
        cache.past = [np.concatenate([cache.past[0], tokens], axis=1)]
        cache.mask = np.concatenate([cache.mask, valid.astype(np.int64)], axis=1)
        cache.lengths = cache.lengths + valid.sum(axis=1)
        cache.calls += 1
        self.calls += 1
        self.tokens_fed += int(valid.sum())
        return self.table[tokens]  # each position's next-token logits depend on its own token only

    def rollback(self, cache: KVCache, keep: np.ndarray) -> None:
        cache.mask = live_keep_mask(cache.mask, keep)
        cache.lengths = np.minimum(cache.lengths, keep)

    def select(self, cache: KVCache, rows: np.ndarray) -> KVCache:
        return KVCache([cache.past[0][rows]], cache.mask[rows], cache.lengths[rows], cache.calls)

    def live_tokens(self, cache: KVCache, row: int) -> list[int]:
        return [int(t) for t, m in zip(cache.past[0][row], cache.mask[row]) if m]


def random_table(vocab: int, seed: int, scale: float = 1.5) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, scale, (vocab, vocab))


def pair_frequencies(rows, vocab: int) -> np.ndarray:
    """Observed frequencies of (first, second) generated token pairs over finished loop rows."""
    counts = np.zeros((vocab, vocab))
    for row in rows:
        counts[row.generated[0], row.generated[1]] += 1
    return counts / len(rows)
