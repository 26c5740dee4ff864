"""What the calls of a decode step cost, measured, and the plan they pick: how far each row drafts (0 included) so
that the whole batch makes the most tokens per second (vLLM's dynamic speculation and TensorRT-LLM's
``draft_len_schedule`` decide the same thing; here from costs measured on the machine that runs the bundle).

A step's cost is its draft calls plus one target call over every row (an engine that takes a ragged batch scores
each row's [last, x_1..x_d] in that one call: runtime/engines/fused.py). Its yield is each row's expected tokens,
1 + a + ... + a^k for a draft of k tokens each accepted with the row's probability a (``expected_tokens``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

WIDTHS = (1, 2, 3, 4, 5, 9)  # tokens a row in a calibrated call (more are interpolated linearly from the last two)
PREFILL_WIDTH = 32  # a lone row's call this wide is timed too: what a token of a prompt chunk costs
PROBE_EVERY = 16  # a row the plan keeps from drafting drafts one token after this many steps (its acceptance moves)
STEADY_BACKLOG = 2  # tokens a drafting row's draft feeds first in a step anyway (the bonus and an accepted token)


@dataclass
class CostModel:
    """Measured seconds: ``call[(rows, width)]`` one target call over ``rows`` rows of ``width`` tokens each (width 1:
    unpadded one-token calls; a padded target's own calls are at least ``min_call_tokens`` wide); ``draft[rows]`` one
    draft token for ``rows`` rows in one drafter call. Calibrated once on a scratch cache; ``scale`` then follows how
    the steps that draft nothing actually ran (a machine under other load slows everything), and ``drafting[rows]`` how
    drafting steps of that many rows ran against that: their calls are ragged, wider and on a longer past than the
    calibration's, so a plan trusting the calibration alone drafted at batch 2 and 4 where it lost (0.74-0.85x
    plain on the 1.5B pair, 2 cores)."""

    call: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    scale: float = 1.0
    drafting: dict[int, float] = field(default_factory=dict)  # rows -> measured / predicted of drafting steps
    _read: dict = field(default_factory=dict, repr=False, compare=False)  # reads of the tables, kept (unscaled)

    @property
    def calibrated(self) -> bool:
        return bool(self.call)

    def call_cost(self, widths: list[int]) -> float:
        """One target call over rows of these widths. A ragged call costs its widest row's width over every row:
        the graph's matmuls run every row's padded positions (only attention skips them), so rows drafting less
        than the others save their draft calls, not target compute."""
        if not self.call or not widths:
            return 0.0
        key = (len(self.call), len(widths), max(widths))  # the table's size: a calibration adds to it
        if key not in self._read:
            self._read[key] = self._rows_cost(len(widths), float(max(widths)))
        return self._read[key] * self.scale

    def _rows_cost(self, rows: int, width: float) -> float:
        sizes = sorted({r for r, _ in self.call})
        per_size = [self._width_cost(r, width) for r in sizes]
        cost = np.interp(rows, sizes, per_size) if rows <= sizes[-1] else per_size[-1] * rows / sizes[-1]
        return float(cost)

    def _width_cost(self, rows: int, width: float) -> float:
        known = sorted(w for r, w in self.call if r == rows)
        costs = [self.call[(rows, w)] for w in known]
        if width <= known[-1] or len(known) < 2:
            return float(np.interp(width, known, costs))
        slope = (costs[-1] - costs[-2]) / (known[-1] - known[-2])
        return costs[-1] + slope * (width - known[-1])

    def draft_cost(self, rows: int) -> float:
        """One draft token for ``rows`` rows in one call (0 without a draft model: lookup drafters cost ~nothing)."""
        if not self.draft:
            return 0.0
        key = ("draft", len(self.draft), rows)  # a plan asks it thousands of times a step at batch 8
        if key not in self._read:
            sizes = sorted(self.draft)
            self._read[key] = float(np.interp(rows, sizes, [self.draft[s] for s in sizes]))
        return self._read[key] * self.scale

    def draft_call(self, rows: int, width: int) -> float:
        """One draft call over ``rows`` rows feeding ``width`` tokens each (a draft's first call of a step feeds what
        it has not seen: the bonus token, or every token since it last drafted): a one-token draft call scaled by
        how the target's calls grow with width at that batch (the draft is timed at one width only)."""
        if width <= 1 or not self.call:
            return self.draft_cost(rows)
        key = ("growth", len(self.call), rows, width)
        if key not in self._read:
            self._read[key] = self._rows_cost(rows, float(width)) / max(self._rows_cost(rows, 1.0), 1e-12)
        return self.draft_cost(rows) * self._read[key]

    def observe(self, predicted: float, measured: float, drafting_rows: int = 0) -> None:
        """Follow the machine: ``scale`` (a step that drafted nothing) or ``drafting[drafting_rows]`` (a step of
        that many rows that drafted) moves a fifth of the way to measured / predicted."""
        if predicted <= 0 or measured <= 0:
            return
        if drafting_rows:
            factor = self.drafting_factor(drafting_rows)
            self.drafting[drafting_rows] = 0.8 * factor + 0.2 * factor * measured / predicted
        else:
            self.scale = 0.8 * self.scale + 0.2 * self.scale * measured / predicted

    def drafting_factor(self, rows: int) -> float:
        """Measured over predicted seconds of drafting steps over ``rows`` rows (1 until one has run)."""
        return self.drafting.get(rows, 1.0)

    def calibrate(self, target, draft, max_batch: int, max_width: int, past: int = 64, repeats: int = 3) -> None:
        """Time target calls of 1, 2, 4, ... ``max_batch`` rows at each width of ``WIDTHS`` up to ``max_width`` (and
        the draft's one-token calls) after ``past`` tokens, the best of ``repeats`` each."""
        self._read.clear()
        sizes = sorted({1, max_batch} | {b for b in (2, 4, 8, 16, 32) if b < max_batch})
        widths = sorted({w for w in WIDTHS if w < max_width} | {max_width})
        prefill = min(PREFILL_WIDTH, fitting_width(target))
        past = fitting_past(past, max(widths[-1], prefill), target, draft)
        for rows in sizes:
            for width in widths:
                self.call[(rows, width)] = timed_call(target, rows, width, past, repeats)
            if draft is not None:  # against the target's one-token call, the two timed in turn
                self.draft[rows] = relative_call(draft, target, past, max(repeats, 5), rows) * self.call[(rows, 1)]
        # a prompt chunk's cost per token (a server's chunked prefill is sized by it)
        self.call[(1, prefill)] = timed_call(target, 1, prefill, past, repeats)


def fitting_width(engine) -> int:
    """The widest call a fresh cache of this engine holds (a short-context engine cannot take PREFILL_WIDTH)."""
    return max(1, engine.max_context // 2)


def fitting_past(past: int, width: int, target, draft) -> int:
    """``past`` cut so that ``past`` tokens and a call of ``width`` fit both engines' contexts (a padded call may
    pass the context by its padding: the engine's cache holds that slack), so a bundle built for a short context is
    still calibrated rather than refused."""
    contexts = [e.max_context for e in (target, draft) if e is not None]
    return max(1, min(past, min(contexts) - width))


def timed_call(engine, rows: int, width: int, past: int, repeats: int) -> float:
    """Best seconds of one call of ``width`` tokens a row over ``rows`` rows holding ``past`` tokens each."""
    cache = engine.new_cache(rows)
    scratch_call(engine, cache, np.ones((rows, past), np.int64))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        scratch_call(engine, cache, np.ones((rows, width), np.int64), exact=width > 1)
        best = min(best, time.perf_counter() - start)
        engine.rollback(cache, cache.lengths - width)
    return best


def relative_call(engine, reference, past: int, repeats: int, rows: int = 1) -> float:
    """One-token call seconds of ``engine`` over ``reference``'s (``rows`` rows), from one interleaved run: a call of
    each in turn, ``repeats`` times, the ratio of their medians. Timed apart, a machine's drift between the two runs
    (another job, the memory a process happened to get) moved a draft's measured cost by a fifth and ranked draft
    forms wrongly."""
    caches = [engine.new_cache(rows), reference.new_cache(rows)]
    for e, cache in zip((engine, reference), caches):
        scratch_call(e, cache, np.ones((rows, past), np.int64))
    seconds: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for e, cache, times in zip((engine, reference), caches, seconds):
            start = time.perf_counter()
            scratch_call(e, cache, np.ones((rows, 1), np.int64))
            times.append(time.perf_counter() - start)
            e.rollback(cache, cache.lengths - 1)
    return float(np.median(seconds[0]) / np.median(seconds[1]))


def scratch_call(engine, cache, tokens: np.ndarray, exact: bool = True) -> None:
    """A forward call on made-up tokens, for timing; a feature draft engine gets zero features of its width.
    ``exact`` False: one-token calls unpadded (what a target-only batched step costs)."""
    features = np.zeros(tokens.shape + (engine.feature_width,), np.float32) if engine.takes_features else None
    engine.forward(cache, tokens, exact=exact, features=features)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify of k draft tokens yields when each is accepted with probability ``acceptance``."""
    a = min(acceptance, 0.99)
    return (1 - a ** (k + 1)) / (1 - a)


@dataclass
class PlanInputs:
    """What a step's plan is chosen from, per row: its acceptance estimate and how far it may draft."""

    acceptance: list[float]
    limits: list[int]
    shared_drafter: bool  # one drafter call drafts every row (one request's rows); else one drafter per row
    min_width: int = 2  # a scored row's width in the target call (the target's min_call_tokens)
    plain_width: int = 2  # a step where no row drafts: 1 where the policy lets it run unpadded
    paid: list[bool] | None = None  # per row: its drafts cost draft calls (False: a model-free drafter); None: all
    backlog: list[int] | None = None  # per row: tokens its draft feeds before its first token (0: no call; None: 1)
    horizon: float = 1.0  # steps a catch-up is spread over when planning (a caught-up draft keeps drafting)


def step_cost(costs: CostModel, ks: list[int], inputs: PlanInputs, planning: bool = False) -> float:
    """Seconds of a step whose rows draft ``ks`` tokens. A draft's first call feeds its backlog: the bonus token,
    or every token since the row last drafted (its prompt, the first time). ``planning``: the part of that
    catch-up beyond a drafting row's usual one is spread over ``inputs.horizon`` steps, as the draft it buys keeps
    drafting (charged whole, a prompt's catch-up would keep a lone row from ever starting to draft)."""
    rows = len(ks)
    if not any(ks):
        return costs.call_cost([inputs.plain_width] * rows)
    backlog = inputs.backlog or [1] * rows  # 0: this row's proposal costs no draft call
    paid = [k if p and n else 0 for k, p, n in zip(ks, inputs.paid or [True] * rows, backlog)]
    backlog = [n if k else 0 for k, n in zip(paid, backlog)]
    if inputs.shared_drafter:
        draft = _drafts(costs, rows, max(paid), max(backlog), inputs.horizon if planning else 1.0)
    else:
        draft = sum(_drafts(costs, 1, k, n, inputs.horizon if planning else 1.0) for k, n in zip(paid, backlog) if k)
    return (draft + costs.call_cost([max(k + 1, inputs.min_width) for k in ks])) * costs.drafting_factor(rows)


def _drafts(costs: CostModel, rows: int, k: int, backlog: int, horizon: float) -> float:
    """Seconds of ``k`` draft calls over ``rows`` rows whose first feeds ``backlog`` tokens, the catch-up beyond
    STEADY_BACKLOG spread over ``horizon`` steps."""
    if not k:
        return 0.0
    usual = costs.draft_call(rows, min(backlog, STEADY_BACKLOG))
    catch_up = costs.draft_call(rows, backlog) - usual if backlog > STEADY_BACKLOG else 0.0
    return usual + catch_up / max(horizon, 1.0) + (k - 1) * costs.draft_cost(rows)


def step_tokens(ks: list[int], acceptance: list[float]) -> float:
    return sum(expected_tokens(a, k) for a, k in zip(acceptance, ks))


def plan_draft_lengths(costs: CostModel, inputs: PlanInputs) -> list[int]:
    """Each row's draft length this step: the one k for every row (capped by each row's limit) that gives the most
    expected tokens per second, then, row by row, 0 where leaving a row undrafted gives more (a row whose drafts
    are rarely accepted stops paying for them while the others keep drafting)."""
    limits = inputs.limits
    if not costs.calibrated or not any(limits):
        return list(limits)

    def rate(ks: list[int]) -> float:
        return step_tokens(ks, inputs.acceptance) / max(step_cost(costs, ks, inputs, planning=True), 1e-9)

    best = max(range(max(limits) + 1), key=lambda k: rate([min(k, limit) for limit in limits]))
    ks = [min(best, limit) for limit in limits]
    for b in range(len(ks)):
        if ks[b]:
            without = ks[:b] + [0] + ks[b + 1 :]
            if rate(without) > rate(ks):
                ks = without
    return ks


def with_probes(ks: list[int], limits: list[int], rows) -> list[int]:
    """``ks`` with one draft token for each row the plan has kept from drafting PROBE_EVERY steps running, so its
    acceptance estimate (which only drafting moves) follows the text: left alone it would stay where it fell
    (TensorRT-LLM's finding with k = 0 schedules). Counts each row's undrafted steps (``row.undrafted``)."""
    out = list(ks)
    for b, row in enumerate(rows):
        if out[b] or not limits[b]:
            row.undrafted = 0
            continue
        row.undrafted += 1
        if row.undrafted >= PROBE_EVERY:
            out[b], row.undrafted = 1, 0
    return out
