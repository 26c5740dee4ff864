"""The bench's measurement: every (workload, batch, mode, k, drafter) cell decoded through the generator's own loop,
timed per step and per engine call, then summarized against target-only decoding.

How a measurement runs: for each workload and batch size, the prompts are taken a batch at a time and each batch is
decoded target-only and then with every k, back to back (interleaved, so slow drifts of a shared machine hit every
configuration alike), after one untimed warm-up per configuration. The engines' calls are observed with timers
(nothing else changes), which splits the time into draft calls, verify calls, prefill, and the loop's own work
outside the engines. The report math lives in ``bench.stats``; this module only records.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

from bench.stats import CellRecord, EngineCall, SequenceRecord, summarize
from runtime.engines.base import Call
from runtime.core.request import Asked, decode_request


class Recorder:
    """Every call of a generator's engines, timed (the whole call and its ONNX Runtime part) into ``calls``: the
    engines' own observers (runtime/engines/base.py), so nothing of theirs is wrapped or patched."""

    def __init__(self, generator, drafts: list | None = None):
        """``drafts``: draft engines besides the generator's (other bundles' drafts a bench compares)."""
        self.calls: list[EngineCall] = []
        self._watched = []
        for role, engine in [("target", generator.target), ("draft", generator.draft)] + [
            ("draft", d) for d in drafts or []
        ]:
            if engine is not None and all(engine is not e for e, _ in self._watched):
                observer = functools.partial(self._record, role)
                engine.watch(observer)
                self._watched.append((engine, observer))

    def _record(self, role: str, call: Call) -> None:
        """A prompt's prefill, and a drafter's first call on its prompt, count as prefill."""
        prefill = call.kind != "forward" or call.first
        self.calls.append(EngineCall(role, prefill, call.seconds, call.session_seconds, call.width, call.rows))

    def take(self) -> list[EngineCall]:
        calls, self.calls = self.calls, []
        return calls

    def close(self) -> None:
        for engine, observer in self._watched:
            engine.unwatch(observer)
        self._watched = []


def decode(
    generator,
    token_lists: list[list[int]],
    mode: str,
    k: int | None,
    max_new_tokens: int,
    temperature: float,
    seed: int | None,
    drafter_kind: str | None = None,
    confidence: float | None = None,
    response_format=None,
    forced_drafts: bool = True,
    top_p: float | None = None,
    policy: str = "exact",
    plan: bool = True,
) -> tuple[list[SequenceRecord], float]:
    """Run one batch through the generator's own decoding loop (``generate``'s: the front door admits the token
    lists, the scheduler runs them as one group), recording each step through the loop's step observer.
    ``response_format`` constrains every answer (target-only decoding too: the baseline is constrained target-only
    decoding). ``plan``: each step's draft lengths from the measured costs, ``k`` the most (False: ``k`` every
    step)."""
    if mode == "plain":  # target-only without exactness padding: what a user's plain decoder runs
        mode, policy = "target", "throughput"
    elif mode == "target":
        policy = "exact"  # target-only is measured padded and plain anyway
    request = decode_request(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        k=k,
        mode=mode,
        drafter=drafter_kind,
        draft_confidence=confidence,
        response_format=response_format,
        forced_drafts=forced_drafts,
        policy=policy,
        plan=plan,
    )
    admitted = generator.door.admit(Asked.tokenized(token_lists, request))
    records = [SequenceRecord() for _ in token_lists]
    clock = StepClock(records)
    if admitted.drafter is not None and admitted.config.plan:
        generator.step_costs(len(token_lists))  # measured before the clock starts, as every run of this batch size
    clock.start = time.perf_counter()
    for _ in generator.run(admitted, on_step=clock.record):
        pass
    return records, time.perf_counter() - clock.start


@dataclass
class StepClock:
    """The loop's step observer for the bench: each row's (drafted, accepted, emitted, seconds since its last step),
    its time to first token and its tokens."""

    records: list[SequenceRecord]
    start: float = 0.0
    counters: dict = dataclasses.field(default_factory=dict)  # row -> (draft tokens, accepted tokens) so far
    last: dict = dataclasses.field(default_factory=dict)  # row -> when its last step ended

    def record(self, step) -> None:
        now = time.perf_counter()
        for row, new in step:
            i, record = row.index, self.records[row.index]
            drafted0, accepted0 = self.counters.get(i, (0, 0))
            self.counters[i] = (row.stats.num_draft_tokens, row.stats.num_accepted_tokens)
            drafted, accepted = self.counters[i][0] - drafted0, self.counters[i][1] - accepted0
            record.steps.append((drafted, accepted, len(new), now - self.last.get(i, self.start)))
            self.last[i] = now
            if new and not record.ttft:
                record.ttft = now - self.start
            record.token_ids.extend(new)


def pads(engine) -> bool:
    """Whether the target pads its one-token calls for exactness: then target-only decoding is measured twice,
    padded (what speculation is identical to) and plain (the speedup's baseline)."""
    return engine.min_call_tokens > 1


def run_workloads(
    generator,
    workloads: dict[str, list[list[int]]],
    ks: list[int],
    batches: list[int],
    max_new_tokens: int,
    temperature: float,
    seed: int | None = 0,
    advance=None,
    drafter_kind: str | None = None,
    confidence: float | None = None,
    response_format=None,
    forced_drafts: bool = True,
    top_p: float | None = None,
    policy: str = "exact",
    drafters: dict[str, tuple] | None = None,
) -> list[CellRecord]:
    """Measure every (workload, batch, mode, k, drafter) cell; ``advance(description)`` is called after each decode;
    ``policy`` is the speculative cells' (DecodeRequest.policy). ``drafters``: label -> (generator, drafter kind)
    (``drafters_of``), each run at every k; default: ``drafter_kind`` on ``generator``."""
    structure = dict(response_format=response_format, forced_drafts=forced_drafts, top_p=top_p, policy=policy)
    drafters = drafters or {drafter_kind or "": (generator, drafter_kind)}
    recorder = Recorder(generator, [g.draft for g, _ in drafters.values()])
    cells: list[CellRecord] = []
    configs = (
        [("target", None, "")]
        + ([("plain", None, "")] if pads(generator.target) else [])
        + [("speculative", k, label) for label in drafters for k in ks]
    )
    runner = {"": (generator, drafter_kind), **drafters}

    def run(label: str, mode: str, k: int | None, token_lists: list[list[int]], limit: int):
        """One cell's decode of ``token_lists``, ``limit`` new tokens each (warm-up and measured runs alike)."""
        cell_generator, kind = runner[label]
        return decode(cell_generator, token_lists, mode, k, limit, temperature, seed, kind, confidence, **structure)

    try:
        for name, token_lists in workloads.items():
            for batch in batches:
                mine = {c: CellRecord(name, batch, c[0], c[1], c[2]) for c in configs}
                cells += mine.values()
                for mode, k, label in configs:  # warm-up: first calls allocate, JIT-pick kernels and fill caches
                    run(label, mode, k, token_lists[:batch], min(8, max_new_tokens))
                recorder.take()
                for turn, at in enumerate(range(0, len(token_lists), batch)):
                    chunk = token_lists[at : at + batch]
                    shift = turn % len(configs)  # rotated: no configuration always runs first or after another
                    for mode, k, label in configs[shift:] + configs[:shift]:
                        records, wall = run(label, mode, k, chunk, max_new_tokens)
                        cell = mine[(mode, k, label)]
                        cell.sequences += records
                        cell.wall += wall
                        cell.calls += recorder.take()
                        if advance:
                            advance(f"{name} b={batch} " + (mode if k is None else f"k={k} {label}".rstrip()))
    finally:
        recorder.close()
    return cells


def summarize_cells(cells: list[CellRecord], temperature: float) -> list[dict]:
    """One row per cell. Speedups are over plain target-only decoding of the same workload/batch (unpadded; the
    padded target-only cell where the target does not pad), identity is against the padded target-only cell of batch
    1 where measured (each prompt decoded alone: what speculation promises to equal at any batch; a batched
    target-only run calls the target with other shapes, so it may part from it on near ties), else of the same batch.
    ``speedup_over_padded`` keeps the ratio to the padded cell."""
    padded = {(c.workload, c.batch): c for c in cells if c.mode == "target"}
    plain = {(c.workload, c.batch): c for c in cells if c.mode == "plain"}
    rows = []
    for cell in cells:
        key = (cell.workload, cell.batch)
        row = summarize(cell, plain.get(key) or padded.get(key))
        if key in plain and cell.mode != "plain":
            row["speedup_over_padded"] = summarize(cell, padded[key])["speedup"]
        if cell.mode == "speculative" and key in plain:
            alone = padded.get((cell.workload, 1), padded[key])
            row["identical_to_target"] = summarize(cell, alone)["identical_to_target"]
        if cell.mode in ("target", "plain") and key not in plain:
            row["speedup"] = 1.0
        if cell.mode in ("target", "plain"):
            row["identical_to_target"] = None
        if temperature > 0:
            row["identical_to_target"] = None  # sampled outputs differ by design
        rows.append(row)
    return rows
