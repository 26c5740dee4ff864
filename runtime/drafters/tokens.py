"""The drafter of a draft engine that returns tokens (runtime/engines/base.py ``returns_tokens``): a TensorRT-LLM
draft engine, whose executor decodes a row's k greedy tokens in one request, as upstream's draft-target runner
drafts (examples/ngram/run_dtm_ngram.py). It gives no probabilities, so its drafts are point masses: exact under a
greedy target, which is all an engine that verifies them (``speculation`` "verifies") decodes."""

from __future__ import annotations

import numpy as np

from runtime.decoding.drafter import Drafter, Proposal
from runtime.decoding.sampling import SamplingParams, point_masses
from runtime.engines.base import Engine


class TokenDrafter(Drafter):
    """Drafts with one ``generate_tokens`` call a step; its cache holds what the draft engine has seen
    (``pending``: what it has not yet)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def start(self, prompts: list[list[int]]) -> None:
        self.cache = self.engine.new_cache(len(prompts))
        self.pending = [list(p) for p in prompts]

    def propose(
        self, limits: list[int], params: SamplingParams, rngs: list, prefixes: list[list[int]] | None = None
    ) -> Proposal:
        """Up to limits[b] greedy tokens per row in one call; every row's pending tokens go in with it."""
        self.base = self.cache.lengths.copy()
        self.fed = [len(p) for p in self.pending]
        tokens = self.engine.generate_tokens(self.cache, self.pending, [[] for _ in limits], list(limits))
        self.pending = [[] for _ in limits]
        return Proposal(tokens, [point_masses(t, self.engine.vocab_size, params) for t in tokens])

    def settle(self, accepted: list[int], emitted: list[list[int]]) -> None:
        """The cache keeps each row's accepted draft tokens that the engine took in (all but its last draft token);
        the rest of what the step emitted waits to go in with the next call."""
        drafted = self.cache.lengths - self.base - np.array(self.fed)  # draft tokens in the cache: d - 1 (or 0)
        kept = np.minimum(np.array(accepted), drafted)
        self.engine.rollback(self.cache, self.base + np.array(self.fed) + kept)
        self.pending = [out[int(k) :] for out, k in zip(emitted, kept)]

    def observe(self, emitted: list[list[int]]) -> None:
        self.pending = [p + out for p, out in zip(self.pending, emitted)]

    def keep_rows(self, rows: np.ndarray) -> None:
        self.cache = self.engine.select(self.cache, rows)
        self.pending = [self.pending[r] for r in rows]
