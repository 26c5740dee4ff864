"""Where an engine call's time goes: ONNX Runtime's profiler over a few decode calls, per operator type, with the
weight bytes each operator type reads a call; and how a call's cost grows with its tokens (a verify of k + 1 tokens
against a one-token step), beside llama.cpp's own on the same GGUF file.

Used by ``draftsmith bench`` (the ``profile`` section of its JSON) and alone::

    draftsmith profile BUNDLE [--past 64] [--new 1,2,3,4,8] [--calls 20] [--threads 2] [--llama-cpp]

``--llama-cpp`` runs ``llama-bench -p <new> -n 0 -t <threads>`` (its own tool, found as the bench's llama.cpp peer
finds it) on the target's GGUF file: its time for a prompt of n tokens is a call of n tokens.
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


def weight_bytes(path: str | os.PathLike) -> dict[str, int]:
    """Bytes of the initializers each operator type reads, by type: what a call streams from memory for its weights
    (a Gather reads only the rows it picks: its table is listed apart as ``<op> (table)``)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) * _itemsize(t.data_type) for t in model.graph.initializer}
    out: collections.Counter = collections.Counter()
    for node in model.graph.node:
        read = sum(sizes.get(name, 0) for name in node.input)
        if read:
            out[f"{node.op_type} (table)" if node.op_type.startswith("Gather") else node.op_type] += read
    return dict(out.most_common())


def _itemsize(data_type: int) -> int:
    from onnx import helper

    return np.dtype(helper.tensor_dtype_to_np_dtype(data_type)).itemsize


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
    return {
        **_summarize(events),
        "past": past,
        "new_tokens": new,
        "stored_nodes": node_counts(root / entry.engine),
        "weight_bytes": weight_bytes(root / entry.engine),
    }


def call_widths(
    root: Path, entry, max_context: int, threads: int, past: int, news: tuple[int, ...], calls: int
) -> dict:
    """``profile_entry`` at each call width in ``news``, and each width's cost over a one-token call's (a verify of
    n tokens against one step): {"by_new": {n: profile}, "ratio": {n: ms_n / ms_1}} (the ratio where 1 is among
    ``news``)."""
    by_new = {n: profile_entry(root, entry, max_context, threads, past, n, calls) for n in news}
    out = {"by_new": by_new}
    if 1 in by_new and by_new[1]["mean_call_ms"]:
        out["ratio"] = {n: round(p["mean_call_ms"] / by_new[1]["mean_call_ms"], 3) for n, p in by_new.items()}
    return out


def llama_bench_widths(gguf: Path, news: tuple[int, ...], threads: int, repetitions: int = 3) -> dict:
    """llama.cpp's own cost of a call of n tokens on ``gguf``: ``llama-bench -p n -n 0`` (a prompt of n tokens is one
    call of n tokens), {"ms": {n: ms a call}, "ratio": {n: over one token}}, or {"skipped": why}."""
    import subprocess

    from bench.peers.llama_cpp_tools import BIN_ENV, tool

    binary = tool("llama-bench")
    if binary is None:
        return {"skipped": f"llama-bench not found in ${BIN_ENV} or on PATH (docs/benchmarks.md: llama.cpp's tools)"}
    command = [str(binary), "-m", str(gguf), "-p", ",".join(map(str, news)), "-n", "0", "-t", str(threads)]
    done = subprocess.run([*command, "-r", str(repetitions), "-o", "json"], capture_output=True, text=True, timeout=900)
    if done.returncode:
        return {"skipped": f"llama-bench failed: {done.stderr[-500:]}"}
    ms = {int(r["n_prompt"]): round(1000 * int(r["n_prompt"]) / float(r["avg_ts"]), 3) for r in json.loads(done.stdout)}
    out = {"command": " ".join(command), "ms": ms}
    if 1 in ms:
        out["ratio"] = {n: round(v / ms[1], 3) for n, v in ms.items()}
    return out


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


def profile_bundle(
    root: str | os.PathLike, threads: int = 0, past: int = 64, new: int | tuple[int, ...] = 1, calls: int = 20
) -> dict:
    """``profile_entry`` for the target and the draft of a bundle; with several widths ``new``, ``call_widths``."""
    from runtime.bundle import load_manifest

    root = Path(root)
    manifest = load_manifest(root)
    if isinstance(new, int):
        return {
            entry.role: profile_entry(root, entry, manifest.max_context, threads, past, new, calls)
            for entry in (manifest.target, manifest.draft)
        }
    return {
        entry.role: call_widths(root, entry, manifest.max_context, threads, past, tuple(new), calls)
        for entry in (manifest.target, manifest.draft)
    }


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected tokens a call, comma-separated (1,2,3,4,8), not {text!r}") from None
    if not widths or min(widths) < 1 or len(widths) > 16:
        raise click.BadParameter("expected 1 to 16 widths, each >= 1", param_hint="--new")
    return widths


@click.command("profile")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--past", type=int, default=64, show_default=True, help="Tokens already in the cache.")
@click.option(
    "--new",
    default="1",
    show_default=True,
    help="New tokens per call (k + 1 for a verify); several, comma-separated, give each width's cost over one token's.",
)
@click.option("--calls", type=int, default=20, show_default=True, help="Calls profiled (after the prompt).")
@click.option("--threads", type=int, default=0, show_default=True, help="ONNX Runtime threads (0: all cores).")
@click.option(
    "--llama-cpp/--no-llama-cpp",
    default=False,
    help="Also time llama.cpp's own calls of the same widths on the target's GGUF file (llama-bench -p N -n 0).",
)
def profile(bundle, past, new, calls, threads, llama_cpp):
    """Per-operator time and weight bytes of BUNDLE's target and draft calls (ONNX Runtime's profiler), as JSON."""
    for name, value in (("--past", past), ("--calls", calls)):
        if value < 1:
            raise click.BadParameter("must be >= 1", param_hint=name)
    widths = _widths(new)
    report = profile_bundle(bundle, threads, past, widths[0] if len(widths) == 1 else widths, calls)
    if llama_cpp:
        report["llama.cpp"] = _llama_cpp(bundle, widths, threads or os.cpu_count() or 1)
    click.echo(json.dumps(report, indent=2))


def _llama_cpp(bundle: Path, widths: tuple[int, ...], threads: int) -> dict:
    from bench.peers.common import PeerError, locate_checkpoint
    from runtime.bundle import load_manifest

    try:
        checkpoint = locate_checkpoint(load_manifest(bundle).target, bundle)
    except PeerError as err:
        return {"skipped": str(err)}
    if not checkpoint.gguf_file:
        return {"skipped": "the target is not a GGUF file"}
    return llama_bench_widths(checkpoint.folder / checkpoint.gguf_file, widths, threads)
