"""The decode step, once: what the one loop (runtime/core/scheduler.py, for a server's in-flight batch and for the
Python API's groups alike) runs after it has decided the step's plan.

A plan (``StepPlan``) says which rows draft and how far, and which target call scores them; ``decode_step`` executes
it: each drafter proposes for its rows, the target scores every row's [last, x_1..x_d], each row accepts
(sampling.verify, under its grammar), the drafters are told what happened, the target cache rolls back past the
rejected slots, and each row books its tokens and stats. An engine that returns tokens rather than logits
(TensorRT-LLM's, runtime/engines/tokens.py) answers the same step with one call that verifies the drafts itself
(``engine_verdicts``), so the rows, the drafters and the booking are the same for every engine. Deciding (the
loops' planners) is kept apart from executing (here), as vLLM keeps ``schedule()`` apart from its model runner.

Invariant between steps, per row: the target cache holds every token but the last emitted one (``DecodeRow.last``),
which the next step feeds first; a drafter's cache lags by its own pending tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from runtime.decoding.calls import feed
from runtime.decoding.config import DecodeConfig
from runtime.decoding.drafter import Drafter, Proposal
from runtime.decoding.grammar import constrain, forced_proposals
from runtime.metrics import RequestStats
from runtime.decoding.sampling import RowSampling, point_masses, token_logprobs, verify
from runtime.decoding.seeded import SeededNoise, positioned


ACCEPTANCE_PRIOR = 0.6  # a row's acceptance estimate before it has drafted
PRIOR_TOKENS = 4.0  # draft tokens of evidence the prior weighs as
EVIDENCE_DECAY = 0.9  # a step's weight after each later one: acceptance moves with the text
POPULATION_DECAY = 0.99  # the same across a drafter's rows (AcceptancePrior): ~100 drafting row-steps remembered


@dataclass(kw_only=True)
class DecodeRow:
    """One running sequence, whichever loop runs it (the scheduler's request row extends it)."""

    prompt: list[int]
    config: DecodeConfig
    rng: np.random.Generator | SeededNoise | None = None  # SeededNoise: a seeded sampled row's position-keyed races
    index: int = 0  # position in the caller's batch
    generated: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    finished: str = ""
    grammar: Any = None  # a GrammarRow (runtime/decoding/grammar.py) when the output is constrained
    logprobs: list[float] | None = None  # the target's log-probability of each generated token, when asked
    top_logprobs: list[list[tuple[int, float]]] | None = None
    started: float = field(default_factory=time.perf_counter)  # time to first token counts from here
    error: BaseException | None = None  # its own work failed (a scheduler row then leaves with it)
    acceptance: float = ACCEPTANCE_PRIOR  # estimate of P(a draft token is accepted): what the step plans read
    prior: float = ACCEPTANCE_PRIOR  # where that estimate starts (a scheduler's ``AcceptancePrior`` of its drafter)
    evidence: tuple[float, float] = (0.0, 0.0)  # its draft tokens accepted and drafted, older steps decayed
    undrafted: int = 0  # steps in a row its plan kept it from drafting (runtime/decoding/step_costs.py probes)

    def __post_init__(self) -> None:
        if self.config.grammar is not None and self.grammar is None:
            self.grammar = self.config.grammar.start()
        if self.config.logprobs is not None and self.logprobs is None:
            self.logprobs, self.top_logprobs = [], []

    @property
    def total(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def last(self) -> int:
        """The token the next step feeds the target first."""
        return self.generated[-1] if self.generated else self.prompt[-1]


@dataclass
class DraftGroup:
    """Rows one drafter serves: one request's rows (a Python API call's whole batch is one request; a server's
    requests have a row each)."""

    drafter: Drafter | None
    rows: list[int]  # positions in the step's rows


@dataclass
class StepPlan:
    """One step, decided before it runs."""

    limits: list[int]  # per row: draft tokens it may propose (0: none)
    drafting: list[bool]  # per group: its drafter is called (else it observes what its rows emit)
    # every row scored with the kernels its lone call would take (padded to the target's min_call_tokens); False:
    # one-token calls unpadded (the "throughput" policy, plain decoding): cheaper, exact only to the last bits
    exact: bool = True
    # per row: its group runs target-only this step because acceptance fell (recorded in its stats); None: no row
    fallback: list[bool] | None = None
    idle: list[bool] | None = None  # per row: sits this step out (its prompt is still being prefilled); None: none
    # per idle row: the prompt tokens it feeds in this step's target call (chunked prefill riding in the step's one
    # call instead of a call of its own); None: none
    prefill: list[list[int]] | None = None


@dataclass
class StepResult:
    drafted: list[int]  # per row: draft tokens proposed
    accepted: list[int]  # per row: draft tokens kept
    new: list[list[int]]  # per row: tokens it took this step (after EOS, budget, context and grammar)
    draft_time: float
    verify_time: float
    prefilled: list | None = None  # per row: the hidden states of the prompt chunk it fed (StepPlan.prefill)


def run_directly(rows: list[DecodeRow], work: Callable, *args):
    """The default isolation: none (a failure ends the whole step)."""
    return work(*args)


def decode_step(
    target, cache, rows: list[DecodeRow], groups: list[DraftGroup], plan: StepPlan, isolate: Callable = run_directly
) -> StepResult:
    """Execute ``plan`` over ``rows`` (see the module docstring). ``isolate(rows, work, *args)`` runs one group's or
    one row's own work; a scheduler passes one that turns a failure into those rows' error (None result) so the
    others go on."""
    idle = plan.idle or [False] * len(rows)
    prefill = plan.prefill or [[] for _ in rows]
    fallback = plan.fallback or [False] * len(rows)
    t0 = time.perf_counter()
    proposals = propose(rows, groups, plan, target.vocab_size, isolate)
    t1 = time.perf_counter()
    chunks = [
        list(prefill[b]) if idle[b] else [row.last] + draft for b, (row, (draft, _)) in enumerate(zip(rows, proposals))
    ]
    if target.returns_tokens:
        verdicts, hidden = engine_verdicts(target, cache, rows, chunks, idle), [None] * len(rows)
        t2 = time.perf_counter()
    else:
        logits, hidden = score(target, cache, chunks, plan.exact)
        t2 = time.perf_counter()  # the target's call; the rows' verification below is booked as neither
        verdicts = [
            None if idle[b] else isolate([row], verify_row, row, draft, probs, logits[b])
            for b, (row, (draft, probs)) in enumerate(zip(rows, proposals))
        ]
    accepted = [verdict[0] if verdict else 0 for verdict in verdicts]
    emitted = [verdict[1] if verdict else [] for verdict in verdicts]
    for group, drafting in zip(groups, plan.drafting):
        if group.drafter is not None and not all(idle[b] for b in group.rows):
            isolate([rows[b] for b in group.rows], inform, group, drafting, hidden, accepted, emitted)
    if not target.returns_tokens:  # an engine that returns tokens kept only what it accepted (``generate_tokens``)
        target.rollback(cache, cache.lengths - np.array([len(d) - n for (d, _), n in zip(proposals, accepted)]))
    new = [
        [] if idle[b] else book(row, len(draft), n, out, fallback[b], t1 - t0, t2 - t1, target.max_context)
        for b, (row, (draft, _), n, out) in enumerate(zip(rows, proposals, accepted, emitted))
    ]
    prefilled = [hidden[b] if idle[b] and prefill[b] else None for b in range(len(rows))]
    return StepResult([len(draft) for draft, _ in proposals], accepted, new, t1 - t0, t2 - t1, prefilled)


def propose(
    rows: list[DecodeRow], groups: list[DraftGroup], plan: StepPlan, vocab_size: int, isolate: Callable
) -> list[tuple[list[int], list]]:
    """Each row's draft tokens and their q: one ``propose`` call per drafting group (constrained rows get the
    grammar's forced tokens too, even from a group that does not draft this step)."""
    out: list[tuple[list[int], list]] = [([], [])] * len(rows)
    for group, drafting in zip(groups, plan.drafting):
        if plan.idle and all(plan.idle[b] for b in group.rows):
            continue
        members = [rows[b] for b in group.rows]
        limits = [plan.limits[b] for b in group.rows]
        proposal = isolate(members, propose_group, group.drafter if drafting else None, members, limits, vocab_size)
        for i, b in enumerate(group.rows):
            if proposal is not None:
                out[b] = (proposal.tokens[i], proposal.probs[i])
    return out


def propose_group(drafter: Drafter | None, rows: list[DecodeRow], limits: list[int], vocab_size: int) -> Proposal:
    config = rows[0].config
    if any(row.grammar is not None for row in rows):
        return propose_constrained(
            drafter, [row.grammar for row in rows], limits, config, [draws(row) for row in rows], vocab_size
        )
    if drafter is None or not any(limits):
        return Proposal.empty(len(rows))
    return drafter.propose(limits, config.params, [draws(row) for row in rows])


def score(target, cache, chunks: list[list[int]], exact: bool = True) -> tuple[list, list]:
    """Each row's target logits for its chunk [last, x_1..x_d], and its hidden states for them (None where the
    engine returns none: a feature drafter's input), in one call (``exact``: see StepPlan)."""
    logits = feed(target, cache, chunks, exact)[0]
    return slices(logits, cache.extra.get("hidden"), chunks)


def engine_verdicts(target, cache, rows: list[DecodeRow], chunks: list[list[int]], idle: list[bool]) -> list:
    """A step on an engine that returns tokens (``Engine.generate_tokens``): one call, each row's chunk [last, x_1..x_d]
    given as its last token and its draft to verify, up to the tokens the row has room for, with the row's own
    sampling (``engine_sampling``); per row (accepted draft tokens n, the tokens the step emits), None for a row
    sitting the step out. The engine's own choice is the row's: n counts the draft tokens it emitted as drafted. A
    row given room that gets nothing back has ended (the old in-process loop's rule too)."""
    room = [0 if idle[b] else row_room(row, target.max_context) for b, row in enumerate(rows)]
    sampling = engine_sampling(target, rows, room)
    out = target.generate_tokens(cache, [c[:1] for c in chunks], [c[1:] for c in chunks], room, sampling)
    for row, emitted, left in zip(rows, out, room):
        if left and not emitted:  # the runtime ended it: at its end id, which an executor may leave out
            row.finished = "stop"
    return [
        None if idle[b] else (agreed(chunk[1:], emitted), emitted)
        for b, (chunk, emitted) in enumerate(zip(chunks, out))
    ]


def engine_sampling(target, rows: list[DecodeRow], room: list[int]) -> list[RowSampling | None] | None:
    """Each asked row's sampling for this call where the engine samples inside itself (``Engine.samples``): its
    parameters and a seed drawn from its own generator, so a seeded row repeats its output and no two steps share a
    seed. None: the engine decodes every row greedily (the front door refused sampled requests for it)."""
    if not target.samples:
        return None
    return [RowSampling.for_row(row.config.params, row.rng) if left else None for row, left in zip(rows, room)]


def draws(row: DecodeRow):
    """What this step's draws of a row come from, drafting and verifying alike: a seeded sampled row's races from its
    first open position (runtime/decoding/seeded.py), else its generator."""
    return positioned(row.rng, len(row.generated))


def agreed(draft: list[int], emitted: list[int]) -> int:
    """How many draft tokens lead what the engine emitted."""
    return next((i for i, (x, y) in enumerate(zip(draft, emitted)) if x != y), min(len(draft), len(emitted)))


def row_room(row: DecodeRow, max_context: int) -> int:
    """Tokens a row may still take: its budget, and the context."""
    return max(0, min(row.config.max_new_tokens - len(row.generated), max_context - row.total))


def slices(logits: np.ndarray, states: np.ndarray | None, chunks: list[list[int]]) -> tuple[list, list]:
    """Per row, the logits and hidden states of its chunk's positions."""
    return (
        [logits[b, : len(chunk)] for b, chunk in enumerate(chunks)],
        [None if states is None else states[b, : len(chunk)] for b, chunk in enumerate(chunks)],
    )


def inform(group: DraftGroup, drafted: bool, hidden: list, accepted: list[int], emitted: list[list[int]]) -> None:
    """Tell a group's drafter what the step did: the target's hidden states of the call, then ``settle`` when it
    proposed this step, else ``observe``."""
    states = [hidden[b] for b in group.rows]
    group.drafter.take_features(None if any(h is None for h in states) else states)
    if drafted:
        group.drafter.settle([accepted[b] for b in group.rows], [emitted[b] for b in group.rows])
    else:
        group.drafter.observe([emitted[b] for b in group.rows])


def learn_acceptance(row: DecodeRow, drafted: int, accepted: int) -> None:
    """The row's acceptance estimate after a step that drafted: the prior and its draft tokens so far, each step's
    counted by its tokens and decayed as later ones come. Not a moving average of per-step ratios: there two
    rejected one-token drafts at the start (ratio 0 twice) took 0.6 to 0.38 and kept a row whose drafts are mostly
    accepted (0.85 on held-out code, the Qwen2.5-Coder pair) from drafting until its next probe, 16 steps on."""
    kept, tried = row.evidence
    kept, tried = EVIDENCE_DECAY * kept + accepted, EVIDENCE_DECAY * tried + tested(drafted, accepted)
    row.evidence = (kept, tried)
    row.acceptance = (PRIOR_TOKENS * row.prior + kept) / (PRIOR_TOKENS + tried)


def tested(drafted: int, accepted: int) -> int:
    """Draft tokens a verification tested: the accepted ones and the first rejected one; those after it were never
    judged. Counting all ``drafted`` as tried, a 3-token lookup draft rejected at its first token (a hybrid's
    guess from the prompt) took a row's estimate from 0.85 to 0.49, as if three tokens had failed, not one."""
    return accepted + (accepted < drafted)


@dataclass
class AcceptancePrior:
    """Where a new row's acceptance estimate starts, per drafter kind: what that drafter's draft tokens achieved in
    the rows before it (decayed, so it follows the traffic), ACCEPTANCE_PRIOR until any have drafted. Started at a
    fixed 0.6, one or two rejected tokens at the start of a row (0.48, then 0.40) kept the 1.5B pair's rows, whose
    drafts are accepted ~0.8 of the time, from drafting until their next probe whenever drafting paid only a little
    (a cost model that counts the draft's catch-up): speculation at batch 1 fell from 1.22x to 1.06x plain."""

    evidence: dict[str, tuple[float, float]] = field(default_factory=dict)  # kind -> decayed (accepted, drafted)

    def of(self, kind: str) -> float:
        kept, tried = self.evidence.get(kind, (0.0, 0.0))
        return (PRIOR_TOKENS * ACCEPTANCE_PRIOR + kept) / (PRIOR_TOKENS + tried)

    def learn(self, kind: str, drafted: int, accepted: int) -> None:
        kept, tried = self.evidence.get(kind, (0.0, 0.0))
        self.evidence[kind] = (POPULATION_DECAY * kept + accepted, POPULATION_DECAY * tried + tested(drafted, accepted))


def book(
    row: DecodeRow,
    drafted: int,
    accepted: int,
    out: list[int],
    fallback: bool,
    draft_time: float,
    verify_time: float,
    max_context: int,
) -> list[int]:
    """A row's stats and tokens after its verification; returns the tokens it took."""
    if row.error is not None:
        return []
    row.stats.record_step(drafted, accepted, 0, fallback=fallback)
    if drafted:
        learn_acceptance(row, drafted, accepted)
    row.stats.draft_time += draft_time
    row.stats.verify_time += verify_time
    new = append_tokens(row, out, row.config, max_context)
    after_append(row, new)
    row.stats.num_emitted_tokens += len(new)
    now = time.perf_counter()
    if new and not row.stats.time_to_first_token:
        row.stats.time_to_first_token = now - row.started
    row.stats.total_time = now - row.started
    return new


def verify_row(row, drafted: list[int], probs: list, logits: np.ndarray) -> tuple[int, list[int]]:
    """``sampling.verify`` for one row (logits [len(drafted) + 1, V]) under its grammar, if any (the target's law
    masked at every position), recording the target's log-probabilities of what it emits when asked. Returns
    (accepted draft tokens n, the tokens the step emits)."""
    scores = logits if row.grammar is None else constrain(logits, row.grammar.verify_masks(drafted))
    n, extra = verify(drafted, probs, scores, row.config.params, draws(row))
    out = drafted[:n] + [extra]
    if row.grammar is not None:
        out = out[: row.grammar.commit(n, extra)]
    if row.logprobs is not None:
        record_logprobs(row, logits, out, row.config.logprobs)
    return n, out


def propose_constrained(
    drafter: Drafter | None, grammars: list, limits: list[int], config: DecodeConfig, rngs: list, vocab_size: int
) -> Proposal:
    """Drafts under the rows' grammars: the grammar-forced tokens where there are any (point masses, no draft call
    for those rows), the drafter's masked draws elsewhere (``drafter`` None: no drafting this step), each cut at its
    first token the grammar refuses (see runtime/decoding/grammar.py for why both stay exact)."""
    rows = len(grammars)
    forced = forced_proposals(grammars, limits) if config.forced_drafts else [[] for _ in range(rows)]
    continues = drafter is not None and drafter.takes_prefixes  # a draft model drafts on after the forced tokens
    if drafter is not None:
        drafter.constrain_rows(grammars)
        if continues:
            inner = drafter.propose(limits, config.params, rngs, prefixes=forced)
        else:
            inner = drafter.propose([0 if f else limit for f, limit in zip(forced, limits)], config.params, rngs)
    else:
        inner = Proposal.empty(rows)
    tokens, probs = [], []
    for b, grammar in enumerate(grammars):
        if forced[b] and not continues:
            drafted, q = forced[b], point_masses(forced[b], vocab_size, config.params)
        else:
            drafted, q = inner.tokens[b], inner.probs[b]
        valid = len(drafted) if grammar is None else grammar.valid_prefix(drafted)
        tokens.append(list(drafted[:valid]))
        probs.append(list(q[:valid]))
    return Proposal(tokens, probs)


def record_logprobs(row, logits: np.ndarray, out: list[int], top: int) -> None:
    """The target's own log-probabilities of a step's emitted tokens (logits [>= len(out), V]: row i scored
    out[i]), appended to the row's; exact under speculation, since row i is the target's score after out[:i]."""
    chosen, tops = token_logprobs(logits, out, top)
    row.logprobs.extend(chosen)
    row.top_logprobs.extend(tops)


def after_append(row, new: list[int]) -> None:
    """Trim logprobs to the tokens a row took, and end a constrained row whose output is complete."""
    if row.logprobs is not None and len(row.logprobs) > len(row.generated):
        del row.logprobs[len(row.generated) :], row.top_logprobs[len(row.generated) :]
    if row.grammar is not None and not row.finished and row.grammar.stopped:
        row.finished = "stop"


def append_tokens(row, tokens: list[int], config: DecodeConfig, max_context: int) -> list[int]:
    """Add emitted tokens to a row (its ``prompt``, ``generated`` and ``finished``), stopping at EOS, the budget and
    the context; returns the tokens it took."""
    new = []
    for token in tokens:
        if row.finished:
            break
        row.generated.append(token)
        new.append(token)
        if token in config.eos_ids:
            row.finished = "stop"
        elif len(row.generated) >= config.max_new_tokens:
            row.finished = "length"
        elif len(row.prompt) + len(row.generated) >= max_context:
            row.finished = "context"
    return new
