"""The bench's report as JSON: the sweep's rows with each workload's best k, where the time goes and the
recommended k; the bandwidth bound (``--limit``); and the file written after each phase, so a slow or interrupted
phase loses nothing measured before it. Rendering is bench/report.py."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from bench.bench_options import BenchOptions
from bench.stats import CellRecord, bandwidth_bound, best_k, recommend_k, where_time_goes
from bench.sweep import summarize_cells


def speed_report(
    options: BenchOptions, manifest, workloads, chat_used, ks, batches, response_format, cells: list[CellRecord]
) -> dict:
    """The report of the sweep: settings, the bundle, a row per cell, each workload's best k, where the time goes
    and the recommended k."""
    rows = summarize_cells(cells, options.temperature)
    best = best_k(rows)
    rec_k, geomean = recommend_k(rows)
    report = {
        "bundle": str(options.bundle),
        "settings": {
            "workloads": {n: {"prompts": len(t), "chat_template": chat_used[n]} for n, t in workloads.items()},
            "k": ks,
            "batch": batches,
            "temperature": options.temperature,
            "top_p": options.top_p,
            "policy": options.policy,
            "max_new_tokens": options.max_new_tokens,
            "threads": options.threads,
            "seed": options.seed,
            "drafter": options.drafter_kind,
            "draft_confidence": options.confidence,
            "response_format": response_format,
            "forced_drafts": options.forced_drafts,
            "cpu_count": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
        "bundle_info": {
            "target_quant": manifest.target.quant,
            "draft_quant": manifest.draft.quant,
            "draft": manifest.spec.draft,
            "target": manifest.spec.target,
            "default_k": manifest.default_k,
            "max_k": manifest.spec.max_k,
        },
        "results": rows,
        "best_k": {w: r for w, r in best.items()},
        "where_time_goes": where_time_goes(rows, best),
    }
    if rec_k is not None:
        report["recommended_k"] = {
            "k": rec_k,
            "geomean_speedup": geomean,
            "bundle_default_k": manifest.default_k,
            "chosen_by": "highest geometric mean of measured speedup over the workloads, at "
            "each workload's smallest batch; ties to the smaller k",
        }
    return report


def recommended_k(report: dict) -> int | None:
    """The recommended k, None where the sweep recommended none: what ``--memory`` and ``--write-k`` use."""
    return report["recommended_k"]["k"] if "recommended_k" in report else None


def report_saver(report: dict, json_out: Path | None, started: float):
    """``save(final)``: write the JSON report (with ``--json``) after each phase, so a slow or interrupted peer run
    loses nothing measured before it."""

    def save(final: bool) -> None:
        report["seconds"] = time.time() - started
        report["complete"] = final
        if json_out:
            json_out.write_text(json.dumps(report, indent=2, default=_json_default), encoding="utf-8")

    return save


def limit_report(bundle: Path, manifest, rows: list[dict], threads: int) -> dict:
    """The report's ``limit`` section (``--limit``): the machine's memory bandwidth, the weights each engine reads per
    token and so its bandwidth bound, and how near the measured target-only decode rate comes to it."""
    from bench.system import measure_bandwidth, weight_bytes_per_token

    bandwidth = measure_bandwidth(threads=max(1, threads or os.cpu_count() or 1))
    out = {"bandwidth": bandwidth, "engines": {}}
    for entry in (manifest.target, manifest.draft):
        weights = weight_bytes_per_token(bundle / entry.engine)
        weights["bound_tokens_per_second"] = bandwidth_bound(bandwidth["bytes_per_second"], weights["bytes_per_token"])
        weights["size_bytes"] = entry.size_bytes
        weights["quant"] = entry.quant
        out["engines"][entry.role] = weights
    target_rows = [r for r in rows if r["mode"] == "target" and r["batch"] == 1]
    bound = out["engines"]["target"]["bound_tokens_per_second"]
    if target_rows and bound:
        # the steady decode rate (prefill excluded), pooled over workloads: what the bound is about
        # (target-only emits one token per step, so each sequence's first step holds exactly one token)
        decoding = [r for r in target_rows if r["decode_tokens_per_second"]]
        tokens = sum(r["tokens"] - r["prompts"] for r in decoding)
        seconds = sum((r["tokens"] - r["prompts"]) / r["decode_tokens_per_second"] for r in decoding)
        measured = tokens / seconds if seconds else 0.0
        out["target_only_tokens_per_second"] = measured
        out["target_only_step_ms"] = 1e3 * _mean_of(r["verify_call_seconds"] for r in target_rows)
        out["fraction_of_bound"] = measured / bound
        out["bound_over_measured"] = bound / measured if measured else None
    return out


def _mean_of(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
