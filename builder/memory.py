"""The memory a build needs: estimated before any weight is read, refused by name when the machine cannot hold it,
and watched while the build runs so that running out ends it with a message instead of the kernel's OOM killer.

The estimate is bytes per parameter measured on real builds (``BYTES_PER_PARAMETER``: peak RSS over the target's and
the draft's parameter counts, from the config). It is a figure of the pipeline as it is, not of the models: where the
pipeline changes, measure again (docs/building.md, "Build memory"). The watchdog reads MemAvailable a few times a
second; below ``RESERVE_BYTES`` it stops the build (the staging folder is removed, so nothing that looks like a
bundle is left), and where the build is inside one long call that cannot be interrupted, it exits the process.
"""

from __future__ import annotations

import os
import _thread
import shutil
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

# Peak RSS of `build-engines` over the target's and draft's parameters, less BASE_BYTES (the fp32 torch model, the
# fp32 reference graph's session, the quantized engines and the build report's logits alive together): 10.5 on
# Qwen2.5-Coder-0.5B (7.72 GB peak, 630M parameters; 2026-12-03, onnxruntime 1.32, docs/building.md), rounded up.
BYTES_PER_PARAMETER = 12.0
# A GGUF file read layer by layer (builder.gguf.stream) and scored one session at a time: the peak follows the
# largest model alone, not the pair, and within it the embedding and head, held in float32 twice while the graph is
# checked against torch (the truncated transformers model, the check graph's session), over one layer and the
# engines' sessions. Measured 2026-12-03 (docs/building.md, "Build memory"): Qwen2.5-Coder-1.5B + 0.5B 5.64 GB,
# the 0.5B alone ~4 GB; this estimate says 7.5 and 4.4 GB, and 19.6 GB for a 7B-class Q4_K_M model (Qwen2.5-7B).
STREAMED_EMBEDDING_BYTES = 10.0  # per element of the embedding and the (untied) head
STREAMED_BYTES_PER_PARAMETER = 1.0  # per parameter: a layer at a time, the engines' sessions
BASE_BYTES = 1 << 30  # the interpreter, torch, onnxruntime and transformers themselves
RESERVE_BYTES = 384 << 20  # the watchdog stops a build when less than this is left
POLL_SECONDS = 0.2
EXIT_AFTER_SECONDS = 2.0  # under a third of the reserve this long after the signal: the process exits


class BuildMemoryError(BaseException):
    """The build needs more memory than this machine can give; the message says what to change. Raised into the
    main thread at any point of the build, so (like KeyboardInterrupt) no ``except Exception`` on the way may turn it
    into another error; builder.build turns it into a BuildError."""


@dataclass(frozen=True)
class Estimate:
    parameters: int  # target + draft (a self-draft counts once)
    peak_bytes: int
    streamed: bool = False  # read layer by layer (builder.gguf.stream)

    def basis(self) -> str:
        if self.streamed:
            return (
                f"read layer by layer: {STREAMED_EMBEDDING_BYTES:g} bytes per embedding/head element and "
                f"{STREAMED_BYTES_PER_PARAMETER:g} per parameter of the larger model, measured"
            )
        return f"measured {BYTES_PER_PARAMETER:g} bytes per parameter of both models"

    def text(self) -> str:
        return f"~{self.peak_bytes / 2**30:.1f} GiB for {self.parameters / 1e9:.2f}B parameters"


def parameter_count(config) -> int:
    """A decoder's parameters from its config alone (embedding, head unless tied, attention, MLP, norms)."""
    text = getattr(config, "text_config", None) or config
    hidden = int(text.hidden_size)
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    vocab = int(text.vocab_size)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * intermediate
    tied = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", True)))
    return vocab * hidden * (1 if tied else 2) + layers * (attention + mlp + 2 * hidden) + hidden


def embedding_elements(config) -> int:
    """Elements of the embedding and, where untied, the head."""
    text = getattr(config, "text_config", None) or config
    tied = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", True)))
    return int(text.vocab_size) * int(text.hidden_size) * (1 if tied else 2)


def estimate(target_config, draft_config=None, streamed: bool = False) -> Estimate:
    """The peak of a build of ``target_config`` (and a separate ``draft_config``); ``streamed``: both read layer by
    layer (the largest model counts alone), else loaded whole (both count)."""
    counts = [parameter_count(c) for c in (target_config, draft_config) if c is not None]
    if streamed:
        largest = max((c for c in (target_config, draft_config) if c is not None), key=parameter_count)
        peak = (
            BASE_BYTES
            + STREAMED_EMBEDDING_BYTES * embedding_elements(largest)
            + STREAMED_BYTES_PER_PARAMETER * parameter_count(largest)
        )
        return Estimate(sum(counts), int(peak), True)
    return Estimate(sum(counts), int(BASE_BYTES + BYTES_PER_PARAMETER * sum(counts)))


def available_bytes() -> int | None:
    """What this process may still take: Linux's MemAvailable (runtime.metrics), capped by a cgroup's memory.max
    where one is set."""
    from runtime.metrics import available_memory_bytes

    found = available_memory_bytes()
    if found is None:
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            found = min(found, int(limit) - current)
    except (OSError, ValueError):
        pass
    return found


def refuse_if_too_large(needed: Estimate, what: str) -> None:
    """BuildMemoryError before any weight is read where ``needed`` exceeds what the machine has free."""
    free = available_bytes()
    if free is not None and needed.peak_bytes > free:
        raise BuildMemoryError(
            f"{what} needs {needed.text()} ({needed.basis()}) and "
            f"{free / 2**30:.1f} GiB is free: free memory, build on a larger machine, or build the draft and the "
            "target apart (a smaller draft, e.g. --draft self:layers=N)"
        )


class Watchdog:
    """While active, stops the build when free memory falls under RESERVE_BYTES: first by raising
    BuildMemoryError in the main thread (the build's own cleanup runs), then, if the main thread is stuck in one
    long native call while memory keeps falling, by removing ``staging`` and exiting (status 3)."""

    def __init__(self, staging: Path, reserve: int = RESERVE_BYTES):
        self.staging, self.reserve = staging, reserve
        self.tripped = False
        self._stop = threading.Event()
        self._previous = None
        self._thread = threading.Thread(target=self._watch, name="build-memory-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        if threading.current_thread() is threading.main_thread() and available_bytes() is not None:
            self._previous = signal.signal(signal.SIGUSR2, self._raise)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._previous is not None:
            signal.signal(signal.SIGUSR2, self._previous)  # an interrupt still pending now finds no handler
        if self.tripped and exc[0] is None:  # it ran out, but the build went on: the handler's exception was
            raise BuildMemoryError(self.message())  # raised inside a finalizer (gc), which swallows it

    def _raise(self, *_):
        raise BuildMemoryError(self.message())

    def message(self) -> str:
        return (
            f"the build stopped: less than {self.reserve / 2**20:.0f} MiB of memory was left (peak RSS "
            f"{_peak_rss() / 2**30:.1f} GiB). Nothing was published. Free memory or use a larger machine"
        )

    def _watch(self) -> None:
        critical = 0  # polls in a row, after the signal, with under a third of the reserve left
        while not self._stop.wait(POLL_SECONDS):
            free = available_bytes()
            if free is None or free >= self.reserve:
                critical = 0
                continue
            if not self.tripped:
                self.tripped = True
                # the handler runs in the main thread at its next bytecode, as for a real signal, but nothing is sent
                # to the process: a real SIGUSR2 crashed the interpreter where OpenVINO's threads had run before
                _thread.interrupt_main(signal.SIGUSR2)
                continue
            critical = critical + 1 if free < self.reserve // 3 else 0
            if critical * POLL_SECONDS >= EXIT_AFTER_SECONDS:  # the signal was not acted on; memory still going
                print(f"build-engines: {self.message()}", file=sys.stderr, flush=True)
                shutil.rmtree(self.staging, ignore_errors=True)
                os._exit(3)


def _peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_FROM_BYTES = 1 << 20


def allocate_large_blocks_apart() -> None:
    """Have glibc map every allocation of 1 MiB or more on its own, returned to the system when freed: its default
    threshold rises to 32 MB as large blocks are freed, after which a layer's arrays come from the heap, whose freed
    space stays in RSS (a build's peak is its sum of transients, not its largest)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_FROM_BYTES)
    except (OSError, AttributeError):  # not glibc
        pass


def release() -> None:
    """Give freed memory back to the system between stages: a collection (the lazy layers' closures form reference
    cycles that hold a model's weights until one runs) and glibc's ``malloc_trim`` (arrays under its mmap threshold,
    which rises to 32 MB as large blocks are freed, come from the heap and stay in RSS until trimmed)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
