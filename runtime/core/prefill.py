"""Prompts into the running batch: an admitted request's rows prefilled in the batch cache (whole, or a chunk a step
while the others decode), and how big a chunk a step can carry.

The scheduler (runtime/core/scheduler.py) owns the cache and the rows; this is its prefill, kept apart so the
loop reads as admit, plan, decode, retire. Chunked prefill is vLLM's and TensorRT-LLM's: a long prompt's admission
costs the running rows a chunk a step, not its whole prefill at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runtime.decoding.step_costs import CostModel
from runtime.engines.base import Engine, KVCache

PREFILL_CHUNK = "auto"  # prompt tokens prefilled per step while other rows decode: "auto" sizes it (``chunk``)
CHUNK_BOUNDS = (2, 256)  # the "auto" chunk's bounds (tokens); 64 before the costs are measured
CHUNK_GAP = 1.8  # "auto": the step's target call with a prompt chunk in it costs at most this times the call without
PENDING = object()  # an admitted prompt left to the steps' prefill chunks


@dataclass
class Prefill:
    """A scheduler's prefill of admitted prompts into its batch cache. ``size``: the prompt tokens a step prefills
    (an integer, "auto" or None: every prompt whole at admission)."""

    target: Engine
    size: int | str | None
    costs: CostModel = field(default_factory=CostModel)
    padding: int = 1  # a scored row's least width in the step's target call
    chunks: bool = False  # prompts are prefilled a chunk a step (a size, and an engine whose chunks score alike)
    _sizes: dict = field(default_factory=dict)  # decoding rows -> the "auto" chunk

    def __post_init__(self) -> None:
        if self.size is not None and self.size != "auto" and not (isinstance(self.size, int) and self.size >= 1):
            raise ValueError(
                "prefill_chunk must be an integer >= 1, 'auto' (about one step's cost) or None (every "
                "prompt prefilled whole at admission)"
            )
        # an engine whose chunked prefill scores otherwise on this CPU (the load-time check) prefills whole
        self.chunks = self.size is not None and self.target.prefills_in_chunks

    def admit(self, cache: KVCache, requests: list[list[list[int]]], decoding: int) -> tuple[KVCache, list[list]]:
        """The cache with a new row per prompt of the admitted requests (each prompt but its last token, prefilled
        with the calls it would get alone: the engine's ``admit_rows``), and per request, per prompt, its final
        hidden states (None: none), PENDING (a long prompt of a one-prompt request, left to the steps' chunks: its
        row is there, its prefill comes later) or the error its own prefill raised (a request's rows are then not
        in the cache, all of them: a request's prompts are admitted together or not at all). When the shared
        admission fails, each request again alone, so only the one at fault fails. ``decoding``: the rows running
        (what sizes a chunk)."""
        pending = [
            [len(prompts) == 1 and self.chunks and len(p) - 1 > self.chunk(decoding) for p in prompts]
            for prompts in requests
        ]
        parts = [
            [[] if wait else p[:-1] for p, wait in zip(prompts, waits)] for prompts, waits in zip(requests, pending)
        ]
        try:
            cache, states = self.target.admit_rows(cache, [part for request in parts for part in request])
            flat = iter(states)
            got = [[next(flat) for _ in waits] for waits in pending]
            return cache, [[PENDING if w else state for w, state in zip(waits, g)] for waits, g in zip(pending, got)]
        except Exception as err:
            if len(requests) == 1:
                return cache, [[err] * len(requests[0])]
        out = []
        for request, waits in zip(parts, pending):
            try:
                cache, states = self.target.admit_rows(cache, request)
                out.append([PENDING if wait else state for wait, state in zip(waits, states)])
            except Exception as err:
                out.append([err] * len(request))
        return cache, out

    def chunk(self, decoding: int) -> int:
        """Prompt tokens a step prefills: ``size``, or with "auto" the most that keep the step's target call, with
        the chunk as one more row of it, within CHUNK_GAP times the call without it on the measured costs
        (``decoding`` rows), within CHUNK_BOUNDS. A running stream's gaps then grow by at most about that factor
        while a long prompt is admitted; the prompt's first token comes later the smaller the chunk."""
        if self.size != "auto":
            return int(self.size)
        if not self.costs.calibrated:
            return 64
        if decoding not in self._sizes:
            self._sizes[decoding] = self._auto_chunk(decoding)
        return self._sizes[decoding]

    def _auto_chunk(self, decoding: int) -> int:
        low, high = CHUNK_BOUNDS
        if decoding == 0:
            return high
        widths = [max(self.padding, 2)] * decoding
        allowed = CHUNK_GAP * self.costs.call_cost(widths)
        fits = [c for c in range(low, high + 1) if self.costs.call_cost(widths + [c]) <= allowed]
        return max(fits) if fits else low

    def idle_step(self) -> int:
        """Tokens a step where no row decodes prefills: nobody waits on it, so a bigger chunk."""
        return CHUNK_BOUNDS[1] if self.size == "auto" else self.chunk(0)


def features_of(states: list) -> list[np.ndarray] | None:
    """A prompt's hidden states from its prefill's chunks, as a drafter takes them (None: the engine returns none)."""
    return None if any(s is None for s in states) else [np.concatenate(states)]


def engine_answers(engine: Engine) -> bool:
    """Whether ``engine`` still runs a call: one token on a fresh one-row cache. A sticky fault (ONNX Runtime out
    of memory on every call, a CUDA error) fails it too; a prompt too big for the memory left does not."""
    try:
        engine.forward(engine.new_cache(1), np.zeros((1, 1), np.int64))
    except Exception:
        return False
    return True
