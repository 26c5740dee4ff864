"""The hybrid drafter: a model-free drafter where its proposal pays, the draft model elsewhere."""

from __future__ import annotations

import numpy as np

from runtime.decoding.drafter import Drafter, Proposal
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.drafters.model import ModelDrafter
from runtime.decoding.sampling import SamplingParams
from runtime.decoding.step_costs import STEADY_BACKLOG, expected_tokens

PRIOR = 0.6  # a row's acceptance estimate of each source before it has drafted


class HybridDrafter(Drafter):
    """A model-free drafter where it proposes, the draft model elsewhere, chosen per row and per step. The free
    drafter is prompt lookup with an n-gram match of at least ``min_ngram`` tokens unless ``free`` gives another
    (runtime/drafters/suffix.py's, with a minimum score: the ``hybrid_suffix`` drafter).

    Why: a lookup proposal costs nothing, and where the text repeats its context it is accepted as often as the
    model's; where there is no match the model still drafts. Each row's proposal comes from one source with its own q
    (a point mass, or the model's distribution), so the acceptance rule stays exact row by row. The model drafter
    treats a row that looked up as a row that drafted nothing: it catches up on everything that row emitted the next
    time it drafts for it.

    Given the measured call costs (``use_costs``: the step plan's, runtime/decoding/step_costs.py), a row takes the
    free proposal only where it pays more than the model's: each source's expected tokens from the row's own
    acceptance of it (running estimates, ``rates``), over what the step would cost, the model's draft calls and the
    verify call of each width read from the measured curve. Without costs every row with a free proposal takes it.
    """

    def __init__(
        self, model: ModelDrafter, vocab_size: int, min_ngram: int = 2, max_ngram: int = 3, free: Drafter | None = None
    ):
        self.model = model
        self.free = (
            free if free is not None else PromptLookupDrafter(vocab_size, max_ngram=max_ngram, min_ngram=min_ngram)
        )
        self.looked_up = self.proposed = 0  # rows whose proposal came from the free drafter / all proposing rows
        self.costs = None  # the measured call costs (use_costs); None: the free proposal wherever there is one

    def use_costs(self, costs) -> None:
        self.costs = costs

    def start(self, prompts: list[list[int]]) -> None:
        self.model.start(prompts)
        self.free.start(prompts)
        self.rates = [[PRIOR, PRIOR] for _ in prompts]  # per row: acceptance of the free source, of the model
        self.sources: list[tuple[bool, int]] = []  # per row this step: (free?, tokens proposed)

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
        look up first, and take the free proposal wherever the model would first have to catch up (what the step
        plan priced them at: ``backlog``), else where it pays more than the model's."""
        prefixes = prefixes or [[] for _ in limits]
        found = self.free.propose([0 if p else limit for p, limit in zip(prefixes, limits)], params, rngs)
        behind = self.model.backlog() or [0] * len(limits)
        pick = [
            bool(t) and (behind[b] > STEADY_BACKLOG or self.free_pays(b, len(t), limits))
            for b, t in enumerate(found.tokens)
        ]
        model_limits = [0 if p else limit for p, limit in zip(pick, limits)]
        drafted = (
            self.model.propose(model_limits, params, rngs, prefixes=prefixes)
            if any(prefixes)
            else self.model.propose(model_limits, params, rngs)
        )
        self.looked_up += sum(pick)
        self.proposed += sum(1 for limit in limits if limit > 0)
        tokens = [f if p else d for f, d, p in zip(found.tokens, drafted.tokens, pick)]
        self.sources = [(p, len(t)) for p, t in zip(pick, tokens)]
        return Proposal(tokens, [f if p else d for f, d, p in zip(found.probs, drafted.probs, pick)])

    def free_pays(self, b: int, length: int, limits: list[int]) -> bool:
        """Whether row ``b``'s free proposal of ``length`` tokens makes more tokens a second than the model's best
        draft within its limit would, by the measured costs (True without them)."""
        costs = self.costs
        if costs is None or not costs.calibrated:
            return True
        rows = len(limits)
        free_rate, model_rate = self.rates[b]

        def per_second(tokens: float, drafted: int, by_model: bool) -> float:
            draft = drafted * costs.draft_cost(rows) if by_model else 0.0
            return tokens / max(draft + costs.call_cost([drafted + 1] * rows), 1e-9)

        free = per_second(expected_tokens(free_rate, length), length, False)
        model = max((per_second(expected_tokens(model_rate, k), k, True) for k in range(1, limits[b] + 1)), default=0.0)
        return free >= model

    def take_features(self, rows) -> None:
        """A feature drafter as the model: it pairs every step's target hidden states, whoever drafted."""
        self.model.take_features(rows)

    def settle(self, accepted: list[int], emitted: list[list[int]]) -> None:
        for b, ((free, drafted), n) in enumerate(zip(self.sources, accepted)):
            if drafted:  # the source's acceptance estimate for this row moves a fifth of the way to this step's
                self.rates[b][0 if free else 1] = 0.8 * self.rates[b][0 if free else 1] + 0.2 * n / drafted
        self.sources = []
        self.free.settle(accepted, emitted)
        self.model.settle(accepted, emitted)

    def observe(self, emitted: list[list[int]]) -> None:
        self.free.observe(emitted)
        self.model.observe(emitted)

    def backlog(self) -> list[int] | None:
        """The model's backlog, 0 where the free drafter has a proposal now (that row's draft then costs no call;
        the model catches up when it next drafts it)."""
        backlog = self.model.backlog()
        if backlog is None:
            return None
        found = self.free.propose([1] * len(backlog), SamplingParams(), [None] * len(backlog))
        return [0 if tokens else n for tokens, n in zip(found.tokens, backlog)]

    def keep_rows(self, rows: np.ndarray) -> None:
        self.rates = [self.rates[r] for r in rows]
        self.free.keep_rows(rows)
        self.model.keep_rows(rows)
