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


def estimate(target_config, draft_config=None) -> Estimate:
    parameters = parameter_count(target_config) + (parameter_count(draft_config) if draft_config is not None else 0)
    return Estimate(parameters, int(BASE_BYTES + BYTES_PER_PARAMETER * parameters))


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
            f"{what} needs {needed.text()} (measured {BYTES_PER_PARAMETER:.0f} bytes per parameter) and "
            f"{free / 2**30:.1f} GiB is free: free memory, build on a larger machine, or build the draft and the "
            "target apart (a smaller draft, e.g. --draft self:layers=N)")


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
            signal.signal(signal.SIGUSR2, self._previous)

    def _raise(self, *_):
        raise BuildMemoryError(self.message())

    def message(self) -> str:
        return (f"the build stopped: less than {self.reserve / 2**20:.0f} MiB of memory was left (peak RSS "
                f"{_peak_rss() / 2**30:.1f} GiB). Nothing was published. Free memory or use a larger machine")

    def _watch(self) -> None:
        critical = 0  # polls in a row, after the signal, with under a third of the reserve left
        while not self._stop.wait(POLL_SECONDS):
            free = available_bytes()
            if free is None or free >= self.reserve:
                critical = 0
                continue
            if not self.tripped:
                self.tripped = True
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)
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
