"""Prompt-lookup drafting: propose the tokens that followed the latest earlier occurrence of the last n tokens.

No draft model: proposals cost microseconds, so any acceptance is profit. Strong when the output copies its input
(code edits, retrieval-augmented answers), useless for free text. A proposal is a point mass (q(x) = 1), so the
acceptance rule stays exact: accept with probability p(x), else sample from norm(max(0, p - q)).
"""

from __future__ import annotations

import numpy as np

from runtime.sampling import SamplingParams, point_masses  # noqa: F401 (suffix.py imports it from here)
from runtime.speculative import Drafter, ModelDrafter, Proposal


def lookup(history: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens following the most recent earlier match of the longest suffix n-gram (n = max..min)."""
    if k <= 0:
        return []
    size = len(history)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = history[size - n:]
        for start in range(size - n - 1, -1, -1):  # latest match first, never the suffix itself
            if history[start: start + n] == suffix:
                follow = history[start + n: start + n + k]
                if follow:
                    return follow
    return []


class PromptLookupDrafter:
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


class HybridDrafter:
    """A model-free drafter where it proposes, the draft model elsewhere, chosen per row and per step. The free
    drafter is prompt lookup with an n-gram match of at least ``min_ngram`` tokens unless ``free`` gives another
    (runtime/suffix.py's, with a minimum score: the ``hybrid_suffix`` drafter).

    Why: a lookup proposal costs nothing, and where the text repeats its context it is accepted as often as the
    model's; where there is no match the model still drafts. Each row's proposal comes from one source with its own q
    (a point mass, or the model's distribution), so the acceptance rule stays exact row by row. The model drafter
    treats a row that looked up as a row that drafted nothing: it catches up on everything that row emitted the next
    time it drafts for it.
    """

    def __init__(self, model: ModelDrafter, vocab_size: int, min_ngram: int = 2, max_ngram: int = 3,
                 free: Drafter | None = None):
        self.model = model
        self.free = free if free is not None else PromptLookupDrafter(vocab_size, max_ngram=max_ngram,
                                                                       min_ngram=min_ngram)
        self.looked_up = self.proposed = 0  # rows whose proposal came from the free drafter / all proposing rows

    def start(self, prompts: list[list[int]]) -> None:
        self.model.start(prompts)
        self.free.start(prompts)

    @property
    def takes_prefixes(self) -> bool:
        """Grammar-forced tokens: the model drafts on after them (when it can)."""
        return getattr(self.model, "takes_prefixes", False)

    def propose(self, limits: list[int], params: SamplingParams, rngs: list,
                prefixes: list[list[int]] | None = None) -> Proposal:
        """A row with a prefix (grammar-forced tokens) goes to the model, which drafts on after it; the others
        look up first."""
        prefixes = prefixes or [[] for _ in limits]
        found = self.free.propose([0 if p else limit for p, limit in zip(prefixes, limits)], params, rngs)
        pick = [bool(t) for t in found.tokens]  # rows with a match take the lookup's proposal
        model_limits = [0 if p else limit for p, limit in zip(pick, limits)]
        drafted = (self.model.propose(model_limits, params, rngs, prefixes=prefixes) if any(prefixes)
                   else self.model.propose(model_limits, params, rngs))
        self.looked_up += sum(pick)
        self.proposed += sum(1 for limit in limits if limit > 0)
        return Proposal([f if p else d for f, d, p in zip(found.tokens, drafted.tokens, pick)],
                        [f if p else d for f, d, p in zip(found.probs, drafted.probs, pick)])

    def take_features(self, rows) -> None:
        """A feature drafter as the model: it pairs every step's target hidden states, whoever drafted."""
        if hasattr(self.model, "take_features"):
            self.model.take_features(rows)

    def settle(self, accepted: list[int], emitted: list[list[int]]) -> None:
        self.free.settle(accepted, emitted)
        self.model.settle(accepted, emitted)

    def observe(self, emitted: list[list[int]]) -> None:
        self.free.observe(emitted)
        self.model.observe(emitted)

    def keep_rows(self, rows: np.ndarray) -> None:
        self.free.keep_rows(rows)
        self.model.keep_rows(rows)
