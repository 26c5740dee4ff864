"""The hybrid drafter: a model-free drafter where it finds a proposal, the draft model elsewhere."""

from __future__ import annotations

import numpy as np

from runtime.drafters.base import Drafter, Proposal
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.drafters.model import ModelDrafter
from runtime.decoding.sampling import SamplingParams


class HybridDrafter(Drafter):
    """A model-free drafter where it proposes, the draft model elsewhere, chosen per row and per step. The free
    drafter is prompt lookup with an n-gram match of at least ``min_ngram`` tokens unless ``free`` gives another
    (runtime/drafters/suffix.py's, with a minimum score: the ``hybrid_suffix`` drafter).

    Why: a lookup proposal costs nothing, and where the text repeats its context it is accepted as often as the
    model's; where there is no match the model still drafts. Each row's proposal comes from one source with its own q
    (a point mass, or the model's distribution), so the acceptance rule stays exact row by row. The model drafter
    treats a row that looked up as a row that drafted nothing: it catches up on everything that row emitted the next
    time it drafts for it.
    """

    def __init__(
        self, model: ModelDrafter, vocab_size: int, min_ngram: int = 2, max_ngram: int = 3, free: Drafter | None = None
    ):
        self.model = model
        self.free = (
            free if free is not None else PromptLookupDrafter(vocab_size, max_ngram=max_ngram, min_ngram=min_ngram)
        )
        self.looked_up = self.proposed = 0  # rows whose proposal came from the free drafter / all proposing rows

    def start(self, prompts: list[list[int]]) -> None:
        self.model.start(prompts)
        self.free.start(prompts)

    @property
    def takes_prefixes(self) -> bool:
        """Grammar-forced tokens: the model drafts on after them (when it can)."""
        return self.model.takes_prefixes

    @property
    def reads_features(self) -> bool:
        return self.model.reads_features

    def constrain_rows(self, grammars: list) -> None:
        self.model.constrain_rows(grammars)

    def propose(
        self, limits: list[int], params: SamplingParams, rngs: list, prefixes: list[list[int]] | None = None
    ) -> Proposal:
        """A row with a prefix (grammar-forced tokens) goes to the model, which drafts on after it; the others
        look up first."""
        prefixes = prefixes or [[] for _ in limits]
        found = self.free.propose([0 if p else limit for p, limit in zip(prefixes, limits)], params, rngs)
        pick = [bool(t) for t in found.tokens]  # rows with a match take the lookup's proposal
        model_limits = [0 if p else limit for p, limit in zip(pick, limits)]
        drafted = (
            self.model.propose(model_limits, params, rngs, prefixes=prefixes)
            if any(prefixes)
            else self.model.propose(model_limits, params, rngs)
        )
        self.looked_up += sum(pick)
        self.proposed += sum(1 for limit in limits if limit > 0)
        return Proposal(
            [f if p else d for f, d, p in zip(found.tokens, drafted.tokens, pick)],
            [f if p else d for f, d, p in zip(found.probs, drafted.probs, pick)],
        )

    def take_features(self, rows) -> None:
        """A feature drafter as the model: it pairs every step's target hidden states, whoever drafted."""
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
