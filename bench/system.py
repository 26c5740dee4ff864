"""The bench's machine-side measurements: peak memory per mode (in child processes), memory bandwidth, and the
bytes of weights a decoder reads per token (hence its bandwidth bound).

Run as a module, this file is the child process of the memory measurement::

    python -m bench.system BUNDLE --mode target|speculative --threads T --tokens N --k K
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from runtime.metrics import peak_rss_bytes


# --- memory ---------------------------------------------------------------------------------------------------------


def _current_rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(bundle: str, mode: str, threads: int, tokens: int, k: int | None, prompt: str) -> dict:
    """Load what ``mode`` needs (target-only loads no draft engine), decode, and report resident memory."""
    from runtime.api import SpeculativeGenerator
    from runtime.engines.loading import open_engines
    from runtime.bundle import load_manifest
    from runtime.text.tokenizer import Tokenizer

    root = Path(bundle)
    manifest = load_manifest(root, verify=False)
    tokenizer = Tokenizer(root / "tokenizer")
    before = _current_rss_bytes()
    roles = ("target", "draft") if mode == "speculative" else ("target",)
    engines = open_engines(root, manifest, tokenizer.vocab_size, roles, threads)
    generator = SpeculativeGenerator(
        manifest, engines["target"], engines.get("draft"), tokenizer, manifest.eos_token_ids
    )
    loaded = _current_rss_bytes()
    load_peak = peak_rss_bytes()
    reset = _reset_peak()  # so the decode peak is not the loading transient (ORT holds a model twice while loading)
    generator.generate(prompt, max_new_tokens=tokens, k=k, mode=mode)
    decode_peak = _vm_hwm() if reset else None
    return {
        "mode": mode,
        "rss_before_engines": before,
        "rss_after_load": loaded,
        "rss_after_decode": _current_rss_bytes(),
        "peak_rss_loading": load_peak,
        "peak_rss_decoding": decode_peak or max(loaded, _current_rss_bytes()),
        "decode_peak_method": "VmHWM after clear_refs" if decode_peak else "RSS sampled after load and after decode",
    }


def _reset_peak() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return _vm_hwm() is not None
    except OSError:
        return False


def _vm_hwm() -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure_memory(
    bundle: str | os.PathLike, threads: int, tokens: int, k: int | None, prompt: str, timeout: float = 600.0
) -> dict:
    """Peak RSS of target-only and of speculative decoding, each in its own fresh process (so they don't mix)."""
    out: dict = {}
    for mode in ("target", "speculative"):
        command = [
            sys.executable,
            "-m",
            "bench.system",
            str(bundle),
            "--mode",
            mode,
            "--threads",
            str(threads),
            "--tokens",
            str(tokens),
            "--prompt",
            prompt,
        ] + (["--k", str(k)] if k else [])
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            out[mode] = {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
            continue
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    t, s = out.get("target", {}).get("peak_rss_decoding"), out.get("speculative", {}).get("peak_rss_decoding")
    if t and s:  # the draft's cost while serving: decode peaks (loading transients excluded)
        out["draft_overhead_bytes"] = s - t
        out["draft_overhead_fraction"] = (s - t) / t
    return out


# --- bandwidth ------------------------------------------------------------------------------------------------------

_KERNELS = {
    "sum": lambda chunk: chunk.sum(),
    "max": lambda chunk: chunk.max(),
    "or": lambda chunk: np.bitwise_or.reduce(chunk.view(np.int64)),
    "dot": lambda chunk: np.dot(chunk, chunk),
}


def measure_bandwidth(threads: int = 2, megabytes: int = 512, repeats: int = 4) -> dict:
    """Read bandwidth in bytes/s: ``threads`` Python threads each reduce their share of a float32 array far larger
    than any cache (numpy releases the GIL in these loops). Best of ``repeats`` per kernel; the result is the best
    kernel, so the bound it implies is the strictest one this machine supports."""
    threads = max(1, threads)
    array = np.ones(megabytes * (1 << 20) // 4 // (threads * 2) * (threads * 2), np.float32)
    chunks = np.array_split(array, threads)
    per_kernel = {}
    for name, kernel in _KERNELS.items():
        best = 0.0
        for _ in range(repeats):
            workers = [threading.Thread(target=kernel, args=(c,)) for c in chunks]
            start = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = max(best, array.nbytes / (time.perf_counter() - start))
        per_kernel[name] = best
    return {
        "bytes_per_second": max(per_kernel.values()),
        "threads": threads,
        "array_bytes": array.nbytes,
        "per_kernel": per_kernel,
    }


# --- weights read per token -----------------------------------------------------------------------------------------


def weight_bytes_per_token(model_path: str | os.PathLike) -> dict:
    """Bytes of initializers a one-token decode reads: every weight once, except tables only gathered from
    (an embedding read by Gather alone costs one row per token). MatMulNBits weights count at their packed size
    (plus scales and zero points), since that is what is read. Needs the ``onnx`` package; without it, the engine's
    file sizes stand in (an overestimate by the embedding table when it is not shared with the head)."""
    path = Path(model_path)
    files = [p for p in path.parent.iterdir() if p.is_file() and p.name.startswith(path.name)]
    file_bytes = sum(p.stat().st_size for p in files)
    try:
        import onnx
        from onnx import helper
    except ImportError:
        return {"bytes_per_token": file_bytes, "file_bytes": file_bytes, "method": "file size (onnx not installed)"}
    model = onnx.load(str(path), load_external_data=False)
    consumers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)
    total, gathered, by_op = 0, 0, {}
    for init in model.graph.initializer:
        itemsize = helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        size = _initializer_bytes(init, itemsize)
        ops = consumers.get(init.name, set())
        if ops == {"Gather"} and len(init.dims) == 2:
            gathered += size
            size = int(init.dims[1]) * itemsize  # one row per token
        total += size
        key = ",".join(sorted(ops)) or "unused"
        by_op[key] = by_op.get(key, 0) + size
    return {
        "bytes_per_token": total,
        "file_bytes": file_bytes,
        "gather_only_bytes": gathered,
        "by_consumer": by_op,
        "method": "onnx initializers",
    }


def _initializer_bytes(init, itemsize: int) -> int:
    for entry in init.external_data:
        if entry.key == "length":
            return int(entry.value)
    if init.raw_data:
        return len(init.raw_data)
    count = 1
    for d in init.dims:
        count *= int(d)
    return count * itemsize


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="child process of `draftsmith bench`'s memory measurement")
    parser.add_argument("bundle")
    parser.add_argument("--mode", choices=("target", "speculative"), required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--k", type=int, default=None)
    parser.add_argument("--prompt", default="def fibonacci(n):")
    args = parser.parse_args(argv)
    print(json.dumps(_child(args.bundle, args.mode, args.threads, args.tokens, args.k, args.prompt)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
