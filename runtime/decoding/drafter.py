"""The drafter contract: what the decode step (runtime/decoding/step.py) asks of every drafter.

It lives here, beside the step and planner that call it, and not in runtime/drafters/: every drafter builds on
decoding (sampling, calls, grammar), so the contract belongs to the layer below them and decoding never imports a
drafter (tests/test_folder_graph.py: no circle between folders).

One base class instead of a Protocol plus probes: every capability a drafter may have is declared here with the
default a drafter without it gets, so the step calls each hook unconditionally and a new drafter overrides only what
it does (llama.cpp's common_speculative and vLLM's proposer interface work the same way).

Per step, for the rows one drafter serves: ``propose`` up to limits[b] tokens per row (with their draft
probabilities q, or point masses for model-free drafters, so rejection sampling stays exact); the target scores
them; ``take_features`` hands over the target's hidden states of that call; then either ``settle`` (the drafter
proposed this step) or ``observe`` (it did not); ``keep_rows`` when rows leave.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.decoding.sampling import SamplingParams


@dataclass
class Proposal:
    tokens: list[list[int]]  # per row: x_1..x_d
    probs: list[list[np.ndarray | None]]  # per row: q_1..q_d (None when greedy)

    @classmethod
    def empty(cls, rows: int) -> "Proposal":
        """No draft tokens for any of ``rows`` rows."""
        return cls([[] for _ in range(rows)], [[] for _ in range(rows)])


class Drafter:
    """Base of every drafter; the hooks after the first five are optional capabilities with their defaults."""

    reads_features = False  # take_features receives the target's final hidden states (a feature draft)
    calls_draft_engine = True  # its drafts cost draft-engine calls (False: model-free; the step plan charges none)
    takes_prefixes = False  # propose(prefixes=...) drafts on after given tokens (grammar-forced ones)

    def start(self, prompts: list[list[int]]) -> None:
        """Take the prompts; the drafter sees every prompt token."""
        raise NotImplementedError

    def propose(
        self, limits: list[int], params: SamplingParams, rngs: list, prefixes: list[list[int]] | None = None
    ) -> Proposal:
        """Up to limits[b] tokens for each row; ``prefixes`` only where ``takes_prefixes``."""
        raise NotImplementedError

    def settle(self, accepted: list[int], emitted: list[list[int]]) -> None:
        """After verification: row b kept accepted[b] draft tokens; emitted[b] is everything it emitted."""
        raise NotImplementedError

    def observe(self, emitted: list[list[int]]) -> None:
        """A step ran without drafting (fallback, or no room to draft): remember what it emitted."""
        raise NotImplementedError

    def keep_rows(self, rows: np.ndarray) -> None:
        """Drop finished rows."""
        raise NotImplementedError

    def take_features(self, rows: list[np.ndarray] | None) -> None:
        """The target's hidden states [n_b, H] of the tokens its last call fed, per row (None: the engine returns
        none). Called after the prefill and after every target call; ignored unless ``reads_features``."""

    def use_costs(self, costs) -> None:
        """The measured call costs of the target and draft calls (runtime.decoding.step_costs.CostModel), given
        once by the loop that plans its steps by them; ignored unless the drafter chooses by cost (the hybrid)."""

    def constrain_rows(self, grammars: list) -> None:
        """Per row, the GrammarRow its draws must be masked by (None: unconstrained). Model-free drafters propose
        text, which the step cuts at the grammar's first refusal, so they ignore it."""

    def backlog(self) -> list[int] | None:
        """Per row, the tokens its next draft call feeds before the first draft token: the bonus token after a
        drafting step, every token since it last drafted otherwise (its prompt, the first time). The step plan
        charges that catch-up (runtime/decoding/step_costs.py); 0 where the row's next proposal costs no draft call
        (a hybrid's free source has one). None: no draft engine to catch up."""
        return None

    def can_draft(self) -> list[bool] | None:
        """Per row, whether it can still propose: False for good where a row has outgrown what the drafter holds (a
        cross-tokenizer draft whose context its text no longer fits), so the planners stop giving it a draft length
        and its steps are plain target steps. None: every row can."""
        return None
