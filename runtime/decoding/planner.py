"""How a step is planned: every row's draft length (0 included), under the policies its group runs with.

A group is the rows one drafter serves, one ``propose`` call drafting them all: a server's request is a group of
one row, a Python API batch one group of all its rows. Its ``GroupPolicy`` decides how far its rows may draft from
what its steps achieved: its request's k, moved by ``AdaptiveK`` (up after a fully accepted step, down otherwise),
or none while ``Fallback`` holds it target-only because acceptance fell (re-probing after a while). Over the whole
batch the measured call costs then pick each row's length up to that limit, the lengths that make the most expected
tokens per second (runtime/decoding/step_costs.py). A seeded sampled row is planned too: its tokens are races keyed
by its seed and position (runtime/decoding/seeded.py), the same text at any draft length. Only where the target
samples inside itself (a seed a call) does such a row keep its limit, so that its text does not depend on what else
runs.

Deciding is kept apart from executing (runtime/decoding/step.py), as vLLM keeps ``schedule()`` apart from its
model runner: the scheduler (runtime/core/scheduler.py) asks ``plan_lengths`` and runs the plan.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from runtime.decoding.config import DecodeConfig
from runtime.decoding.seeded import SeededNoise
from runtime.decoding.step import DecodeRow
from runtime.decoding.step_costs import PROBE_EVERY, CostModel, PlanInputs, plan_draft_lengths, step_cost, with_probes
from runtime.decoding.drafter import Drafter


@dataclass
class GroupPolicy:
    """A group's planning state: its current k (``AdaptiveK`` moves it) and its recent acceptance (``Fallback``)."""

    config: DecodeConfig
    k: int = 0
    recent: deque = field(default_factory=deque)  # 1/0 per recent draft token
    fallback_steps_left: int = 0

    def __post_init__(self) -> None:
        self.k = self.config.k
        self.recent = deque(maxlen=self.config.fallback.window if self.config.fallback else 1)

    @property
    def in_fallback(self) -> bool:
        return self.fallback_steps_left > 0

    def limit(self, row: DecodeRow, max_context: int) -> int:
        """Draft tokens worth proposing: k, but never past the row's budget or the context."""
        budget = row.config.max_new_tokens - len(row.generated) - 1
        return max(0, min(self.k, budget, max_context - row.total))

    def learn(self, drafted: list[int], accepted: list[int], drafting: bool) -> bool | None:
        """The rolling acceptance (fallback) and adaptive k from what a step achieved in the group's rows; returns
        the fallback state where it changed (None: it did not)."""
        for d, n in zip(drafted, accepted):
            self.recent.extend([1] * n + [0] * (d > n))
        changed, fallback = None, self.config.fallback
        if fallback:
            if self.in_fallback:
                self.fallback_steps_left -= 1
                if self.fallback_steps_left == 0:
                    self.recent.clear()  # re-probe: judge the draft afresh
                    changed = False
            elif len(self.recent) == self.recent.maxlen and np.mean(self.recent) < fallback.threshold:
                self.fallback_steps_left = fallback.probe_every
                changed = True
        if self.config.adaptive and drafting:
            full = all(n == d and d for n, d in zip(accepted, drafted))
            self.k = self.config.adaptive.next(self.k, full)
        return changed


@dataclass
class Group:
    """Rows one drafter serves (one ``Admitted`` request), and how their steps are planned."""

    drafter: Drafter | None
    policy: GroupPolicy
    name: str = ""  # its drafter's kind: the label of its acceptance metrics


@dataclass
class LengthPlan:
    """The draft side of one step's plan (runtime/decoding/step.py's StepPlan takes it)."""

    limits: list[int]  # per row: draft tokens it may propose (0: none)
    drafting: list[bool]  # per group: its drafter is called
    fallback: list[bool]  # per row: its group runs target-only because acceptance fell
    predicted: float = 0.0  # the step's seconds by the measured costs (0: not planned by them)


@dataclass(frozen=True)
class Planning:
    """How a scheduler plans: ``by_cost`` (lengths from measured costs; False: every row drafts its limit),
    ``exact`` (its policy: rows scored with lone-call kernels, seeded rows a target samples at their limit) and
    ``width`` (a scored row's least width in the target's call)."""

    by_cost: bool
    exact: bool
    width: int


def plan_lengths(
    rows: list[DecodeRow],
    groups: list[Group],
    members: list[list[int]],
    idle: list[bool],
    costs: CostModel,
    planning: Planning,
    max_context: int,
) -> LengthPlan:
    """Each row's draft length this step: its group's limit (0 for a row still prefilling, a group without a
    drafter unless the grammar forces tokens, a row its drafter is done with), then, over every row of a drafting
    group, the lengths the measured costs pick (``planning.by_cost``), each row kept from drafting probing again
    every PROBE_EVERY steps; a request that asked for no plan, and a seeded sampled row of a target that samples inside
    itself under "exact", keep their limits. ``members[g]``: group g's rows (positions in ``rows``)."""
    limits = group_limits(rows, groups, members, idle, max_context)
    drafting = [
        g.drafter is not None and not g.policy.in_fallback and any(limits[b] for b in m)
        for g, m in zip(groups, members)
    ]
    fallback = [False] * len(rows)
    planned = [False] * len(rows)
    for group, rows_of, drafts in zip(groups, members, drafting):
        for b in rows_of:
            fallback[b], planned[b] = group.policy.in_fallback, drafts
    inputs_limits = [limit if p else 0 for limit, p in zip(limits, planned)]
    if not (planning.by_cost and costs.calibrated and any(inputs_limits)):
        return LengthPlan(limits, drafting, fallback)
    inputs = PlanInputs(
        [row.acceptance for row in rows],
        inputs_limits,
        shared_drafter=len(groups) == 1,
        min_width=planning.width,
        plain_width=planning.width,
        paid=[g.drafter is not None and g.drafter.calls_draft_engine for g in row_groups(groups, members, len(rows))],
        backlog=backlogs(groups, members, len(rows)),
        horizon=horizon(rows, inputs_limits),
    )
    ks = _probed(plan_draft_lengths(costs, inputs), costs, inputs, rows)
    fixed = [
        not p or not row.config.plan or (planning.exact and pinned(row, g))
        for p, row, g in zip(planned, rows, row_groups(groups, members, len(rows)))
    ]
    ks = [limit if keep else k for k, limit, keep in zip(ks, limits, fixed)]
    drafting = [d and any(ks[b] for b in m) for d, m in zip(drafting, members)]
    return LengthPlan(ks, drafting, fallback, step_cost(costs, ks, inputs))


OPTIMISTIC = 0.9  # the acceptance a row is granted when asking whether drafting could pay at all


def probe_limits(costs: CostModel, inputs: PlanInputs) -> list[int]:
    """The limits of rows worth probing: those the costs would let draft were their drafts accepted OPTIMISTIC of
    the time, the probe's catch-up (a model draft feeds every token since it last drafted: the prompt, the first
    time) spread over no more than the PROBE_EVERY steps until the next probe. Where even that does not pay (a
    large batch, whose target call is compute-bound), a probe only costs: probes every PROBE_EVERY steps at batch
    8 on the 1.5B pair cost their steps a tenth (0.91x plain)."""
    hopeful = dataclasses.replace(
        inputs, acceptance=[max(a, OPTIMISTIC) for a in inputs.acceptance], horizon=min(inputs.horizon, PROBE_EVERY)
    )
    return [limit if k else 0 for limit, k in zip(inputs.limits, plan_draft_lengths(costs, hopeful))]


def _probed(ks: list[int], costs: CostModel, inputs: PlanInputs, rows) -> list[int]:
    """``ks`` with probes (``with_probes``); the hopeful plan is asked only where a row is kept from drafting."""
    limits = probe_limits(costs, inputs) if not all(ks) else inputs.limits
    return with_probes(ks, limits, rows)


def group_limits(
    rows: list[DecodeRow], groups: list[Group], members: list[list[int]], idle: list[bool], max_context: int
) -> list[int]:
    """Each row's draft limit by its group's policy (see ``plan_lengths``)."""
    limits = [0] * len(rows)
    for group, rows_of in zip(groups, members):
        usable = group.drafter.can_draft() if group.drafter is not None else None
        for i, b in enumerate(rows_of):
            row = rows[b]
            forced = row.grammar is not None and row.config.forced_drafts
            if idle[b] or (group.drafter is None and not forced) or (usable is not None and not usable[i]):
                continue
            limits[b] = group.policy.limit(row, max_context)
    return limits


def backlogs(groups: list[Group], members: list[list[int]], rows: int) -> list[int]:
    """Each row's draft backlog (``Drafter.backlog``: what its next draft call feeds first; 1 where the drafter
    keeps no draft engine to catch up)."""
    out = [1] * rows
    for group, rows_of in zip(groups, members):
        backlog = group.drafter.backlog() if group.drafter is not None else None
        if backlog is not None:
            for b, n in zip(rows_of, backlog):
                out[b] = n
    return out


def horizon(rows: list[DecodeRow], limits: list[int]) -> float:
    """The steps a draft's catch-up is spread over when planning: about the steps the drafting rows have left
    (half their remaining tokens: a drafting step makes about two)."""
    left = [row.config.max_new_tokens - len(row.generated) for row, limit in zip(rows, limits) if limit]
    return max(1.0, float(np.mean(left)) / 2) if left else 1.0


def row_groups(groups: list[Group], members: list[list[int]], rows: int) -> list[Group]:
    """Each row's group."""
    out: list = [None] * rows
    for group, rows_of in zip(groups, members):
        for b in rows_of:
            out[b] = group
    return out


def pinned(row: DecodeRow, group: Group) -> bool:
    """A seeded sampled row that drafts and draws from a stream (a target that samples inside itself takes a seed a
    call): planning it by costs would make its text depend on timing. A row with position-keyed races
    (runtime/decoding/seeded.py) has the same text at any draft length, and is planned like the others."""
    return (
        group.drafter is not None
        and row.config.seed is not None
        and not row.config.params.greedy
        and not isinstance(row.rng, SeededNoise)
    )
