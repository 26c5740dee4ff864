"""Prompt-lookup drafting: propose the tokens that followed the latest earlier occurrence of the last n tokens.

No draft model: proposals cost microseconds, so any acceptance is profit. Strong when the output copies its input
(code edits, retrieval-augmented answers), useless for free text. A proposal is a point mass (q(x) = 1), so the
acceptance rule stays exact: accept with probability p(x), else sample from norm(max(0, p - q)).
"""

from __future__ import annotations

import numpy as np

from runtime.decoding.drafter import Drafter, Proposal
from runtime.decoding.sampling import SamplingParams, point_masses


def lookup(history: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens following the most recent earlier match of the longest suffix n-gram (n = max..min)."""
    if k <= 0:
        return []
    size = len(history)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = history[size - n :]
        for start in range(size - n - 1, -1, -1):  # latest match first, never the suffix itself
            if history[start : start + n] == suffix:
                follow = history[start + n : start + n + k]
                if follow:
                    return follow
    return []


class PromptLookupDrafter(Drafter):
    calls_draft_engine = False  # n-gram matches: no model

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram

    def start(self, prompts: list[list[int]]) -> None:
        self.history = [list(p) for p in prompts]

    def propose(self, limits: list[int], params: SamplingParams, rngs: list) -> Proposal:
        tokens = [lookup(h, limit, self.max_ngram, self.min_ngram) for h, limit in zip(self.history, limits)]
        return Proposal(tokens, [point_masses(t, self.vocab_size, params) for t in tokens])

    def settle(self, accepted: list[int], emitted: list[list[int]]) -> None:
        self.observe(emitted)

    def observe(self, emitted: list[list[int]]) -> None:
        for history, out in zip(self.history, emitted):
            history.extend(out)

    def keep_rows(self, rows: np.ndarray) -> None:
        self.history = [self.history[r] for r in rows]
