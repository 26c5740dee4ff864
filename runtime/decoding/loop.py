"""The draft-then-verify loop over engines, for a batch of sequences run to completion (the Python API's).

Per step: the drafter proposes d_b <= k tokens for each running row b; the target scores [last, x_1..x_d] for all
rows in one call; sampling.verify keeps n_b accepted tokens and adds one recovered or bonus token; both caches roll
back past the rejected slots (runtime/decoding/step.py executes it, the scheduler's step too). Rows finish
independently (EOS, budget, context, or the caller's stop) and leave the batch. Target-only decoding is the same loop
with d = 0 (no drafter calls). What is this loop's own: the batch-wide adaptive k and fallback that plan each step.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Iterator

import numpy as np

from runtime.decoding.calls import prefill
from runtime.decoding.config import DecodeConfig, row_generators
from runtime.decoding.step import DecodeRow, DraftGroup, StepPlan, StepResult, decode_step
from runtime.decoding.step_costs import CostModel, PlanInputs, plan_draft_lengths, with_probes
from runtime.drafters.base import Drafter
from runtime.engines.onnx import Engine, unpadded


class SpeculativeLoop:
    """Runs a batch to completion; ``run`` yields after every step the tokens each row emitted."""

    def __init__(
        self,
        target: Engine,
        drafter: Drafter | None,
        prompts: list[list[int]],
        config: DecodeConfig,
        costs: CostModel | None = None,
    ):
        self.target, self.drafter, self.config = target, drafter, config
        self.costs = costs  # measured call costs: each step's draft lengths are planned from them
        if drafter is not None and costs is not None and config.plan:
            drafter.use_costs(costs)  # a hybrid picks its source per row by them
        rngs = row_generators(config.seed, len(prompts))
        self.rows = [
            DecodeRow(index=i, prompt=list(p), config=config, rng=rng) for i, (p, rng) in enumerate(zip(prompts, rngs))
        ]
        self.k = config.k
        self.recent = deque(maxlen=config.fallback.window if config.fallback else 1)  # 1/0 per recent draft token
        self.fallback_steps_left = 0
        self.on_fallback = None  # callback(bool) when fallback state changes

    def finish(self, index: int, reason: str) -> None:
        """Stop a row from outside (e.g. a stop string matched)."""
        for row in self.rows:
            if row.index == index and not row.finished:
                row.finished = reason

    @property
    def in_fallback(self) -> bool:
        return self.fallback_steps_left > 0

    def run(self) -> Iterator[list[tuple[DecodeRow, list[int]]]]:
        """The batch's steps; with ``config.exact`` False the target's calls run unpadded (engines.onnx.unpadded)."""
        with contextlib.nullcontext() if self.config.exact else unpadded(self.target):
            yield from self._steps()

    def _steps(self) -> Iterator[list[tuple[DecodeRow, list[int]]]]:
        start = time.perf_counter()
        running = self.rows
        for row in running:
            row.started = start
        cache = self.target.new_cache(len(running))
        self._prefill(cache, running)
        while running:
            plan = self._plan(running)
            result = decode_step(
                self.target, cache, running, [DraftGroup(self.drafter, list(range(len(running))))], plan
            )
            self._learn(result, plan)
            yield [(row, new) for row, new in zip(running, result.new)]
            keep_rows = np.array([b for b, r in enumerate(running) if not r.finished], dtype=np.int64)
            if len(keep_rows) < len(running):
                running = [running[b] for b in keep_rows]
                if running:
                    cache = self.target.select(cache, keep_rows)
                    if self.drafter is not None:
                        self.drafter.keep_rows(keep_rows)

    def _prefill(self, cache, rows: list[DecodeRow]) -> None:
        """Everything but each prompt's last token (the first step feeds that one); the drafter sees the prompts
        and the prefill's hidden states."""
        if any(len(r.prompt) > 1 for r in rows):
            prefill(self.target, cache, [r.prompt[:-1] for r in rows])
        if self.drafter is not None:
            self.drafter.start([r.prompt for r in rows])
            hidden = cache.extra.get("hidden")
            self.drafter.take_features(
                None if hidden is None else [hidden[b, : len(r.prompt) - 1] for b, r in enumerate(rows)]
            )

    def _plan(self, rows: list[DecodeRow]) -> StepPlan:
        """Every row drafts up to k (within its budget and the context) unless the batch is in fallback; with
        measured costs, each row as far as pays (``planned``)."""
        limits = [self._draft_limit(r) for r in rows]
        usable = self.drafter.can_draft() if self.drafter is not None else None
        if usable is not None:  # rows the drafter is done with for good (can_draft) get no draft length
            limits = [limit if ok else 0 for limit, ok in zip(limits, usable)]
        drafting = self.drafter is not None and not self.in_fallback and any(limits)
        if drafting and self._plans_by_cost(rows):
            limits = self.planned(rows, limits)
            drafting = any(limits)
        return StepPlan(limits, [drafting], fallback=self.in_fallback)

    def _plans_by_cost(self, rows: list[DecodeRow]) -> bool:
        """Calibrated costs (any batch, a lone row too: k from the measured verify curve, 0 where drafting does not
        pay), and a text that does not depend on the plan: greedy, or sampled without a seed (a seeded sampled run
        keeps its fixed k, so the same seed gives the same text)."""
        params = self.config.params
        return (
            self.config.plan
            and self.costs is not None
            and self.costs.calibrated
            and (params.greedy or self.config.seed is None)
        )

    def planned(self, rows: list[DecodeRow], limits: list[int]) -> list[int]:
        """The draft lengths with the most expected tokens per second of the batch (step_costs), one drafter call
        drafting every row; a row kept from drafting drafts one token every PROBE_EVERY steps."""
        pad = getattr(self.target, "min_call_tokens", 1)
        ks = plan_draft_lengths(
            self.costs,
            PlanInputs(
                [r.acceptance for r in rows],
                limits,
                shared_drafter=True,
                min_width=pad,
                plain_width=pad,
                paid=[self.drafter.calls_draft_engine] * len(rows),
            ),
        )
        return with_probes(ks, limits, rows)

    def _draft_limit(self, row: DecodeRow) -> int:
        """Draft tokens worth proposing: k, but never past the budget or the context."""
        budget = self.config.max_new_tokens - len(row.generated) - 1
        context = self.target.max_context - row.total
        return max(0, min(self.k, budget, context))

    def _learn(self, result: StepResult, plan: StepPlan) -> None:
        """The rolling acceptance (fallback) and adaptive k from what the step achieved."""
        for drafted, n in zip(result.drafted, result.accepted):
            self.recent.extend([1] * n + [0] * (drafted > n))
        fallback = self.config.fallback
        if fallback:
            if self.in_fallback:
                self.fallback_steps_left -= 1
                if self.fallback_steps_left == 0:
                    self.recent.clear()  # re-probe: judge the draft afresh
                    self._notify(False)
            elif len(self.recent) == self.recent.maxlen and np.mean(self.recent) < fallback.threshold:
                self.fallback_steps_left = fallback.probe_every
                self._notify(True)
        if self.config.adaptive and plan.drafting[0]:
            full = all(n == d and d for n, d in zip(result.accepted, result.drafted))
            self.k = self.config.adaptive.next(self.k, full)

    def _notify(self, state: bool) -> None:
        if self.on_fallback:
            self.on_fallback(state)
