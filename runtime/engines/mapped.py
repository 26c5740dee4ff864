"""A draft engine whose output head covers only some token ids (a reduced-vocabulary draft head), seen through the
contract as an engine over the full vocabulary."""

from __future__ import annotations

import numpy as np

from runtime.engines.base import Engine, EngineWrapper, KVCache


class MappedVocabEngine(EngineWrapper):
    """The wrapped engine returns logits [B, S, N] over ``kept_ids`` (column j is token kept_ids[j]); this one returns
    logits over the full vocabulary with -inf everywhere else. The draft's q is then exactly 0 outside the kept set,
    it proposes only kept tokens, and the acceptance rule (runtime.decoding.sampling) stays exact: the target's
    probability of any other token comes back through the residual max(0, p - q). Every other member is the wrapped
    engine's (``EngineWrapper``)."""

    def __init__(self, engine: Engine, kept_ids, vocab_size: int):
        kept = np.asarray(kept_ids, dtype=np.int64)
        if kept.ndim != 1 or not len(kept) or len(np.unique(kept)) != len(kept) or kept.min() < 0:
            raise ValueError("kept_ids must be a non-empty list of distinct non-negative token ids")
        if int(kept.max()) >= vocab_size:
            raise ValueError(f"kept id {int(kept.max())} is outside the vocabulary ({vocab_size} tokens)")
        super().__init__(engine)
        self.kept_ids = kept
        self.vocab_size = vocab_size  # may be lowered to the tokenizer's vocabulary, like any engine's

    def compute(self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None = None, **options):
        small = self.engine.compute(cache, tokens, valid, **options)
        if small is None:
            return None
        if small.shape[-1] != len(self.kept_ids):
            raise ValueError(
                f"the draft engine returned {small.shape[-1]} logits per position; its vocabulary map "
                f"has {len(self.kept_ids)} ids"
            )
        full = np.full(small.shape[:-1] + (self.vocab_size,), -np.inf, dtype=small.dtype)
        inside = self.kept_ids < self.vocab_size
        full[..., self.kept_ids[inside]] = small[..., inside]
        return full
