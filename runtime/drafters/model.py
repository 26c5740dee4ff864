"""The draft-model drafter: a smaller model of the target's family with its own KV cache, and the per-row draws
every model drafter (this one and the feature drafter) makes from a draft call's logits."""

from __future__ import annotations

import numpy as np

from runtime.decoding.calls import last_logits
from runtime.decoding.drafter import Drafter, Proposal
from runtime.engines.base import Engine
from runtime.decoding.grammar import constrain
from runtime.decoding.sampling import SamplingParams, next_token, point_masses, top_probability


class SamplingDrafter(Drafter):
    """A drafter that draws from a draft engine's logits: its draws are masked by the rows' grammars, and it drafts
    on after grammar-forced tokens (both model drafters: this module's and the feature drafter)."""

    grammars: list | None = None  # per row, the GrammarRow its draws are masked by (None: none)
    takes_prefixes = True  # propose() continues given draft tokens (grammar-forced ones) instead of starting afresh

    def constrain_rows(self, grammars: list) -> None:
        self.grammars = grammars


class ModelDrafter(SamplingDrafter):
    """A draft model with its own KV cache."""

    def __init__(self, engine: Engine, confidence: float = 0.0):
        self.engine = engine
        self.confidence = confidence
        self.calls = 0

    def start(self, prompts: list[list[int]]) -> None:
        self.cache = self.engine.new_cache(len(prompts))
        self.pending = [list(p) for p in prompts]  # tokens the draft has not been fed yet

    def _feed(self, chunks: list[list[int]]) -> np.ndarray:
        """Feed one chunk per row; returns the logits after each row's last token [B, V] (junk for empty rows)."""
        self.calls += 1
        return last_logits(self.engine, self.cache, chunks)

    def propose(
        self, limits: list[int], params: SamplingParams, rngs: list, prefixes: list[list[int]] | None = None
    ) -> Proposal:
        """Up to limits[b] draft tokens per row; with ``prefixes``, row b's draft starts with prefixes[b] (fixed
        tokens, point masses: the grammar forces them), fed to the draft model with its pending tokens, and the
        model drafts on from there."""
        rows = len(limits)
        prefixes = prefixes or [[] for _ in range(rows)]
        tokens: list[list[int]] = [list(p) for p in prefixes]
        probs: list[list] = [point_masses(p, self.engine.vocab_size, params) for p in prefixes]
        active = [limit > len(p) for limit, p in zip(limits, prefixes)]
        self.base = self.cache.lengths.copy()
        self.fed = [len(p) if a else 0 for p, a in zip(prefixes, active)]
        chunks = [list(pending) + list(p) if a else [] for pending, p, a in zip(self.pending, prefixes, active)]
        self.fed_pending = list(active)
        while any(active):
            logits = self._feed(chunks)
            drawn = draw_rows(logits, active, tokens, probs, limits, params, rngs, self.confidence, self.grammars)
            chunks = [[] if token is None else [token] for token in drawn]
            self.fed = [fed + (token is not None) for fed, token in zip(self.fed, drawn)]
        return Proposal(tokens, probs)

    def settle(self, accepted: list[int], emitted: list[list[int]]) -> None:
        keep = self.cache.lengths.copy()
        for b, (n, out) in enumerate(zip(accepted, emitted)):
            if not self.fed_pending[b]:  # this row drafted nothing: its pending tokens wait, plus what it emitted
                self.pending[b] = self.pending[b] + out
                continue
            fed = self.fed[b]
            keep[b] = self.base[b] + len(self.pending[b]) + min(n, fed)
            # accepted draft tokens the draft never saw as input, then the recovered/bonus token
            self.pending[b] = out[min(n, fed) :]
        self.engine.rollback(self.cache, keep)

    def observe(self, emitted: list[list[int]]) -> None:
        self.pending = [p + out for p, out in zip(self.pending, emitted)]

    def backlog(self) -> list[int]:
        return [len(p) for p in self.pending]

    def keep_rows(self, rows: np.ndarray) -> None:
        self.cache = self.engine.select(self.cache, rows)
        self.pending = [self.pending[r] for r in rows]


def draw_rows(
    logits: np.ndarray,
    active: list[bool],
    tokens: list[list[int]],
    probs: list[list],
    limits: list[int],
    params: SamplingParams,
    rngs: list,
    confidence: float = 0.0,
    grammars: list | None = None,
) -> list[int | None]:
    """``draw_next`` for every active row of a draft call's logits [B, V]; rows that stop become inactive. Returns
    each row's token to feed the draft next (None: nothing). With ``grammars``, a row that has one draws from its
    logits masked by the grammar (q is then a law over allowed tokens), and stops where its output is complete."""
    drawn: list[int | None] = [None] * len(active)
    for b in np.flatnonzero(active):
        row_logits = logits[b]
        if grammars is not None and grammars[b] is not None:
            mask = grammars[b].mask_after(tokens[b])
            if mask is None or not mask.any() or (tokens[b] and grammars[b].stopped):
                active[b] = False
                continue
            row_logits = constrain(row_logits, mask)
        drawn[b] = draw_next(row_logits, tokens[b], probs[b], limits[b], params, rngs[b], confidence)
        active[b] = drawn[b] is not None
    return drawn


def draw_next(
    logits: np.ndarray, tokens: list[int], probs: list, limit: int, params: SamplingParams, rng, confidence: float = 0.0
) -> int | None:
    """A draft row's next token from its logits, appended with its q to ``tokens``/``probs``; returns the token to
    feed the draft next, or None when the row stops: at its limit, or unsure (top probability under ``confidence``,
    after its first token), when what it has goes to verification."""
    if confidence and tokens and top_probability(logits) < confidence:
        return None
    token, q = next_token(logits, params, rng)
    tokens.append(token)
    probs.append(q)
    return token if len(tokens) < limit else None
