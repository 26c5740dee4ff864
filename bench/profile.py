"""Where an engine call's time goes: ONNX Runtime's profiler over a few decode calls, per operator type.

Used by ``draftsmith bench`` (the ``profile`` section of its JSON) and alone::

    draftsmith profile BUNDLE [--past 64] [--new 1] [--calls 20] [--threads 2]
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
from pathlib import Path

import click
import numpy as np


def node_counts(path: str | os.PathLike) -> dict[str, int]:
    """Operator types of the graph as stored (before ONNX Runtime's own fusions)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return dict(collections.Counter(node.op_type for node in model.graph.node).most_common())


def profile_entry(
    root: Path, entry, max_context: int, threads: int, past: int = 64, new: int = 1, calls: int = 20
) -> dict:
    """Per-operator time of ``calls`` calls of ``new`` tokens on a past of ``past`` tokens (batch 1), through the
    runtime's own engine class for the entry's graph. Returns {"calls", "mean_call_ms", "ops": {op: {"ms", "nodes"}},
    "stored_nodes", "optimized_nodes"}: per call, the profiler's kernel time per operator type and how many nodes of
    it ran (after ONNX Runtime's fusions)."""
    from runtime.engines.onnx import new_engine
    from runtime.engines.sessions import make_session, session_options
    from runtime.decoding.step_costs import scratch_call

    with tempfile.TemporaryDirectory(prefix="draftsmith-profile-") as tmp:
        options = session_options(threads)  # the runtime's own thread pool and spinning
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "profile")
        session = make_session(root / entry.engine, options=options)
        kwargs = {"min_call_tokens": entry.min_call_tokens} if entry.graph == "fused" else {}
        engine = new_engine(entry.graph, root / entry.engine, entry, max_context, session=session, **kwargs)
        cache = engine.new_cache(1)
        rng = np.random.default_rng(0)
        scratch_call(engine, cache, rng.integers(0, min(entry.vocab_size, 1000), (1, past)))  # features if a
        for _ in range(calls):  # feature draft takes them (zeros of its width)
            scratch_call(engine, cache, np.zeros((1, new), np.int64))
            engine.rollback(cache, np.array([past]))
        events = json.loads(Path(session.end_profiling()).read_text())
    return {**_summarize(events), "past": past, "new_tokens": new, "stored_nodes": node_counts(root / entry.engine)}


def _summarize(events: list[dict]) -> dict:
    """Kernel time per operator type, averaged over the runs after the first (the prompt)."""
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    if len(runs) < 2:
        return {"calls": 0, "mean_call_ms": 0.0, "ops": {}}
    after = runs[0]["ts"] + runs[0]["dur"]
    timed = runs[1:]
    time_by, count_by = collections.Counter(), collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event.get("ts", 0) > after and event.get("name", "").endswith("_kernel_time"):
            op = event.get("args", {}).get("op_name", "?")
            time_by[op] += event["dur"]
            count_by[op] += 1
    n = len(timed)
    ops = {op: {"ms": round(us / n / 1000, 3), "nodes": round(count_by[op] / n)} for op, us in time_by.most_common()}
    return {
        "calls": n,
        "mean_call_ms": round(sum(r["dur"] for r in timed) / n / 1000, 3),
        "ops": ops,
        "optimized_nodes": sum(v["nodes"] for v in ops.values()),
    }


def profile_bundle(root: str | os.PathLike, threads: int = 0, past: int = 64, new: int = 1, calls: int = 20) -> dict:
    """``profile_entry`` for the target and the draft of a bundle."""
    from runtime.bundle import load_manifest

    root = Path(root)
    manifest = load_manifest(root)
    return {
        entry.role: profile_entry(root, entry, manifest.max_context, threads, past, new, calls)
        for entry in (manifest.target, manifest.draft)
    }


@click.command("profile")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--past", type=int, default=64, show_default=True, help="Tokens already in the cache.")
@click.option("--new", type=int, default=1, show_default=True, help="New tokens per call (k + 1 for a verify).")
@click.option("--calls", type=int, default=20, show_default=True, help="Calls profiled (after the prompt).")
@click.option("--threads", type=int, default=0, show_default=True, help="ONNX Runtime threads (0: all cores).")
def profile(bundle, past, new, calls, threads):
    """Per-operator time of BUNDLE's target and draft calls (ONNX Runtime's profiler), as JSON."""
    for name, value in (("--past", past), ("--new", new), ("--calls", calls)):
        if value < 1:
            raise click.BadParameter("must be >= 1", param_hint=name)
    click.echo(json.dumps(profile_bundle(bundle, threads, past, new, calls), indent=2))
