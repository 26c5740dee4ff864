"""The one decoding loop: at every step it admits, plans, decodes and retires, for every caller (vLLM v1's
``EngineCore``: ``schedule()``, the model runs, ``update_from_output()``).

The Python API enqueues its batch as one request and drives the steps itself (runtime/api.py); the OpenAI server
and the Triton model enqueue each request as it arrives and run the loop in a thread of its own (``start``); the
bench times the same steps through an observer (``on_step``). What a step runs is runtime/decoding/step.py's
``decode_step``; how its draft lengths are chosen runtime/decoding/planner.py; what a row's tokens become (text,
stops, the final Generation) runtime/core/outputs.py; prompts into the batch runtime/core/prefill.py; what a
request gets back runtime/core/handles.py.

Longer than most modules: a step's phases (admission, the plan, the step, retirement) and the thread that runs them
read in order in one place; what each phase computes lives in the modules above.

A step: (1) rows that were cancelled or ran past their deadline leave, and requests that waited too long are refused;
(2) waiting requests are admitted up to ``max_batch`` rows, first come first served among the clients holding
the fewest rows (``_take``): each prompt is prefilled in a row of its own in the batch cache, which a fused engine
reserves for ``max_batch`` rows of the whole context at start (``reserve``: a server's memory does not grow with its
load); (3) the step is planned (``_plan``: which rows draft, how far, which call scores them) and run
(``decode_step``): every row advances once, accepting with its own sampling parameters, k and random generator;
(4) its text and stop strings advance, and finished rows leave, their cache rows freed. New requests therefore start
at the next step, whatever else is running.

How a step runs: its plan gives each row a draft length, 0 included. With the call costs measured at start
(runtime/decoding/step_costs.py: one target call over B rows of W tokens, one draft token) and each row's
acceptance so far, the lengths are those that make the most expected tokens per second of the whole batch; a row
kept from drafting drafts one token every PROBE_EVERY steps, so its acceptance keeps following its text. The target
then scores every row's [last, x_1..x_d] in one call (an engine that takes a ragged batch: FusedEngine).

Two policies:

- "exact" (the default): every answer is bit for bit what the same request gets alone, in any batch: greedy rows
  because every call scores a row as its lone call would, whatever its draft length; a seeded sampled row because
  each of its tokens is a race keyed by its seed and position (runtime/decoding/seeded.py), the same whatever was
  drafted, so its text is the same whatever it runs with (and the same as target-only decoding's). Unseeded sampled
  rows follow the target's distribution exactly (each step is exact rejection sampling).
- "throughput": the same, except that no call is padded (``exact=False``: a row that does not draft scores one
  token; a step where no row drafts is one batched call of one token a row, the cheapest target-only step) and
  seeded sampled rows are planned like the others. Such calls run other attention and matmul kernels than a lone
  row's, and the int8-activation matmuls of a quantized target turn those last-bit differences into logit
  differences of up to ~1: greedy answers stay the target's greedy choices on the logits it computed, but can part
  from a lone run's at a near tie; seeded sampled text depends on what else runs (its distribution does not).

``plan=False`` (``--no-plan``): every row drafts its limit at every step. Each request has its own drafter (made at
the front door), shared by its rows.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from runtime.decoding.config import row_randomness
from runtime.decoding.planner import Group, GroupPolicy, Planning, plan_lengths
from runtime.decoding.step import (
    AcceptancePrior,
    DecodeRow,
    DraftGroup,
    StepPlan,
    StepResult,
    decode_step,
    run_directly,
)
from runtime.decoding.step_costs import CostModel
from runtime.errors import RequestError
from runtime.core.loaded import LoadedBundle
from runtime.core.request import Admitted
from runtime.core.handles import Event, Generation, Handle, Overloaded, Unavailable
from runtime.core.health import FaultWatch
from runtime.core.outputs import TextOutput
from runtime.core.prefill import PENDING, PREFILL_CHUNK, Prefill, engine_answers, features_of

POLICIES = ("exact", "throughput")
StepObserver = Callable[[list[tuple[DecodeRow, list[int]]]], None]  # after each step: its rows and their new tokens


@dataclass(kw_only=True)
class _Row(DecodeRow):
    """A running sequence: the decode step's row, plus what serving it needs."""

    handle: Handle
    group: Group
    output: TextOutput
    deadline: float | None
    client: str = ""  # who sent it (_Waiting.client)
    prefill_left: list[int] = field(default_factory=list)  # prompt tokens still to prefill (chunked prefill)
    prefill_states: list = field(default_factory=list)  # the hidden states of the chunks prefilled so far

    @property
    def drafter(self):
        """Its request's drafter (None: target-only), shared by the request's rows."""
        return self.group.drafter


@dataclass
class _Waiting:
    handles: list[Handle]  # one per prompt
    admitted: Admitted
    timeout: float | None
    client: str = ""  # who sent it (the server: the peer's address); admission shares rows among clients

    @property
    def size(self) -> int:
        return len(self.admitted.prompts)

    @property
    def submitted(self) -> float:
        return self.handles[0].submitted


class Scheduler:
    """Runs admitted requests over one bundle's engines; see the module docstring.

    ``enqueue`` may be called from any thread; the loop runs in its own (``start``), or the caller drives ``step``.
    max_batch: rows decoded together; max_queue: waiting requests before ``Overloaded``; max_wait: seconds a request
    may wait for admission before ``Overloaded``; policy: "exact" or "throughput" (see the module docstring; a step
    whose rows' requests ask for "throughput", the Python API's, runs it too); plan: plan each step's draft lengths
    from the measured costs (False, or a request's own ``plan=False``: every row drafts its limit); reserve: take
    the batch's KV cache at start (a server); isolate: one request's failure is that request's error and the
    others go on (a server), else it is raised from ``step`` (the Python API's own batch); on_step: told of every
    step's rows and their new tokens (the bench's timings).
    """

    def __init__(
        self,
        bundle: LoadedBundle,
        max_batch: int = 8,
        max_queue: int = 256,
        max_wait: float = 60.0,
        policy: str = "exact",
        plan: bool = True,
        max_rows_per_client: int | None = None,
        prefill_chunk: int | str | None = PREFILL_CHUNK,
        reserve: bool = True,
        isolate: bool = True,
        on_step: StepObserver | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, received {policy!r}")
        if max_batch < 1 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1")
        if max_rows_per_client is not None and max_rows_per_client < 1:
            raise ValueError("max_rows_per_client must be >= 1 (or None: no cap)")
        self.bundle, self.target = bundle, bundle.target
        self.max_batch, self.max_queue, self.max_wait, self.policy = max_batch, max_queue, max_wait, policy
        self.max_rows_per_client, self.plan, self.isolate, self.on_step = max_rows_per_client, plan, isolate, on_step
        self.padding = self.target.min_call_tokens
        self.prefill = Prefill(self.target, prefill_chunk, padding=self.padding)
        self.rows: list[_Row] = []
        self.reserve = reserve
        self.cache = self._empty_cache()
        self.waiting: deque[_Waiting] = deque()
        self._predicted = 0.0  # the planned step's predicted seconds (0: not planned)
        self.draft_lengths: collections.Counter = collections.Counter()  # planned draft length -> row-steps
        self.priors = AcceptancePrior()  # where a new row's acceptance estimate starts, per drafter kind
        self.counters = dict.fromkeys(
            ("steps", "speculative_steps", "row_steps", "admitted", "finished", "cancelled", "timed_out"), 0
        )
        self.counters.update(step_time=0.0, engine_time=0.0, refused=0, failed=0)
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.health = FaultWatch()  # engine failures in a row: what the server's probes report

    @property
    def costs(self) -> CostModel:
        """The measured call costs the step plans (and the "auto" prefill chunk) read."""
        return self.prefill.costs

    @costs.setter
    def costs(self, costs: CostModel) -> None:
        self.prefill.costs = costs

    # --- the outside ----------------------------------------------------------------------------------------------

    def enqueue(
        self,
        admitted: Admitted,
        *,
        timeout: float | None = None,
        sink: Callable[[Event], None] | None = None,
        client: str = "",
    ) -> list[Handle]:
        """Queue a request admitted at the front door; one handle per prompt, whose events arrive in ``sink`` (the
        caller's thread-safe callback) or the handle. ``timeout``: seconds from now after which it finishes with
        reason "timeout". ``client``: who sent it; a free row goes to the waiting request whose client holds the
        fewest rows (first come first served among equals), and none beyond ``max_rows_per_client``."""
        if timeout is not None and not timeout > 0:
            raise RequestError(f"timeout: expected seconds > 0, received {timeout!r}", "timeout")
        if len(admitted.prompts) > self.max_batch:
            raise RequestError(f"{len(admitted.prompts)} prompts in one request; this batch is {self.max_batch}")
        handles = [Handle(next(self._ids), sink) for _ in admitted.prompts]
        with self._lock:
            self._check_room()
            self.waiting.append(_Waiting(handles, admitted, timeout, client))
            self._lock.notify()
        return handles

    def check_room(self) -> None:
        """Overloaded (or Unavailable) now: a server's front door asks first (its ``room``), before its work on a
        request (a grammar compile, its tokenizing), so a full queue refuses before the work."""
        with self._lock:
            self._check_room()

    def _check_room(self) -> None:
        """Under the lock: Unavailable while stopping, Overloaded when the queue is full."""
        if self._stopping:
            raise Unavailable("the scheduler is stopping")
        if len(self.waiting) >= self.max_queue:
            self.counters["refused"] += 1
            raise Overloaded(f"overloaded: {len(self.waiting)} requests are waiting (the limit); retry later")

    def start(self, calibrate: bool | None = None) -> "Scheduler":
        """Measure the call costs (by default when steps are planned), then run the loop in a daemon thread until
        ``stop``; meanwhile the bundle's metrics count its target's calls (``draftsmith_target_calls``)."""
        if calibrate or (calibrate is None and self.plan):
            self.calibrate()
        self.target.watch(self.bundle.metrics.count_call)
        self._thread = threading.Thread(target=self._loop, name="draftsmith-scheduler", daemon=True)
        self._thread.start()
        return self

    def calibrate(self) -> None:
        """Measure the call costs the step plans read (the bundle's, shared with its other schedulers)."""
        self.costs = self.bundle.step_costs(self.max_batch)

    def stop(self) -> None:
        """Stop the loop; every request still waiting or running gets an error event."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
            self.target.unwatch(self.bundle.metrics.count_call)
        self.clear(Unavailable("the scheduler is stopping"))

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    @property
    def running(self) -> bool:
        """Its loop thread is alive and not stopping: what a server's readiness reports (a dead loop serves
        nothing)."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stats(self) -> dict:
        """Counters, and per step: mean rows, seconds, and the seconds outside engine calls (the overhead)."""
        c, lengths = dict(self.counters), dict(self.draft_lengths)  # copies: the loop's thread may count meanwhile
        steps = max(1, c["steps"])
        c.update(
            running=len(self.rows),
            waiting=len(self.waiting),
            mean_batch=c["row_steps"] / steps,
            mean_draft_length=sum(k * n for k, n in lengths.items()) / max(1, sum(lengths.values())),
            step_ms=1e3 * c["step_time"] / steps,
            overhead_ms=1e3 * (c["step_time"] - c["engine_time"]) / steps,
        )
        return c

    # --- the loop -------------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.busy:
                    self._lock.wait()
                if self._stopping:
                    return
            try:
                if self.step():
                    self.health.succeeded()
            except BaseException as err:  # the shared target call failed (a panic too): fail what runs, keep serving
                if isinstance(err, (KeyboardInterrupt, SystemExit)):
                    raise
                self.health.failed()  # before the clients hear of it: a probe after their 500 sees the fault
                self._fail_running(Unavailable(f"decoding failed: {err!r}"))

    def step(self) -> bool:
        """One step (see the module docstring); False when there was nothing to run."""
        start = time.perf_counter()
        self._refuse_stale()
        self._retire([self._interrupted(row) for row in self.rows])
        engine_time = self._admit()
        if not self.rows:
            return False
        plan, groups = self._plan()
        if all(plan.idle):  # every row is still prefilling: nobody waits on a step, so a bigger chunk alone
            engine_time += self._prefill_chunk(self.prefill.idle_step())
            self._count(0, False, time.perf_counter() - start, engine_time)
            self._retire([""] * len(self.rows))
            return True
        isolate = isolated if self.isolate else run_directly
        result = decode_step(self.target, self.cache, self.rows, groups, plan, isolate=isolate)
        self._update(plan, groups, result)
        seconds = result.draft_time + result.verify_time
        self.costs.observe(self._predicted, seconds, len(self.rows) if any(plan.drafting) else 0)  # how steps ran
        self._predicted = 0.0
        self._count(plan.idle.count(False), any(plan.drafting), time.perf_counter() - start, engine_time + seconds)
        self._retire([row.finished for row in self.rows])
        return True

    def _update(self, plan: StepPlan, groups: list[DraftGroup], result: StepResult) -> None:
        """After a step: prefilled chunks booked, each row's text and event (stop strings may finish it), each
        group's policy taught what it achieved, the step's observer told."""
        isolate = isolated if self.isolate else run_directly
        stepped = []
        for b, row in enumerate(self.rows):
            if plan.prefill[b]:
                isolate([row], self._prefilled, row, len(plan.prefill[b]), result.prefilled[b])
            elif not plan.idle[b]:
                isolate([row], self._advance, row, result.new[b])
                stepped.append((row, result.new[b]))
                self.draft_lengths[plan.limits[b]] += 1
                if result.drafted[b]:
                    self.priors.learn(row.group.name, result.drafted[b], result.accepted[b])
        for group, drafting in zip(groups, plan.drafting):
            policy = self.rows[group.rows[0]].group.policy
            changed = policy.learn(
                [result.drafted[b] for b in group.rows], [result.accepted[b] for b in group.rows], drafting
            )
            if changed is not None:
                self.bundle.metrics.fallback_active = changed
        if self.on_step is not None:
            self.on_step(stepped)

    def _advance(self, row: _Row, new: list[int]) -> None:
        event = row.output.advance(row, new)
        if event is not None:
            row.handle.send(event)

    def _count(self, rows: int, speculate: bool, step_time: float, engine_time: float) -> None:
        c = self.counters
        c["steps"] += 1
        c["speculative_steps"] += speculate
        c["row_steps"] += rows
        c["step_time"] += step_time
        c["engine_time"] += engine_time

    def _plan(self) -> tuple[StepPlan, list[DraftGroup]]:
        """This step's plan: how far each row drafts (runtime/decoding/planner.py; 0: not at all) and which call
        scores them: one call for every row where the target takes a ragged batch, each row padded as its lone call
        would be ("exact") or not at all ("throughput"); and its draft groups (each request's rows, one drafter)."""
        idle = [bool(row.prefill_left) for row in self.rows]
        groups, members = [], []
        for b, row in enumerate(self.rows):
            if not groups or groups[-1] is not row.group:
                groups.append(row.group)
                members.append([])
            members[-1].append(b)
        exact = self.policy == "exact" and all(row.config.exact for row in self.rows)  # a request's own policy too
        planned = self.plan and all(row.config.plan for row in self.rows)
        planning = Planning(planned, exact, self.padding if exact else 1)
        lengths = plan_lengths(self.rows, groups, members, idle, self.costs, planning, self.target.max_context)
        self._predicted = lengths.predicted
        plan = StepPlan(
            lengths.limits,
            lengths.drafting,
            exact=exact,
            fallback=lengths.fallback,
            idle=idle,
            prefill=self._prefill_plan(idle),
        )
        return plan, [DraftGroup(g.drafter, m) for g, m in zip(groups, members)]

    def _prefill_plan(self, idle: list[bool]) -> list[list[int]]:
        """The prompt chunk each row still prefilling feeds in this step's target call: the oldest such row gets a
        chunk's worth, the others wait (one chunk a step: a running stream's gap grows by one chunk's share of the
        call, not more)."""
        out: list[list[int]] = [[] for _ in self.rows]
        if not self.prefill.chunks or all(idle):
            return out
        for b, row in enumerate(self.rows):
            if idle[b] and row.error is None:
                out[b] = row.prefill_left[: self.prefill.chunk(idle.count(False))]
                break
        return out

    # --- admission ------------------------------------------------------------------------------------------------

    def _admit(self) -> float:
        """Admit waiting requests into free rows (``_take``); returns the seconds spent prefilling. Each admission
        is its own: a request whose setup or prefill fails gets its error, the others admitted with it run."""
        if not self.waiting:  # read without the lock: a request enqueued meanwhile is taken at the next step
            return 0.0
        with self._lock:
            taken = self._take(self.max_batch - len(self.rows))
        if not taken:
            return 0.0
        start = time.perf_counter()
        ready = []
        for w in taken:  # its drafter starts on its prompts: the request's own work
            try:
                ready.append((w, self._rows(w)))
            except Exception as err:
                self._refuse_admission(w, err)
        decoding = len(self.rows)
        self.cache, states = self.prefill.admit(self.cache, [w.admitted.prompts for w, _ in ready], decoding)
        own = bool(ready) and self._judge_admission([s for request in states for s in request])
        for (w, rows), request_states in zip(ready, states):
            failed = next((s for s in request_states if isinstance(s, Exception)), None)
            if failed is not None:
                self._refuse_admission(w, own_failure(failed, len(rows[0].prompt)) if own else failed)
            elif self._start_rows(w, rows, request_states):
                self.rows += rows
                self.counters["admitted"] += len(rows)
        return time.perf_counter() - start

    def _start_rows(self, w: _Waiting, rows: list[_Row], states: list) -> bool:
        """Hand admitted rows' prompt hidden states to their drafter (a pending row's come with its last chunk);
        False (the request refused, its cache rows dropped) when that fails."""
        for row, state in zip(rows, states):
            if state is PENDING:  # prefilled a chunk a step from the next step on (``_prefill_chunk``)
                row.prefill_left = list(row.prompt[:-1])
        drafter = rows[0].group.drafter
        if drafter is None or any(s is PENDING for s in states):
            return True
        try:
            drafter.take_features(None if any(s is None for s in states) else list(states))
            return True
        except Exception as err:
            if not self.isolate:
                raise
            self._refuse_admission(w, err)
            first = len(self.rows)  # its rows are the last ones of the cache
            keep = np.array([b for b in range(self.cache.batch) if not first <= b < first + len(rows)], dtype=np.int64)
            self.cache = self.target.select(self.cache, keep)
            return False

    def _judge_admission(self, states: list) -> bool:
        """The engine's health after an admission's prefills; True when those that failed failed on their own. Any
        prefill that went through is a success. When all failed, the engine is tried on a call of one token
        (``engine_answers``): if it answers, the failures were the prompts' own (one too big for the memory left,
        ...), which never count against the engine, so a client cannot make the server unready with them."""
        if not all(isinstance(s, Exception) for s in states) or engine_answers(self.target):
            self.health.succeeded()
            return True
        self.health.failed()
        return False

    def _prefill_chunk(self, budget: int) -> float:
        """Prefill up to ``budget`` prompt tokens of the rows still prefilling, oldest first, in calls of their own:
        a step where no row decodes (otherwise the chunk rides in the step's own target call, ``_prefill_plan``).
        Returns the seconds spent."""
        start = time.perf_counter()
        budget = budget if self.prefill.chunks else 0
        for b, row in enumerate(self.rows):
            if budget <= 0:
                break
            if row.prefill_left and row.error is None:
                take = min(budget, len(row.prefill_left))
                isolated([row], self._prefill_part, b, row, take)
                budget -= take
        return time.perf_counter() - start

    def _prefill_part(self, b: int, row: _Row, take: int) -> None:
        self._prefilled(row, take, self.target.prefill_rows(self.cache, [b], [row.prefill_left[:take]])[0])

    def _prefilled(self, row: _Row, take: int, state) -> None:
        """Book ``take`` prompt tokens of a row as prefilled (``state``: their hidden states, None: none); a row whose
        prompt is done hands them all to its drafter (a one-row request's: chunked prefill is theirs alone)."""
        row.prefill_states.append(state)
        del row.prefill_left[:take]
        if not row.prefill_left and row.group.drafter is not None:
            states, row.prefill_states = row.prefill_states, []
            row.group.drafter.take_features(features_of(states))

    def _refuse_admission(self, w: _Waiting, err: Exception) -> None:
        if not self.isolate:
            raise err
        error = err if isinstance(err, RequestError) else Unavailable(f"admission failed: {err}")
        self._fail(w.handles, error)

    def _take(self, free: int) -> list[_Waiting]:
        """Under the lock: waiting requests for up to ``free`` rows, each time the oldest of the clients holding the
        fewest rows, none of a client at ``max_rows_per_client``: one client's burst cannot keep the others'
        requests out of the rows (they get the next free ones), yet alone it may use them all (without a cap)."""
        held = collections.Counter(row.client for row in self.rows)
        cap = self.max_rows_per_client
        taken = []
        while True:
            ready = [w for w in self.waiting if w.size <= free and (cap is None or held[w.client] + w.size <= cap)]
            if not ready:
                return taken
            fewest = min(held[w.client] for w in ready)
            pick = next(w for w in ready if held[w.client] == fewest)
            self.waiting.remove(pick)
            held[pick.client] += pick.size
            free -= pick.size
            taken.append(pick)

    def _rows(self, w: _Waiting) -> list[_Row]:
        """A request's rows, its drafter started on its prompts (and given the costs where its steps are planned)."""
        admitted = w.admitted
        config, drafter = admitted.config, admitted.drafter
        if drafter is not None:
            drafter.start(admitted.prompts)
            if self.plan and config.plan:
                drafter.use_costs(self.costs)  # a hybrid picks its source per step by them
        group = Group(drafter, GroupPolicy(config), admitted.drafter_name)
        rngs = row_randomness(config.seed, len(admitted.prompts), config.params, keyed=not self.target.samples)
        deadline = w.submitted + w.timeout if w.timeout else None
        prior = self.priors.of(group.name)
        return [
            _Row(
                acceptance=prior,
                prior=prior,
                index=i,
                prompt=prompt,
                config=config,
                rng=rng,
                handle=handle,
                group=group,
                output=TextOutput(self.bundle.tokenizer, admitted.stops),
                deadline=deadline,
                client=w.client,
            )
            for i, (prompt, rng, handle) in enumerate(zip(admitted.prompts, rngs, w.handles))
        ]

    # --- retirement -----------------------------------------------------------------------------------------------

    def _interrupted(self, row: _Row) -> str:
        if row.handle.cancelled:
            return "cancelled"
        if row.deadline is not None and time.perf_counter() > row.deadline:
            return "timeout"
        return ""

    def _retire(self, reasons: list[str]) -> None:
        """Rows with a reason, or whose own work failed, leave: each gets its final (or error) event; the batch
        cache keeps the others, and a group's drafter its rows that stay."""
        reasons = ["error" if row.error is not None else reason for row, reason in zip(self.rows, reasons)]
        if not any(reasons):
            return
        keep = [b for b, reason in enumerate(reasons) if not reason]
        leaving = [(row, reason) for row, reason in zip(self.rows, reasons) if reason]
        staying = [self.rows[b] for b in keep]
        self._keep_group_rows(staying)
        self.rows = staying  # first, so stats() never counts a row as both ended and running
        for row, reason in leaving:
            if reason == "error":
                self._fail([row.handle], row_failure(row.error))
                continue
            key = {"cancelled": "cancelled", "timeout": "timed_out"}.get(reason, "finished")
            self.counters[key] += 1
            row.handle.send(row.output.final(row, reason, self.bundle.metrics, row.group.name))
        self.cache = self.target.select(self.cache, np.array(keep, dtype=np.int64))

    def _keep_group_rows(self, staying: list[_Row]) -> None:
        """Tell each group's drafter which of its rows stay (their positions among its rows), where some leave."""
        for group in {id(row.group): row.group for row in self.rows}.values():
            mine = [row for row in self.rows if row.group is group]
            kept = [i for i, row in enumerate(mine) if any(row is s for s in staying)]
            if group.drafter is not None and 0 < len(kept) < len(mine):
                group.drafter.keep_rows(np.array(kept, dtype=np.int64))

    def _refuse_stale(self) -> None:
        """Requests cancelled while waiting, or waiting longer than max_wait, leave the queue."""
        if not self.waiting:
            return
        now = time.perf_counter()
        with self._lock:
            stale = [
                w for w in self.waiting if all(h.cancelled for h in w.handles) or now - w.submitted > self.max_wait
            ]
            for w in stale:
                self.waiting.remove(w)
        for w in stale:
            if all(h.cancelled for h in w.handles):
                self.counters["cancelled"] += 1
                for handle, prompt in zip(w.handles, w.admitted.prompts):
                    handle.send(Event(final=Generation("", [], len(prompt), "cancelled")))
                continue
            self.counters["refused"] += 1
            error = Overloaded(
                f"overloaded: waited {now - w.submitted:.1f} s for a free row (the limit is {self.max_wait:g} s); "
                "retry later"
            )
            for handle in w.handles:
                handle.send(Event(error=error))

    def _fail_running(self, error: Exception) -> None:
        failed, self.rows = self.rows, []  # gone from stats() before their clients hear of it
        self._fail([row.handle for row in failed], error)
        self.cache = self._empty_cache()

    def _empty_cache(self):
        """A cache of no rows: ``max_batch`` rows reserved where the scheduler reserves (a server's), else one that
        grows with its rows."""
        return self.target.reserved_cache(self.max_batch) if self.reserve else self.target.new_cache(0)

    def clear(self, error: Exception) -> None:
        """Every request waiting or running gets ``error`` and leaves, its cache rows freed; the scheduler goes on
        (``stop`` ends with it; the Python API clears its scheduler after a batch that failed or that its caller
        left)."""
        with self._lock:
            waiting, self.waiting = list(self.waiting), deque()
        self._fail([handle for w in waiting for handle in w.handles], error)
        self._fail_running(error)

    def _fail(self, handles: list[Handle], error: Exception) -> None:
        """Each handle's request failed after the front door: counted (``failed``), then told ``error``."""
        self.counters["failed"] += len(handles)
        for handle in handles:
            handle.send(Event(error=error))


def isolated(rows: list[DecodeRow], work: Callable, *args):
    """``work(*args)`` for some rows' own work (one request's here); if it raises, the failure is theirs
    (``row.error``: each leaves at the end of the step with that error) and the result is None, so the other rows go
    on."""
    if any(row.error is not None for row in rows):
        return None
    try:
        return work(*args)
    except BaseException as err:  # a tokenizer or drafter panic too (pyo3 panics are BaseException)
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        for row in rows:
            row.error = err
        return None


def own_failure(error: Exception, tokens: int) -> Exception:
    """What a request whose admission failed on its own (the engine answers) receives: a prompt that ran out of
    memory is the request's error (400: shorten it), anything else as it is."""
    if isinstance(error, MemoryError):
        return RequestError(
            f"admission failed: prefilling this prompt ({tokens} tokens) needs more memory than the server has "
            "free; shorten the prompt"
        )
    return error


def row_failure(error: Exception) -> Exception:
    """What a request whose own decoding failed receives: its RequestError as it is, anything else Unavailable."""
    return error if isinstance(error, RequestError) else Unavailable(f"decoding this request failed: {error!r}")
