"""In-flight batching: one loop owns the engines and, at every step, admits, decodes and retires requests.

Longer than most modules: admission, the step's plan and retirement are one loop (the step itself is
runtime/decoding/step.py's ``decode_step``, the one SpeculativeLoop runs too); its call costs and plans are
runtime/decoding/step_costs.py, what a request gets back runtime/serving/handles.py.

A step: (1) rows that were cancelled or ran past their deadline leave, and requests that waited too long are refused;
(2) waiting requests are admitted up to ``max_batch`` rows, first come first served among the clients holding
the fewest rows (``_take``): each prompt is prefilled in a row of its own in the batch cache, which a fused engine
reserves for ``max_batch`` rows of the whole context at start (the server's memory does not grow with its load);
(3) the step is planned (``_plan``: which rows draft, how far, which call scores them) and run (``decode_step``):
every row advances once, accepting with its own sampling parameters, k and random generator (sampling.verify);
(4) its text and stop strings advance, and finished rows leave, their cache rows freed. New requests therefore start
at the next step, whatever else is running.

How a step runs: its plan (``_plan``) gives each row a draft length, 0 included. With the call costs measured at
start (runtime/decoding/step_costs.py: one target call over B rows of W tokens, one draft token) and each row's
acceptance so far, the lengths are those that make the most expected tokens per second of the whole batch; a row
kept from drafting drafts one token every PROBE_EVERY steps, so its acceptance keeps following its text. The target
then scores every row's [last, x_1..x_d] in one call (an engine that takes a ragged batch: FusedEngine), each row
with the kernels it gets alone (its own ``min_call_tokens``), so a row's logits never depend on what else runs.

Two policies:

- "exact" (the default): every answer is bit for bit what the same request gets alone
  (``SpeculativeGenerator.generate``), in any batch: greedy rows because every call scores a row as its lone call
  would, whatever its draft length; a seeded sampled row always drafts its k (``pinned``: whether a step drafts
  changes how its random stream is used), so its text is the same whatever it runs with. Unseeded sampled rows follow
  the target's distribution exactly (each step is exact rejection sampling).
- "throughput": the same, except that no row is padded (a row that does not draft scores one token; a step where no
  row drafts is one batched call of one token a row, the cheapest target-only step) and seeded sampled rows are
  planned like the others. Such calls run other attention and matmul kernels than a lone row's, and the
  int8-activation matmuls of a quantized target turn those last-bit differences into logit differences of up to ~1:
  greedy answers stay the target's greedy choices on the logits it computed, but can part from a lone run's at a
  near tie; seeded sampled text depends on what else runs (its distribution does not).

``plan=False`` (``--no-plan``): every row drafts its k at every step. Each request has its own drafter (its own draft
cache), made by the generator as for a lone request.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from runtime.api import Generation, SpeculativeGenerator, merged_request
from runtime.decoding.calls import prefill
from runtime.decoding.config import DecodeConfig, row_generators
from runtime.decoding.step import DecodeRow, DraftGroup, StepPlan, decode_step
from runtime.drafters.base import Drafter
from runtime.engines.onnx import unpadded
from runtime.errors import RequestError
from runtime.request import DecodeRequest
from runtime.serving.handles import Event, Handle, Overloaded, Unavailable
from runtime.decoding.step_costs import CostModel, PlanInputs, plan_draft_lengths, step_cost, with_probes
from runtime.serving.health import FaultWatch
from runtime.text.tokenizer import IncrementalDecoder, StopText

POLICIES = ("exact", "throughput")
PREFILL_CHUNK = "auto"  # prompt tokens prefilled per step while other rows decode: "auto" sizes it (_chunk)
CHUNK_BOUNDS = (2, 256)  # the "auto" chunk's bounds (tokens); 64 before the costs are measured
CHUNK_GAP = 1.8  # "auto": the step's target call with a prompt chunk in it costs at most this times the call without
PENDING = object()  # an admitted prompt left to the steps' prefill chunks


@dataclass(kw_only=True)
class _Row(DecodeRow):
    """A running request: the decode step's row, plus what serving it needs."""

    handle: Handle
    stops: tuple[str, ...]
    drafter: Drafter | None
    decoder: IncrementalDecoder
    drafter_name: str  # its drafter's kind ("": none), the label of its acceptance metrics
    deadline: float | None
    sent: StopText  # the text its client got, stop strings applied
    client: str = ""  # who sent it (_Waiting.client)
    logprobs_sent: int = 0  # generated tokens whose log-probabilities went out in events
    prefill_left: list[int] = field(default_factory=list)  # prompt tokens still to prefill (chunked prefill)
    prefill_states: list = field(default_factory=list)  # the hidden states of the chunks prefilled so far

    def take_logprobs(self) -> tuple | None:
        """(tokens, logprobs, top) not sent in an event yet (None without logprobs)."""
        if self.logprobs is None:
            return None
        sent, self.logprobs_sent = self.logprobs_sent, len(self.logprobs)
        return self.generated[sent : len(self.logprobs)], self.logprobs[sent:], self.top_logprobs[sent:]

    @property
    def pinned(self) -> bool:
        """A seeded sampled row always drafts its k ("exact"): whether a step drafts changes how its random stream
        is used, so planning it by costs would make its text depend on timing."""
        return self.drafter is not None and self.config.seed is not None and not self.config.params.greedy


@dataclass
class _Waiting:
    handle: Handle
    prompt: list[int]
    config: DecodeConfig
    stops: tuple[str, ...]
    request: DecodeRequest  # its mode, drafter and draft_confidence make its drafter at admission
    timeout: float | None
    client: str = ""  # who sent it (the server: the peer's address); admission shares rows among clients


class Scheduler:
    """Serves many requests at once over one generator's engines; see the module docstring.

    ``submit`` may be called from any thread; the loop runs in its own (``start``), or a test drives ``step``.
    max_batch: rows decoded together; max_queue: waiting requests before ``Overloaded``; max_wait: seconds a request
    may wait for admission before ``Overloaded``; policy: "exact" or "throughput" (see the module docstring);
    plan: plan each step's draft lengths from the measured costs (False: every row drafts its k).
    """

    def __init__(
        self,
        generator: SpeculativeGenerator,
        max_batch: int = 8,
        max_queue: int = 256,
        max_wait: float = 60.0,
        policy: str = "exact",
        plan: bool = True,
        max_rows_per_client: int | None = None,
        prefill_chunk: int | str | None = PREFILL_CHUNK,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, received {policy!r}")
        if max_batch < 1 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1")
        self.generator, self.target = generator, generator.target
        self.max_batch, self.max_queue, self.max_wait, self.policy = max_batch, max_queue, max_wait, policy
        if max_rows_per_client is not None and max_rows_per_client < 1:
            raise ValueError("max_rows_per_client must be >= 1 (or None: no cap)")
        self.max_rows_per_client = max_rows_per_client
        self.rows: list[_Row] = []
        self.cache = self._batch_cache()
        self.waiting: deque[_Waiting] = deque()
        self.costs = CostModel()
        self.plan = plan
        if (
            prefill_chunk is not None
            and prefill_chunk != "auto"
            and not (isinstance(prefill_chunk, int) and prefill_chunk >= 1)
        ):
            raise ValueError(
                "prefill_chunk must be an integer >= 1, 'auto' (about one step's cost) or None (every "
                "prompt prefilled whole at admission)"
            )
        self.prefill_chunk = prefill_chunk
        # an engine whose chunked prefill scores otherwise on this CPU (the load-time check) prefills whole
        self._chunks = prefill_chunk is not None and getattr(self.target, "prefills_in_chunks", True)
        self.padding = getattr(self.target, "min_call_tokens", 1)
        self._chunk_sizes: dict[int, int] = {}  # decoding rows -> the "auto" chunk (``_auto_chunk``)
        self._predicted = 0.0  # the planned step's predicted seconds (0: not planned)
        self.draft_lengths: collections.Counter = collections.Counter()  # planned draft length -> row-steps
        self.counters = {
            "steps": 0,
            "speculative_steps": 0,
            "row_steps": 0,
            "step_time": 0.0,
            "engine_time": 0.0,
            "admitted": 0,
            "finished": 0,
            "cancelled": 0,
            "timed_out": 0,
            "refused": 0,
            "failed": 0,
        }
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.faults = 0  # steps whose shared target call failed (every running row failed with it)
        self.health = FaultWatch()  # engine failures in a row: what the server's probes report

    # --- the outside ----------------------------------------------------------------------------------------------

    def submit(
        self,
        prompt,
        request: DecodeRequest | None = None,
        *,
        chat: bool = False,
        timeout: float | None = None,
        sink: Callable[[Event], None] | None = None,
        client: str = "",
        **options,
    ) -> Handle:
        """Queue one request (a prompt string, or chat messages with ``chat``); what to generate is a DecodeRequest
        (``request``, or its fields as keywords, as SpeculativeGenerator.generate takes them), validated here, so a
        bad one raises RequestError at once (its response format is compiled here too, before it queues).
        ``timeout``: seconds from now after which it finishes with reason "timeout". ``client``: who sent it; a
        free row goes to the waiting request whose client holds the fewest rows (first come first served among
        equals), and none beyond ``max_rows_per_client``."""
        request = merged_request(request, options)
        if isinstance(request.seed, list):  # the generator takes one seed per prompt; a request is one prompt
            raise RequestError(f"seed: expected an integer >= 0 or None, received {request.seed!r}")
        if request.adaptive or request.fallback:
            raise RequestError(
                "adaptive and fallback are the Python API's batch options; the scheduler plans "
                "each row's draft length at every step"
            )
        if timeout is not None and not timeout > 0:
            raise RequestError(f"timeout: expected seconds > 0, received {timeout!r}")
        with self._lock:  # a full queue refuses before any tokenizing or template rendering is spent on it
            self._check_room()
        config, stops = self.generator.decode_config(request)
        # an unknown drafter fails here, not in the loop
        self.generator.new_drafter(request.mode, request.drafter, request.draft_confidence)
        ids = self.generator.encode_prompt(prompt, chat)
        handle = Handle(next(self._ids), sink)
        with self._lock:
            self._check_room()
            self.waiting.append(_Waiting(handle, ids, config, stops, request, timeout, client))
            self._lock.notify()
        return handle

    def check_room(self) -> None:
        """Overloaded (or Unavailable) now: a caller about to spend work on a request (a grammar compile) asks
        first, so a full queue refuses before the work."""
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
        ``stop``."""
        if calibrate or (calibrate is None and self.plan):
            self.calibrate()
        self._thread = threading.Thread(target=self._loop, name="draftsmith-scheduler", daemon=True)
        self._thread.start()
        return self

    def calibrate(self) -> None:
        """Measure the call costs the step plans read (the generator's, shared with its batches)."""
        self.costs = self.generator.step_costs(self.max_batch)

    def stop(self) -> None:
        """Stop the loop; every request still waiting or running gets an error event."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
        self._fail_all(Unavailable("the scheduler is stopping"))

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
        c = dict(self.counters)
        steps = max(1, c["steps"])
        planned = sum(self.draft_lengths.values())
        c.update(
            running=len(self.rows),
            waiting=len(self.waiting),
            mean_batch=c["row_steps"] / steps,
            mean_draft_length=sum(k * n for k, n in self.draft_lengths.items()) / max(1, planned),
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
                self.faults += 1
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
        plan = self._plan()
        if all(plan.idle):  # every row is still prefilling: nobody waits on a step, so a bigger chunk alone
            engine_time += self._prefill_chunk(CHUNK_BOUNDS[1] if self.prefill_chunk == "auto" else None)
            self._count(0, False, time.perf_counter() - start, engine_time)
            self._retire([""] * len(self.rows))
            return True
        speculate = any(plan.drafting)
        groups = [DraftGroup(row.drafter, [b]) for b, row in enumerate(self.rows)]
        with contextlib.nullcontext() if self.policy == "exact" else unpadded(self.target):
            result = decode_step(self.target, self.cache, self.rows, groups, plan, isolate=isolated)
        for b, row in enumerate(self.rows):
            if plan.prefill[b]:
                isolated([row], self._prefilled, row, len(plan.prefill[b]), result.prefilled[b])
                continue
            isolated(
                [row], self._after_step, row, plan.drafting[b], result.drafted[b], result.accepted[b], result.new[b]
            )
        seconds = result.draft_time + result.verify_time
        self.costs.observe(self._predicted, seconds)  # the costs follow how steps actually run
        self._predicted = 0.0
        self._count(plan.idle.count(False), speculate, time.perf_counter() - start, engine_time + seconds)
        for k, idle in zip(plan.limits, plan.idle):
            if not idle:
                self.draft_lengths[k] += 1
        self._retire([row.finished for row in self.rows])
        return True

    def _count(self, rows: int, speculate: bool, step_time: float, engine_time: float) -> None:
        c = self.counters
        c["steps"] += 1
        c["speculative_steps"] += speculate
        c["row_steps"] += rows
        c["step_time"] += step_time
        c["engine_time"] += engine_time

    def _plan(self) -> StepPlan:
        """This step's plan: how far each row drafts (``_draft_lengths``; 0: not at all) and which call scores
        them: one call for every row where the target takes a ragged batch (runtime/engines/onnx.py), each row
        padded as its lone call would be ("exact") or not at all ("throughput")."""
        idle = [bool(row.prefill_left) for row in self.rows]
        limits = [self._draft_limit(row) if row.drafter is not None and not i else 0 for row, i in zip(self.rows, idle)]
        ks = self._draft_lengths(limits)
        alone = None if self.policy == "throughput" else [True] * len(self.rows)
        return StepPlan(ks, [k > 0 for k in ks], alone, idle=idle, prefill=self._prefill_plan(idle))

    def _prefill_plan(self, idle: list[bool]) -> list[list[int]]:
        """The prompt chunk each row still prefilling feeds in this step's target call: the oldest such row gets
        ``_chunk()`` tokens, the others wait (one chunk a step: a running stream's gap grows by one chunk's share of
        the call, not more)."""
        out: list[list[int]] = [[] for _ in self.rows]
        if not self._chunks or all(idle):
            return out
        for b, row in enumerate(self.rows):
            if idle[b] and row.error is None:
                out[b] = row.prefill_left[: self._chunk(idle.count(False))]
                break
        return out

    def _draft_lengths(self, limits: list[int]) -> list[int]:
        """Each row's draft length: its limit until the costs are measured (or without ``plan``); else the lengths
        that give the batch the most expected tokens per second (runtime/decoding/step_costs.py), each row kept
        from drafting probing again every PROBE_EVERY steps; a request that asked for no plan (``plan=False``) and
        a seeded sampled row ("exact": whether it drafts changes how its random stream is used) at its limit."""
        if not self.plan or not self.costs.calibrated or not any(limits):
            return limits
        width = 1 if self.policy == "throughput" else self.padding
        inputs = PlanInputs(
            [row.acceptance for row in self.rows],
            limits,
            shared_drafter=False,
            min_width=width,
            plain_width=width,
            paid=[row.drafter is not None and row.drafter.calls_draft_engine for row in self.rows],
        )
        ks = with_probes(plan_draft_lengths(self.costs, inputs), limits, self.rows)
        fixed = [not row.config.plan or (self.policy == "exact" and row.pinned) for row in self.rows]
        ks = [limit if keep else k for k, limit, keep in zip(ks, limits, fixed)]
        self._predicted = step_cost(self.costs, ks, inputs)
        return ks

    def _draft_limit(self, row: _Row) -> int:
        """Draft tokens the row may propose: k, within its budget and the context; 0 once its drafter is done with
        it (``can_draft``: a cross-tokenizer draft whose context the row's text outgrew)."""
        budget = row.config.max_new_tokens - len(row.generated) - 1
        context = self.target.max_context - len(row.prompt) - len(row.generated)
        if row.drafter is not None and not all(row.drafter.can_draft() or [True]):
            return 0
        return max(0, min(row.config.k, budget, context))

    def _after_step(self, row: _Row, drafting: bool, drafted: int, accepted: int, new: list[int]) -> None:
        """A row's acceptance estimate (from steps that drafted), then its text and the event its client gets."""
        piece = row.decoder.push(new) if new else ""
        if row.finished:
            piece += row.decoder.flush()
        piece, stopped = row.sent.push(piece)
        if stopped:
            row.finished = "stop"
        elif row.finished:
            piece += row.sent.flush()
        if piece:
            row.handle.send(Event(piece, new, logprobs=row.take_logprobs()))

    # --- admission and retirement ---------------------------------------------------------------------------------

    def _admit(self) -> float:
        """Admit waiting requests into free rows (``_take``); returns the seconds spent prefilling. Each admission
        is its own: a request whose setup or prefill fails gets its error, the others admitted with it run."""
        with self._lock:
            taken = self._take(self.max_batch - len(self.rows))
        if not taken:
            return 0.0
        start = time.perf_counter()
        ready = []
        for w in taken:  # its drafter: the request's own work
            try:
                ready.append((w, self._row(w)))
            except Exception as err:
                self._refuse_admission(w, err)
        prefill = self._prefill_in_place if hasattr(self.target, "prefill_row") else self._prefill_and_join
        states = prefill([w for w, _ in ready]) if ready else []
        own = bool(ready) and self._judge_admission(states)
        for (w, row), state in zip(ready, states):
            if isinstance(state, Exception):
                self._refuse_admission(w, own_failure(state, len(w.prompt)) if own else state)
            elif state is PENDING:  # prefilled a chunk a step from the next step on (``_prefill_chunk``)
                row.prefill_left = list(w.prompt[:-1])
                self.rows.append(row)
                self.counters["admitted"] += 1
            elif self._take_features(w, row, state):
                self.rows.append(row)
                self.counters["admitted"] += 1
        return time.perf_counter() - start

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

    def _prefill_chunk(self, budget: int | None = None) -> float:
        """Prefill up to ``budget`` (default ``_chunk()``) prompt tokens of the rows still prefilling, oldest first,
        in calls of their own: a step where no row decodes (otherwise the chunk rides in the step's own target call,
        ``_prefill_plan``). A row whose prompt is done hands its hidden states to its drafter and decodes from the
        next step on. Returns the seconds spent."""
        start = time.perf_counter()
        budget = (self._chunk(0) if budget is None else budget) if self._chunks else 0
        for b, row in enumerate(self.rows):
            if budget <= 0:
                break
            if row.prefill_left and row.error is None:
                take = min(budget, len(row.prefill_left))
                isolated([row], self._prefill_part, b, row, take)
                budget -= take
        return time.perf_counter() - start

    def _chunk(self, decoding: int | None = None) -> int:
        """Prompt tokens a step prefills (vLLM's and TensorRT-LLM's chunked prefill: a long prompt's admission costs
        the running rows a chunk a step, not its whole prefill at once): ``prefill_chunk``, or with "auto" the most
        that keep the step's target call, with the chunk as one more row of it, within CHUNK_GAP times the call
        without it on the measured costs (``decoding`` rows; default: every running row), within CHUNK_BOUNDS. A
        running stream's gaps then grow by at most about that factor while a long prompt is admitted; the prompt's
        first token comes later the smaller the chunk."""
        if self.prefill_chunk != "auto":
            return int(self.prefill_chunk)
        if not self.costs.calibrated:
            return 64
        decoding = len(self.rows) if decoding is None else decoding
        if decoding not in self._chunk_sizes:
            self._chunk_sizes[decoding] = self._auto_chunk(decoding)
        return self._chunk_sizes[decoding]

    def _auto_chunk(self, decoding: int) -> int:
        low, high = CHUNK_BOUNDS
        if decoding == 0:
            return high
        widths = [max(self.padding, 2)] * decoding
        allowed = CHUNK_GAP * self.costs.call_cost(widths)
        fits = [c for c in range(low, high + 1) if self.costs.call_cost(widths + [c]) <= allowed]
        return max(fits) if fits else low

    def _prefill_part(self, b: int, row: _Row, take: int) -> None:
        self._prefilled(row, take, self.target.prefill_row(self.cache, b, row.prefill_left[:take]))

    def _prefilled(self, row: _Row, take: int, state) -> None:
        """Book ``take`` prompt tokens of a row as prefilled (``state``: their hidden states, None: none); a row whose
        prompt is done hands them all to its drafter."""
        row.prefill_states.append(state)
        del row.prefill_left[:take]
        if not row.prefill_left and row.drafter is not None:
            states, row.prefill_states = row.prefill_states, []
            row.drafter.take_features(None if any(s is None for s in states) else [np.concatenate(states)])

    def _take_features(self, w: _Waiting, row: _Row, state) -> bool:
        """Hand a prefilled row's final hidden states to its drafter; False (the request refused, its cache row
        dropped) when that fails."""
        try:
            if row.drafter is not None:
                row.drafter.take_features(None if state is None else [state])
            return True
        except Exception as err:
            self._refuse_admission(w, err)
            keep = np.array([b for b in range(self.cache.batch) if b != len(self.rows)], dtype=np.int64)
            self.cache = self.target.select(self.cache, keep)  # its row is the first after the running ones
            return False

    def _refuse_admission(self, w: _Waiting, err: Exception) -> None:
        error = err if isinstance(err, RequestError) else Unavailable(f"admission failed: {err}")
        w.handle.send(Event(error=error))

    def _prefill_in_place(self, taken: list[_Waiting]) -> list:
        """Each admitted prompt (but its last token) prefilled in a row of its own in the batch cache, with the
        calls it would get alone; its final hidden states (None: none), or the error its own prefill raised (its row
        is dropped again: the batch cache holds only the others)."""
        first = self.cache.batch
        try:
            self.cache = self.target.add_rows(self.cache, len(taken))
        except Exception as err:
            return [err] * len(taken)
        states = []
        for i, w in enumerate(taken):
            if self._chunks and len(w.prompt) - 1 > self._chunk():
                states.append(PENDING)
                continue
            try:
                states.append(self.target.prefill_row(self.cache, first + i, w.prompt[:-1]))
            except Exception as err:
                states.append(err)
        if any(isinstance(s, Exception) for s in states):
            keep = list(range(first)) + [first + i for i, s in enumerate(states) if not isinstance(s, Exception)]
            self.cache = self.target.select(self.cache, np.array(keep, dtype=np.int64))
        return states

    def _prefill_and_join(self, taken: list[_Waiting]) -> list:
        """The admitted prompts prefilled in a cache of their own, which then joins the batch's. When that shared
        call fails, each prompt again alone, so only the one at fault fails (its state: the error)."""
        try:
            return self._prefill_joined(taken)
        except Exception as err:
            if len(taken) == 1:
                return [err]
        states = []
        for w in taken:
            try:
                states += self._prefill_joined([w])
            except Exception as err:
                states.append(err)
        return states

    def _prefill_joined(self, taken: list[_Waiting]) -> list:
        cache = self.target.new_cache(len(taken))
        if any(len(w.prompt) > 1 for w in taken):
            prefill(self.target, cache, [w.prompt[:-1] for w in taken])
        states = cache.extra.get("hidden")
        self.cache = self.target.join(self.cache, cache)
        return [None if states is None else states[b, : len(w.prompt) - 1] for b, w in enumerate(taken)]

    def _take(self, free: int) -> list[_Waiting]:
        """Under the lock: up to ``free`` waiting requests, each time the oldest of the clients holding the fewest
        rows, none of a client at ``max_rows_per_client``: one client's burst cannot keep the others' requests out
        of the rows (they get the next free ones), yet alone it may use them all (without a cap)."""
        held = collections.Counter(row.client for row in self.rows)
        taken = []
        while len(taken) < free:
            ready = [
                w for w in self.waiting if self.max_rows_per_client is None or held[w.client] < self.max_rows_per_client
            ]
            if not ready:
                break
            fewest = min(held[w.client] for w in ready)
            pick = next(w for w in ready if held[w.client] == fewest)
            self.waiting.remove(pick)
            held[pick.client] += 1
            taken.append(pick)
        return taken

    def _row(self, w: _Waiting) -> _Row:
        drafter = self.generator.new_drafter(w.request.mode, w.request.drafter, w.request.draft_confidence)
        if drafter is not None:
            drafter.start([w.prompt])
            if self.plan and w.config.plan:
                drafter.use_costs(self.costs)  # a hybrid picks its source per step by them
        rng = row_generators(w.config.seed if w.config.seed is not None else None, 1)[0]
        deadline = w.handle.submitted + w.timeout if w.timeout else None
        return _Row(
            handle=w.handle,
            prompt=w.prompt,
            config=w.config,
            stops=w.stops,
            drafter=drafter,
            rng=rng,
            decoder=IncrementalDecoder(self.generator.tokenizer),
            sent=StopText(w.stops),
            deadline=deadline,
            client=w.client,
            drafter_name=self.generator.drafter_name(w.request) if drafter is not None else "",
        )

    def _interrupted(self, row: _Row) -> str:
        if row.handle.cancelled:
            return "cancelled"
        if row.deadline is not None and time.perf_counter() > row.deadline:
            return "timeout"
        return ""

    def _retire(self, reasons: list[str]) -> None:
        """Rows with a reason, or whose own work failed, leave: each gets its final (or error) event; the batch
        cache keeps the others."""
        reasons = ["error" if row.error is not None else reason for row, reason in zip(self.rows, reasons)]
        if not any(reasons):
            return
        keep = [b for b, reason in enumerate(reasons) if not reason]
        leaving = [(row, reason) for row, reason in zip(self.rows, reasons) if reason]
        self.rows = [self.rows[b] for b in keep]  # first, so stats() never counts a row as both ended and running
        for row, reason in leaving:
            if reason == "error":
                self.counters["failed"] += 1
                row.handle.send(Event(error=row_failure(row.error)))
                continue
            row.finished = reason
            tail = row.decoder.flush() if reason in ("cancelled", "timeout") else ""
            tail = row.sent.push(tail)[0] + row.sent.flush() if reason in ("cancelled", "timeout") else row.sent.flush()
            row.stats.finish_reason, row.stats.prompt_tokens = reason, len(row.prompt)
            self.generator.metrics.add(row.stats, row.drafter_name)
            key = {"cancelled": "cancelled", "timeout": "timed_out"}.get(reason, "finished")
            self.counters[key] += 1
            row.handle.send(
                Event(
                    tail,
                    [],
                    final=Generation(
                        row.sent.text,
                        list(row.generated),
                        len(row.prompt),
                        reason,
                        row.stats,
                        row.logprobs,
                        row.top_logprobs,
                    ),
                    logprobs=row.take_logprobs(),
                )
            )
        self.cache = self.target.select(self.cache, np.array(keep, dtype=np.int64))

    def _refuse_stale(self) -> None:
        """Requests cancelled while waiting, or waiting longer than max_wait, leave the queue."""
        now = time.perf_counter()
        with self._lock:
            stale = [w for w in self.waiting if w.handle.cancelled or now - w.handle.submitted > self.max_wait]
            for w in stale:
                self.waiting.remove(w)
        for w in stale:
            if w.handle.cancelled:
                self.counters["cancelled"] += 1
                w.handle.send(Event(final=Generation("", [], len(w.prompt), "cancelled")))
            else:
                self.counters["refused"] += 1
                w.handle.send(
                    Event(
                        error=Overloaded(
                            f"overloaded: waited {now - w.handle.submitted:.1f} s for a "
                            f"free row (the limit is {self.max_wait:g} s); retry later"
                        )
                    )
                )

    def _fail_running(self, error: Exception) -> None:
        failed, self.rows = self.rows, []  # gone from stats() before their clients hear of it
        for row in failed:
            row.handle.send(Event(error=error))
        self.cache = self._batch_cache()

    def _batch_cache(self):
        """The running batch's cache. An engine that can (FusedEngine) reserves ``max_batch`` rows of the whole
        context once, so the server holds its KV cache from the start and no request makes it grow; rows are then
        prefilled in place (``_prefill_in_place``). Others start empty and grow by joining."""
        reserve = getattr(self.target, "reserved_cache", None)
        return reserve(self.max_batch) if reserve is not None else self.target.new_cache(0)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            waiting, self.waiting = list(self.waiting), deque()
        for w in waiting:
            w.handle.send(Event(error=error))
        self._fail_running(error)


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


def engine_answers(engine) -> bool:
    """Whether ``engine`` still runs a call: one token on a fresh one-row cache. A sticky fault (ONNX Runtime out
    of memory on every call, a CUDA error) fails it too; a prompt too big for the memory left does not."""
    try:
        engine.forward(engine.new_cache(1), np.zeros((1, 1), np.int64))
    except Exception:
        return False
    return True


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
