"""The feature drafter: a one-layer draft engine that drafts from the target's own final hidden states (EAGLE-style;
builder/distill/feature_draft.py trains it).

The draft's cache holds one entry per pair (f_j, t_{j+1}): the target's hidden state after token j and the token
that followed. Every target call returns the hidden states of the tokens it fed (``cache.extra["hidden"]``); the
loop hands them over with ``take_features`` before ``settle``/``observe``, which pair them with the emitted tokens:
a verify call fed [last, x_1..x_d] and emitted x_1..x_n, e, so the new pairs are (h(last), x_1) .. (h(x_n), e),
whoever drafted. ``propose`` feeds the pending true pairs in one call; its output at the last pair is the draft's
prediction of the next hidden state, which with the sampled token forms the next pair, and so on for the rest of
the draft. ``settle`` rolls the cache back to the true pairs: run-time entries made from predicted features never
stay. The proposal carries the draft's distribution q, so the acceptance rule stays exact.
"""

from __future__ import annotations

import numpy as np

from runtime.decoding.calls import last_logits, padded
from runtime.decoding.drafter import Proposal
from runtime.drafters.model import SamplingDrafter, draw_rows
from runtime.decoding.sampling import SamplingParams, point_masses


class FeatureDrafter(SamplingDrafter):
    reads_features = True

    def __init__(self, engine, confidence: float = 0.0):
        if not engine.takes_features:
            raise ValueError("the feature drafter needs a feature draft engine (draftsmith distill --init feature)")
        self.engine, self.confidence = engine, confidence
        self.calls = 0

    def start(self, prompts: list[list[int]]) -> None:
        self.cache = self.engine.new_cache(len(prompts))
        self.tokens = [list(p[1:]) for p in prompts]  # tokens of the pairs not fed yet; their features follow
        self.features: list[list[np.ndarray]] = [[] for _ in prompts]
        self.fresh: list[np.ndarray] | None = None
        self.base = self.cache.lengths.copy()
        self.fed = [False] * len(prompts)
        self.awaiting_prefill = True

    def take_features(self, rows: list[np.ndarray] | None) -> None:
        """The target's hidden states [n_b, H] of the tokens its last call fed, per row. The first call after
        ``start`` brings the prefill's (prompt[:-1], None when no prompt needed one): they pair with prompt[1:]."""
        if self.awaiting_prefill:
            self.awaiting_prefill = False
            for b, h in enumerate(rows or []):
                self.features[b] = [h[: len(self.tokens[b])]]
            return
        if rows is None:
            raise ValueError("the target engine returns no hidden states; rebuild the bundle with this Draftsmith")
        self.fresh = rows

    def _pending(self, b: int) -> np.ndarray | None:
        parts = [f for f in self.features[b] if len(f)]
        return np.concatenate(parts) if parts else None

    def propose(
        self, limits: list[int], params: SamplingParams, rngs: list, prefixes: list[list[int]] | None = None
    ) -> Proposal:
        """Up to limits[b] draft tokens per row; with ``prefixes``, row b's draft starts with prefixes[b] (point
        masses: the grammar forces them), each fed through the chain with the draft's own predicted feature, as a
        drawn token would be, and the draft draws on from there."""
        rows = len(limits)
        prefixes = prefixes or [[] for _ in range(rows)]
        tokens: list[list[int]] = [list(p) for p in prefixes]
        probs: list[list] = [point_masses(p, self.engine.vocab_size, params) for p in prefixes]
        pending = [self._pending(b) for b in range(rows)]
        active = [
            limit > len(prefixes[b]) and pending[b] is not None and len(pending[b]) == len(self.tokens[b])
            for b, limit in enumerate(limits)
        ]
        self.fed = list(active)
        self.base = self.cache.lengths.copy()
        if not any(active):
            return Proposal(tokens, probs)
        chunks = [self.tokens[b] if a else [] for b, a in enumerate(active)]
        feats = [pending[b] if a else None for b, a in enumerate(active)]
        logits, predicted = self._feed(chunks, feats)
        self.base = self.cache.lengths.copy()  # the true pairs stay; what follows is rolled back in settle
        step = 0
        while True:
            forcing = [a and step < len(prefixes[b]) for b, a in enumerate(active)]
            drawing = [a and not f for a, f in zip(active, forcing)]
            drawn = draw_rows(logits, drawing, tokens, probs, limits, params, rngs, self.confidence, self.grammars)
            nexts = [prefixes[b][step] if forcing[b] else drawn[b] for b in range(rows)]
            active = [a and token is not None for a, token in zip(active, nexts)]
            if not any(active):
                return Proposal(tokens, probs)
            chunks = [[token] if a else [] for token, a in zip(nexts, active)]
            feats = [predicted[b][None] if a else None for b, a in enumerate(active)]
            logits, predicted = self._feed(chunks, feats)
            step += 1

    def _feed(self, chunks: list[list[int]], feats: list[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray]:
        """One draft call; returns each row's logits [B, V] and predicted hidden state [B, H] at its last token."""
        ids, valid = padded(chunks)
        hidden = next(f for f in feats if f is not None).shape[-1]
        features = np.zeros(ids.shape + (hidden,), np.float32)
        for b, f in enumerate(feats):
            if f is not None:
                features[b, : len(f)] = f
        logits = last_logits(self.engine, self.cache, chunks, features=features)
        self.calls += 1
        last = np.maximum(valid.sum(axis=1) - 1, 0)
        return logits, self.cache.extra["hidden"][np.arange(len(chunks)), last]

    def settle(self, accepted: list[int], emitted: list[list[int]]) -> None:
        self.engine.rollback(self.cache, self.base)
        for b in range(len(emitted)):
            if self.fed[b]:
                self.tokens[b], self.features[b] = [], []
        self.observe(emitted)

    def observe(self, emitted: list[list[int]]) -> None:
        if self.fresh is None or len(self.fresh) != len(emitted):
            raise ValueError("the feature drafter was not given the target's hidden states for this step")
        for b, out in enumerate(emitted):
            self.tokens[b] = self.tokens[b] + list(out)
            self.features[b].append(self.fresh[b][: len(out)])
        self.fresh = None

    def backlog(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def keep_rows(self, rows: np.ndarray) -> None:
        self.cache = self.engine.select(self.cache, rows)
        self.base = self.cache.lengths.copy()
        self.tokens = [self.tokens[r] for r in rows]
        self.features = [self.features[r] for r in rows]
