"""The bench's report math: pure functions over recorded numbers (no engines, no clocks), so tests feed hand-made
values.

Definitions (one *cell* = one workload x batch size x mode x k, summed over its prompts):

- A **step** is one target call after the prefill (a verify call in speculative mode, a decode call target-only).
  Each sequence's step record is ``(drafted, accepted, emitted, seconds_since_previous_event)``.
- **acceptance rate** (vLLM's ``draft_acceptance_rate``): accepted draft tokens / proposed draft tokens.
- **alpha** (Leviathan et al.'s per-token acceptance probability): accepted / judged, where *judged* counts the draft
  tokens the target actually ruled on: the accepted ones plus one rejected token per step that rejected. Tokens after
  a rejection were never judged, so the plain acceptance rate underestimates alpha for k > 1; this is the maximum
  likelihood estimate of alpha under the formula's own model (i.i.d. acceptances, stop at the first rejection).
- **mean acceptance length**: 1 + accepted / steps that drafted (tokens a drafting step emits, bonus token included).
- **tokens/s**: emitted tokens / wall-clock seconds of the loops that produced them (prefill included).
- **decode tokens/s**: tokens after each sequence's first / the time after its first token (prefill excluded): the
  steady decoding rate, which is what the memory-bandwidth bound limits.
- **TTFT**: seconds from the start of a request (prefill included) to its first emitted token; mean and p50.
- **per-token latency**: after the first token, each step that emitted n tokens after a gap of g seconds contributes
  n samples of g / n (the step's time shared by the tokens it delivered); p50 and p95 by linear interpolation.
- **c** (draft/target cost ratio): mean seconds of one draft decode call (the draft engine's ``forward``, prompt
  prefill calls excluded) / mean seconds of one target verify call (the target's ``forward`` after the prefill),
  both measured in the same speculative run; shown for reference.
- **paired speedup**: per prompt, its tokens/s in this cell over its tokens/s in the baseline cell (the same prompt,
  same batch position: a paired ratio, so prompts of different lengths and acceptance do not mix), summarized by
  the geometric mean and a 95% bootstrap interval over prompts (2,000 resamples, fixed seed). ``best_k`` picks the
  smallest k whose interval overlaps the fastest k's: a longer draft must be measurably faster to be chosen.
- **predicted speedup** (Leviathan et al. 2023, eq. 1, priced with the measured costs): E[tokens per step] /
  (n·T_draft + T_verify), where E[tokens per step] = (1 - a^(k+1)) / (1 - a) from the measured alpha, n is the
  mean number of draft calls a step made (measured: lookup steps make none, a step after full acceptance may make
  one more), T_draft and T_verify are the mean draft and verify call seconds of the speculative run, all in units
  of T_step, the mean decode call of the target-only run. A (k+1)-token verify call costs more than a one-token
  step; pricing it as one step (eq. 1's k·c + 1) overstates the speedup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class EngineCall:
    """One ``engine.forward`` call: which engine, whether it was a prompt prefill, its time and ORT's part of it."""

    role: str  # "target" or "draft"
    prefill: bool
    seconds: float  # the whole forward call (numpy glue included)
    ort_seconds: float  # inside InferenceSession.run
    tokens: int = 1  # new positions per row (S)
    batch: int = 1


@dataclass
class SequenceRecord:
    """One prompt's run: per step (drafted, accepted, emitted, gap seconds); the first emitting step's gap is TTFT."""

    steps: list[tuple[int, int, int, float]] = field(default_factory=list)
    ttft: float = 0.0
    token_ids: list[int] = field(default_factory=list)

    @property
    def emitted(self) -> int:
        return sum(s[2] for s in self.steps)


@dataclass
class CellRecord:
    """Everything measured for one cell; ``wall`` sums the wall-clock seconds of the loops (one per batch)."""

    workload: str
    batch: int
    mode: str  # "target", "plain" (target-only with unpadded one-token calls) or "speculative"
    k: int | None
    drafter: str = ""  # a speculative cell's drafter (bench --drafter: a kind, or model@ANOTHER_BUNDLE)
    sequences: list[SequenceRecord] = field(default_factory=list)
    calls: list[EngineCall] = field(default_factory=list)
    wall: float = 0.0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def token_latencies(sequence: SequenceRecord) -> list[float]:
    """Per-token latency samples of one sequence: each step after the first emission spreads its gap over its tokens."""
    samples: list[float] = []
    seen_first = False
    pending_gap = 0.0
    for _, _, emitted, gap in sequence.steps:
        if not seen_first:
            if emitted:
                seen_first = True
            continue
        pending_gap += gap
        if emitted:
            samples += [pending_gap / emitted] * emitted
            pending_gap = 0.0
    return samples


def acceptance(steps: list[tuple[int, int, int, float]]) -> dict:
    """Acceptance figures from per-step (drafted, accepted, ...) counts."""
    drafted = sum(s[0] for s in steps)
    accepted = sum(s[1] for s in steps)
    drafting_steps = sum(1 for s in steps if s[0] > 0)
    rejecting_steps = sum(1 for s in steps if s[1] < s[0])
    judged = accepted + rejecting_steps
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "drafting_steps": drafting_steps,
        "rejecting_steps": rejecting_steps,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "alpha": accepted / judged if judged else 0.0,
        "mean_acceptance_length": 1.0 + accepted / drafting_steps if drafting_steps else 1.0,
        # what the step plan chose: draft tokens per row-step (below k where steps were planned shorter)
        "mean_draft_length": drafted / len(steps) if steps else 0.0,
    }


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens a step emits on average when each of k drafts is accepted with probability alpha until one is not:
    (1 - a^(k+1)) / (1 - a), the bonus or correction token included; k + 1 at a = 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], received {alpha}")
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(
    alpha: float,
    k: int,
    draft_calls_per_step: float,
    draft_call_seconds: float,
    verify_call_seconds: float,
    target_step_seconds: float,
) -> float:
    """Speedup over target-only predicted from measured costs: E[tokens per step] / (n·T_draft + T_verify) in units
    of one target-only step, so a verify call dearer than a one-token step and a step that drafted less than k are
    priced as they were measured. 0 when a cost is missing."""
    if draft_calls_per_step < 0 or draft_call_seconds < 0:
        raise ValueError("draft calls and their cost must be >= 0")
    if verify_call_seconds <= 0 or target_step_seconds <= 0:
        return 0.0
    step = (draft_calls_per_step * draft_call_seconds + verify_call_seconds) / target_step_seconds
    return expected_tokens_per_step(alpha, k) / step


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def call_costs(calls: list[EngineCall]) -> dict:
    """Mean call times and the time split: draft and verify (ORT / glue), prefill; per-role call counts."""

    def pick(role, prefill):
        return [c for c in calls if c.role == role and c.prefill == prefill]

    draft, verify = pick("draft", False), pick("target", False)
    prefill = [c for c in calls if c.prefill]
    draft_call = _mean([c.seconds for c in draft])
    verify_call = _mean([c.seconds for c in verify])
    return {
        "draft_calls": len(draft),
        "verify_calls": len(verify),
        "draft_call_seconds": draft_call,
        "verify_call_seconds": verify_call,
        "c": draft_call / verify_call if verify_call > 0 and draft else 0.0,
        "draft_calls_per_step": len(draft) / len(verify) if verify else 0.0,
        "draft_ort_seconds": sum(c.ort_seconds for c in draft),
        "draft_glue_seconds": sum(c.seconds - c.ort_seconds for c in draft),
        "verify_ort_seconds": sum(c.ort_seconds for c in verify),
        "verify_glue_seconds": sum(c.seconds - c.ort_seconds for c in verify),
        "prefill_seconds": sum(c.seconds for c in prefill),
        "engine_seconds": sum(c.seconds for c in calls),
    }


def sequence_seconds(sequence: SequenceRecord) -> float:
    """The wall-clock seconds a sequence's loop spent until its last token (its steps' gaps, prefill included)."""
    return sum(s[3] for s in sequence.steps)


def paired_ratios(cell: CellRecord, baseline: CellRecord) -> list[float]:
    """Per prompt: tokens/s in ``cell`` over tokens/s in ``baseline`` (prompts in the same order in both)."""
    ratios = []
    for mine, base in zip(cell.sequences, baseline.sequences):
        spent, base_spent = sequence_seconds(mine), sequence_seconds(base)
        if spent > 0 and base_spent > 0 and mine.emitted and base.emitted:
            ratios.append((mine.emitted / spent) / (base.emitted / base_spent))
    return ratios


def bootstrap_interval(
    ratios: list[float], resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float] | None:
    """A percentile bootstrap interval of the geometric mean of ``ratios`` (None for fewer than two)."""
    if len(ratios) < 2:
        return None
    import numpy as np

    logs = np.log(np.asarray(ratios))
    picks = np.random.default_rng(seed).integers(0, len(logs), (resamples, len(logs)))
    means = np.exp(logs[picks].mean(axis=1))
    tail = (1.0 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1.0 - tail))


def summarize(cell: CellRecord, baseline: CellRecord | None = None) -> dict:
    """Every figure of one cell; ``baseline`` is the target-only cell of the same workload and batch (for speedup)."""
    steps = [s for seq in cell.sequences for s in seq.steps]
    tokens = sum(seq.emitted for seq in cell.sequences)
    latencies = [x for seq in cell.sequences for x in token_latencies(seq)]
    ttfts = [seq.ttft for seq in cell.sequences]
    costs = call_costs(cell.calls)
    after_first = sum(len(token_latencies(seq)) for seq in cell.sequences)
    out = {
        "workload": cell.workload,
        "batch": cell.batch,
        "mode": cell.mode,
        "k": cell.k,
        "drafter": cell.drafter,
        "prompts": len(cell.sequences),
        "tokens": tokens,
        "steps": len(steps),
        "wall_seconds": cell.wall,
        "tokens_per_second": tokens / cell.wall if cell.wall > 0 else 0.0,
        "decode_tokens_per_second": after_first / sum(latencies) if sum(latencies) > 0 else 0.0,
        "ttft_mean": _mean(ttfts),
        "ttft_p50": percentile(ttfts, 50),
        "latency_p50": percentile(latencies, 50),
        "latency_p95": percentile(latencies, 95),
    }
    out.update(acceptance(steps))
    out.update(costs)
    out["other_seconds"] = max(0.0, cell.wall - costs["engine_seconds"])
    # the loop's wall time over the sum of its engine calls: what sampling, the plan and bookkeeping add (1.0: none)
    out["step_overhead"] = cell.wall / costs["engine_seconds"] if costs["engine_seconds"] > 0 else None
    out["speedup"] = None
    out["predicted_speedup"] = None
    out["identical_to_target"] = None
    # the unit of the prediction: one target-only step (this cell's own verify call when there is no baseline)
    target_step = call_costs(baseline.calls)["verify_call_seconds"] if baseline is not None else 0.0
    if cell.mode == "speculative" and cell.k:
        out["expected_tokens_per_step"] = expected_tokens_per_step(out["alpha"], cell.k)
        out["predicted_speedup"] = predicted_speedup(
            out["alpha"],
            cell.k,
            costs["draft_calls_per_step"],
            costs["draft_call_seconds"],
            costs["verify_call_seconds"],
            target_step or costs["verify_call_seconds"],
        )
    if baseline is not None:
        base = baseline.wall and sum(s.emitted for s in baseline.sequences) / baseline.wall
        out["speedup"] = out["tokens_per_second"] / base if base else 0.0
        out["verify_vs_target_step"] = costs["verify_call_seconds"] / target_step if target_step else 0.0
        ratios = paired_ratios(cell, baseline)
        out["paired_speedup"] = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
        out["speedup_interval"] = bootstrap_interval(ratios)
        if len(baseline.sequences) == len(cell.sequences):
            same = [a.token_ids == b.token_ids for a, b in zip(cell.sequences, baseline.sequences)]
            out["identical_to_target"] = sum(same) / len(same) if same else None
    return out


def best_k(rows: list[dict]) -> dict[str, dict]:
    """Per workload, at the smallest batch measured: the smallest k whose speedup interval overlaps the interval of
    the k with the highest measured speedup (that k itself where rows carry no intervals; ties go to the smaller
    k): a longer draft is chosen only when it is measurably faster. Returns {workload: row}."""
    best: dict[str, dict] = {}
    spec = [r for r in primary_rows(rows) if r["mode"] == "speculative" and r.get("speedup") is not None]
    for workload in dict.fromkeys(r["workload"] for r in spec):
        mine = [r for r in spec if r["workload"] == workload]
        batch = min(r["batch"] for r in mine)
        mine = sorted((r for r in mine if r["batch"] == batch), key=lambda r: r["k"])
        fastest = max(mine, key=lambda r: (r["speedup"], -r["k"]))
        top = fastest.get("speedup_interval")
        best[workload] = next(
            (
                r
                for r in mine
                if top
                and r.get("speedup_interval")
                and r["speedup_interval"][1] >= top[0]
                and r["speedup_interval"][0] <= top[1]
            ),
            fastest,
        )
    return best


def primary_rows(rows: list[dict]) -> list[dict]:
    """The rows of the first drafter a bench ran (``--drafter a,b``: a's), and the target-only rows: what best k and
    the recommended k are chosen from."""
    first = next((r.get("drafter", "") for r in rows if r["mode"] == "speculative"), "")
    return [r for r in rows if r["mode"] != "speculative" or r.get("drafter", "") == first]


def recommend_k(rows: list[dict]) -> tuple[int | None, float]:
    """One k for the bundle over all workloads measured: the highest geometric mean of speedup across workloads.

    Only k values measured on every workload compete (at each workload's smallest batch); every workload weighs the
    same whatever its prompt count. Ties go to the smaller k. Returns (k, geometric-mean speedup) or (None, 0.0).
    """
    spec = [r for r in primary_rows(rows) if r["mode"] == "speculative" and r.get("speedup")]
    workloads = list(dict.fromkeys(r["workload"] for r in spec))
    if not workloads:
        return None, 0.0
    smallest = {w: min(r["batch"] for r in spec if r["workload"] == w) for w in workloads}
    table: dict[int, dict[str, float]] = {}
    for r in spec:
        if r["batch"] == smallest[r["workload"]]:
            table.setdefault(r["k"], {})[r["workload"]] = r["speedup"]
    scores = {
        k: math.exp(sum(math.log(v) for v in by.values()) / len(by))
        for k, by in table.items()
        if len(by) == len(workloads)
    }
    if not scores:
        return None, 0.0
    k = max(scores, key=lambda key: (scores[key], -key))
    return k, scores[k]


def bandwidth_bound(bandwidth_bytes_per_s: float, bytes_per_token: float) -> float:
    """Tokens/s a decoder cannot beat if every token reads ``bytes_per_token`` of weights once from memory."""
    return bandwidth_bytes_per_s / bytes_per_token if bytes_per_token > 0 else 0.0


def where_time_goes(rows: list[dict], best: dict[str, dict]) -> list[dict]:
    """Shares of wall time at each workload's best k: draft/verify calls (and ORT's part), prefill, the rest."""
    out = []
    for workload, row in best.items():
        wall = row["wall_seconds"] or 1.0
        draft = row["draft_ort_seconds"] + row["draft_glue_seconds"]
        verify = row["verify_ort_seconds"] + row["verify_glue_seconds"]
        out.append(
            {
                "workload": workload,
                "batch": row["batch"],
                "k": row["k"],
                "draft": draft / wall,
                "draft_ort": row["draft_ort_seconds"] / wall,
                "verify": verify / wall,
                "verify_ort": row["verify_ort_seconds"] / wall,
                "prefill": row["prefill_seconds"] / wall,
                "other": row["other_seconds"] / wall,
                "draft_call_ms": row["draft_call_seconds"] * 1e3,
                "verify_call_ms": row["verify_call_seconds"] * 1e3,
                "verify_vs_target_step": row.get("verify_vs_target_step") or 0.0,
            }
        )
    return out
