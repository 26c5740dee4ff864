"""A draft model with a tokenizer of its own: drafting for a target of another family (runtime/text/vocab_bridge.py).

Two lossless methods (Timor et al., ICML 2025, "Accelerating LLM inference with lossless speculative decoding
algorithms for heterogeneous vocabularies"):

- ``tli`` (token-level intersection): the draft's law restricted to the tokens both vocabularies hold, warped as the
  target's is, and written over the target's ids with zero mass elsewhere. The target verifies it with the usual
  rejection sampling, which is exact for any q the tokens were really drawn from: greedy and sampled decoding alike.
- ``string`` (string-level exact match): the draft writes its greedy continuation as text, the target's tokenizer
  cuts it into target tokens, and those are proposed as point masses. Verification then keeps a token exactly when
  it is the target's own choice (its argmax, or under sampling what rejection sampling of a point mass keeps: the
  target's law), so it is lossless whatever the draft wrote; the draft only decides how far a step gets.

The target's committed tokens are the only state of record. The draft's cache holds draft tokens whose text is a
prefix of the committed text; committed bytes it has not read yet wait in ``unfed`` and are re-tokenized for the
draft when it next drafts. After a step, the draft keeps the tokens it drafted as far as their bytes are a prefix of
what the step committed, and rolls back the rest.

The two tokenizers count the same text differently, so a row's text can outgrow the draft's context while the
target's still has room. Such a row is done drafting for good (``can_draft``): its unread text is dropped, never
re-tokenized again, and the planners give it no draft length.
"""

from __future__ import annotations

import numpy as np

from runtime.decoding.calls import last_logits
from runtime.decoding.grammar import constrain
from runtime.decoding.sampling import SamplingParams, point_masses, top_probability
from runtime.decoding.drafter import Drafter, Proposal
from runtime.drafters.model import draw_next
from runtime.text.vocab_bridge import VocabBridge, split_utf8

METHODS = ("tli", "string")


class CrossVocabDrafter(Drafter):
    """A draft engine over its own vocabulary, proposing target tokens by ``method`` (METHODS)."""

    def __init__(self, engine, bridge: VocabBridge, method: str, target_vocab: int, confidence: float = 0.0):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, received {method!r}")
        self.engine, self.bridge, self.method = engine, bridge, method
        self.target_vocab, self.confidence = target_vocab, confidence
        self.grammars: list | None = None
        self.calls = 0
        draft_ids = np.flatnonzero(bridge.draft_to_target[: engine.vocab_size] >= 0)
        target_ids = bridge.draft_to_target[draft_ids]
        keep = target_ids < target_vocab
        self._shared_draft, self._shared_target = draft_ids[keep], target_ids[keep]

    def start(self, prompts: list[list[int]]) -> None:
        self.cache = self.engine.new_cache(len(prompts))
        self.unfed = [self.bridge.bytes_of(p) for p in prompts]  # committed bytes the draft has not read
        self.fed: list[list[int]] = [[] for _ in prompts]  # per row: draft tokens it drafted and fed this step
        self.context = [0] * len(prompts)  # per row: draft tokens of committed text fed this step
        self.full = [False] * len(prompts)  # per row: its text outgrew the draft's context (done drafting)
        self.base = self.cache.lengths.copy()

    def can_draft(self) -> list[bool]:
        return [not full for full in self.full]

    def constrain_rows(self, grammars: list) -> None:
        self.grammars = grammars

    # --- proposing ------------------------------------------------------------------------------------------------

    def propose(
        self, limits: list[int], params: SamplingParams, rngs: list, prefixes: list[list[int]] | None = None
    ) -> Proposal:
        """Up to limits[b] target tokens per row: the committed text the draft has not read is fed first, then the
        draft drafts (a row whose text ends inside a character, or whose draft context is full, drafts nothing)."""
        rows = len(limits)
        self.base = self.cache.lengths.copy()
        self.fed = [[] for _ in range(rows)]
        chunks, drafts = self._context_chunks(limits), [[] for _ in range(rows)]
        active = [bool(chunk) and limit > 0 for chunk, limit in zip(chunks, limits)]
        chunks = [chunk if a else [] for chunk, a in zip(chunks, active)]
        self.context = [len(chunk) for chunk in chunks]
        tokens: list[list[int]] = [[] for _ in range(rows)]
        probs: list[list] = [[] for _ in range(rows)]
        budget = [limit + 1 if self.method == "string" else limit for limit in limits]  # see _string_proposal
        while any(active):
            self.calls += 1
            logits = last_logits(self.engine, self.cache, chunks)
            chunks = [[] for _ in range(rows)]
            for b in np.flatnonzero(active):
                token = self._draw(b, logits[b], tokens[b], probs[b], drafts[b], budget[b], params, rngs[b])
                if token is None:
                    active[b] = False
                else:
                    chunks[b] = [token]
                    self.fed[b].append(token)
        if self.method == "string":
            tokens = [
                self._string_proposal(draft, limit, len(draft) >= cap)
                for draft, limit, cap in zip(drafts, limits, budget)
            ]
            probs = [point_masses(t, self.target_vocab, params) for t in tokens]
        return Proposal(tokens, probs)

    def _context_chunks(self, limits: list[int]) -> list[list[int]]:
        """Per row, the draft tokens of the committed text it has not read (whole characters only); [] where the
        row does not draft this step (its limit is 0, its text ends inside a character, its context is full). A
        row whose unread text leaves no room for even one draft token is full for good (``full``): the committed
        text only grows, so it is never tokenized for the draft again."""
        chunks = []
        for b, limit in enumerate(limits):
            text, carry = split_utf8(self.unfed[b])
            chunk = self.bridge.draft_ids(text) if limit > 0 and not carry and not self.full[b] else []
            room = self.engine.max_context - int(self.cache.lengths[b]) - len(chunk) - 1
            if room < 1:
                self.full[b], self.unfed[b] = True, b""
            chunks.append(chunk if room >= limit else [])
        return chunks

    def _draw(
        self,
        b: int,
        logits: np.ndarray,
        tokens: list[int],
        probs: list,
        drafted: list[int],
        budget: int,
        params: SamplingParams,
        rng,
    ) -> int | None:
        """Row b's next draft token (a draft id to feed the draft next), or None when it stops."""
        if self.method == "string":  # the draft's greedy choice: any text is lossless under exact match
            if self.confidence and drafted and top_probability(logits) < self.confidence:
                return None  # unsure: what it has goes to verification
            token = int(np.argmax(logits[: self.engine.vocab_size]))
            drafted.append(token)
            return token if len(drafted) < budget else None
        shared = np.full(self.target_vocab, -np.inf, np.float32)
        shared[self._shared_target] = logits[self._shared_draft]
        grammar = None if self.grammars is None else self.grammars[b]
        if grammar is not None:
            mask = grammar.mask_after(tokens)
            if mask is None or not mask.any() or (tokens and grammar.stopped):
                return None
            shared = constrain(shared, mask)
        if not np.isfinite(shared).any():
            return None
        target_token = draw_next(shared, tokens, probs, budget, params, rng, self.confidence)
        return None if target_token is None else int(self.bridge.target_to_draft[target_token])

    def _string_proposal(self, drafted: list[int], limit: int, full: bool = True) -> list[int]:
        """The draft's text as the target tokenizes it, up to ``limit`` tokens. The draft wrote one token more than
        the limit and the last target token is dropped: the target would cut the text's end differently once more
        text follows (kept where the draft stopped early, unsure: ``full`` False)."""
        text, _ = split_utf8(self.bridge.draft_bytes_of(drafted))
        ids = self.bridge.target_ids(text)
        ids = [t for t in (ids[:-1] if full else ids) if t < self.target_vocab]
        return ids[:limit]

    # --- after verification -----------------------------------------------------------------------------------------

    def settle(self, accepted: list[int], emitted: list[list[int]]) -> None:
        """Keep each row's context chunk (committed text) and its fed draft tokens as far as their bytes are a prefix
        of what the step committed; the rest of the committed bytes wait for the next draft call."""
        keep = self.cache.lengths.copy()
        for b, out in enumerate(emitted):
            committed = self.bridge.bytes_of(out)
            if not self.context[b]:  # the row fed nothing this step
                self.unfed[b] = b"" if self.full[b] else self.unfed[b] + committed
                continue
            kept, matched = 0, 0
            for token in self.fed[b]:
                piece = self.bridge.draft_bytes[token]
                if committed[matched : matched + len(piece)] != piece:
                    break
                kept, matched = kept + 1, matched + len(piece)
            keep[b] = self.base[b] + self.context[b] + kept
            self.unfed[b] = committed[matched:]
        self.engine.rollback(self.cache, keep)

    def observe(self, emitted: list[list[int]]) -> None:
        self.unfed = [
            b"" if full else unfed + self.bridge.bytes_of(out)
            for unfed, out, full in zip(self.unfed, emitted, self.full)
        ]

    def keep_rows(self, rows: np.ndarray) -> None:
        self.cache = self.engine.select(self.cache, rows)
        self.unfed = [self.unfed[r] for r in rows]
        self.full = [self.full[r] for r in rows]
        self.fed = [self.fed[r] for r in rows]
        self.context = [self.context[r] for r in rows]
        self.base = self.base[rows]
