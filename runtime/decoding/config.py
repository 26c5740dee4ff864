"""What one decoding run is asked to do: its budget, k and its schedule, sampling, constraints, seeds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from runtime.errors import RequestError
from runtime.decoding.sampling import SamplingParams
from runtime.decoding.seeded import SeededNoise


@dataclass(frozen=True)
class AdaptiveK:
    """Schedule k from what the last step achieved: +up after a fully accepted step, -down otherwise."""

    min_k: int = 1
    max_k: int = 8
    up: int = 2
    down: int = 1
    confidence: float = 0.0  # stop drafting a row when the draft's top probability falls below this (0: never)

    def next(self, k: int, all_accepted: bool) -> int:
        return min(self.max_k, k + self.up) if all_accepted else max(self.min_k, k - self.down)


@dataclass(frozen=True)
class Fallback:
    """Run target-only when rolling acceptance over the last ``window`` draft tokens falls under ``threshold``;
    re-probe with the draft every ``probe_every`` target-only steps. A stale draft must not slow serving down."""

    threshold: float = 0.3
    window: int = 64
    probe_every: int = 32


@dataclass
class DecodeConfig:
    max_new_tokens: int
    k: int
    params: SamplingParams = SamplingParams()
    eos_ids: tuple[int, ...] = ()
    adaptive: AdaptiveK | None = None
    fallback: Fallback | None = None
    seed: int | Sequence[int | None] | None = None  # one seed for the batch, or one per row (see row_randomness)
    grammar: Any = None  # a CompiledGrammar (runtime/decoding/grammar.py): every row's output must match it
    forced_drafts: bool = True  # with a grammar: propose the tokens it forces as a draft (no draft call)
    logprobs: int | None = None  # None: off; n >= 0: each token's log-probability and the n most likely
    plan: bool = True  # over a batch: draft lengths planned from measured costs (DecodeRequest.plan)
    exact: bool = True  # every row's target calls padded as its lone calls would be (DecodeRequest.policy)


def row_randomness(
    seed: int | Sequence[int | None] | None, rows: int, params: SamplingParams, keyed: bool = True
) -> list[np.random.Generator | SeededNoise]:
    """One source of randomness per row; every draw of a row (draft sample, acceptance, recovered, bonus) uses its own.

    One seed for the whole batch: row b draws from stream b of it, so identical prompts still differ. One seed per
    row (a sequence): each row's stream comes from its own seed alone, the stream a batch of one would give it, so
    a seeded request's text does not depend on what it was batched with or where. None: fresh entropy.

    A seeded sampled row gets position-keyed races (``SeededNoise``, runtime/decoding/seeded.py) where ``keyed``: its
    text then depends on its seed and the target alone, not on its draft lengths. ``keyed`` False (an engine that
    samples inside itself, which takes a seed a call): a generator like every other row's.
    """
    streams = row_streams(seed, rows)
    return [
        SeededNoise(stream) if keyed and seeded and not params.greedy else np.random.default_rng(stream)
        for stream, seeded in streams
    ]


def row_streams(seed: int | Sequence[int | None] | None, rows: int) -> list[tuple[np.random.SeedSequence, bool]]:
    """Each row's seed sequence, and whether a seed chose it (False: fresh entropy)."""
    if seed is None or isinstance(seed, (int, np.integer)):
        if seed is not None and seed < 0:
            raise RequestError(f"seed: expected an integer >= 0, received {seed}")
        return [(stream, seed is not None) for stream in np.random.SeedSequence(seed).spawn(rows)]
    seeds = list(seed)
    if len(seeds) != rows:
        raise RequestError(f"seed: expected one seed per prompt ({rows}), received {len(seeds)}")
    return [row_streams(s, 1)[0] for s in seeds]
