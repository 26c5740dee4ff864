"""What sizes a deployment: one server process measured (``measure``, an ONNX Runtime bundle loaded in a child
process) or estimated (``estimate_trtllm``: a tensorrt_llm bundle cannot be loaded without a GPU), and the figures
the manifests take from it and the bundle (``size``):

- a startup probe allowing three times the measured load time (plus 30 s) before liveness starts;
- resources: CPU from the thread count; memory from the measured peak of one server process plus the KV caches of a
  full batch (``max_batch`` rows of the bundle's context, target and draft);
- ``terminationGracePeriodSeconds``: the longest request the server allows (its max_tokens limit) at a full batch's
  per-row speed (measured), times 1.5, plus the drain's linger and 15 s for the process to stop; the server's drain
  timeout (``--drain-timeout`` / Triton's ``--exit-timeout-secs``) is that less the 15 s;
- tensorrt_llm bundles: ``nvidia.com/gpu`` limits of tp x pp (the bundle's manifest).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from deploy.options import PROCESS_STOP_S, DeployError, DeployOptions
from runtime.bundle import Manifest


@dataclass(frozen=True)
class Measured:
    """What sizes the probes, the resources and the grace period: one server process's figures."""

    load_s: float  # process start to serving (imports, bundle verification, engine sessions, calibration)
    rss_mib: float  # peak resident memory after loading and one request
    tokens_per_s: float  # one request alone, decode speed
    how: str  # "measured" or "estimated: ..."


def measure(
    bundle: str | os.PathLike, threads: int, max_batch: int, policy: str = "exact", timeout: float = 600.0
) -> Measured:
    """Load ``bundle`` in a child process as the OpenAI server does (generator and scheduler), run one request, and
    report the load time, the peak RSS and the decode speed. ONNX Runtime bundles only."""
    command = [
        sys.executable,
        "-c",
        "import sys, json; from deploy.sizing import _measure_here; "
        "print(json.dumps(_measure_here(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))",
        str(bundle),
        str(threads),
        str(max_batch),
        policy,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, cwd=Path(__file__).resolve().parents[1]
    )
    if done.returncode != 0:
        raise DeployError(f"measuring {bundle} failed:\n{done.stderr[-2000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return Measured(**figures, how="measured")


def _measure_here(bundle: str, threads: int, max_batch: int, policy: str) -> dict:
    """The child's side of ``measure``."""
    import time

    start = time.perf_counter()
    from runtime.api import SpeculativeGenerator
    from runtime.metrics import peak_rss_bytes
    from runtime.core.scheduler import Scheduler

    generator = SpeculativeGenerator.from_bundle(bundle, threads=threads)
    scheduler = Scheduler(generator, max_batch=max_batch, policy=policy).start()
    load_s = time.perf_counter() - start
    scheduler.stop()
    generator.generate("The quick brown fox", max_new_tokens=4)  # warm-up
    result = generator.generate("The quick brown fox", max_new_tokens=32)
    return {
        "load_s": round(load_s, 2),
        "rss_mib": round(peak_rss_bytes() / 2**20, 1),
        "tokens_per_s": round(result.stats.tokens_per_second, 1),
    }


def estimate_trtllm(bundle: Path, manifest: Manifest) -> Measured:
    """Figures for a tensorrt_llm bundle, which cannot be loaded here: conservative guesses from its size."""
    size_mib = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file()) / 2**20
    return Measured(
        load_s=120 + size_mib / 200,
        rss_mib=4096 + size_mib,
        tokens_per_s=20.0,
        how="estimated: 120 s + 1 s per 200 MiB to load, 4 GiB + the bundle's size of host memory, "
        "20 tokens/s per request (pass --load-seconds, --memory-mib, --tokens-per-second)",
    )


@dataclass(frozen=True)
class Sizing:
    """Everything the manifests take from the bundle and the measurement."""

    max_tokens: int  # the longest request the server allows
    drain_timeout_s: int
    grace_s: int
    startup_failures: int  # startup probe failureThreshold at STARTUP_PERIOD_S
    cpu_request_m: int
    cpu_limit_m: int
    memory_request_mib: int
    memory_limit_mib: int
    gpus: int  # nvidia.com/gpu per pod (0: none)


STARTUP_PERIOD_S = 5


def kv_cache_mib(manifest: Manifest, rows: int) -> float:
    """Target and draft caches (keys and values) for ``rows`` sequences of the bundle's context."""
    width = 2 if manifest.spec.device == "cuda" else 4  # fp16 on CUDA, fp32 on the CPU
    per_token = sum(2 * e.num_layers * e.num_kv_heads * e.head_dim * width for e in (manifest.target, manifest.draft))
    return rows * manifest.max_context * per_token / 2**20


def max_tokens_allowed(manifest: Manifest) -> int:
    """The largest max_tokens a request may ask of either server with its default limits (the front door's)."""
    from runtime.core.request import Limits

    return Limits.for_context(manifest.max_context).max_tokens_limit


def size(manifest: Manifest, measured: Measured, options: DeployOptions) -> Sizing:
    max_tokens = max_tokens_allowed(manifest)
    per_row = measured.tokens_per_s / options.max_batch  # a full batch shares each step (pessimistic)
    drain = max(30, math.ceil(1.5 * max_tokens / per_row + options.drain_linger))
    cpu = 1000 * options.threads + 250  # the engines' threads, the HTTP server and tokenizer
    memory = math.ceil((measured.rss_mib + kv_cache_mib(manifest, options.max_batch)) * 1.2 + 128)
    startup = math.ceil((3 * measured.load_s + 30) / STARTUP_PERIOD_S)
    gpus = manifest.spec.tp_size * manifest.spec.pp_size if manifest.spec.backend == "tensorrt_llm" else 0
    return Sizing(
        max_tokens=max_tokens,
        drain_timeout_s=drain,
        grace_s=drain + PROCESS_STOP_S,
        startup_failures=startup,
        cpu_request_m=cpu,
        cpu_limit_m=cpu + 1000,
        memory_request_mib=memory,
        memory_limit_mib=math.ceil(memory * 1.5),
        gpus=gpus,
    )
