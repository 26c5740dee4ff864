"""What the calls of a scheduler step cost, measured, for choosing how to run a step (runtime/serving/scheduler.py)."""

from __future__ import annotations

import time

import numpy as np


class CostModel:
    """Measured seconds of the calls a step is made of, for choosing how to run it.

    ``batch[B]``: one target call of one token for B rows; ``verify[S]``: one row's target call of S tokens;
    ``draft``: one draft token for one row. Calibrated once on a scratch cache, then each kind is rescaled by how
    the steps actually ran (a machine under other load slows everything).
    """

    def __init__(self):
        self.batch: dict[int, float] = {}
        self.verify: dict[int, float] = {}
        self.draft = 0.0
        self.scale = {"batched": 1.0, "speculative": 1.0}

    def batch_cost(self, rows: int) -> float:
        if not self.batch:  # not calibrated
            return 0.0
        sizes = sorted(self.batch)
        return float(np.interp(rows, sizes, [self.batch[s] for s in sizes])) * self.scale["batched"]

    def spec_cost(self, widths: list[int]) -> float:
        if not self.verify:
            return 0.0
        sizes = sorted(self.verify)
        verify_s = np.interp(widths, sizes, [self.verify[s] for s in sizes])
        return float(verify_s.sum() + self.draft * (np.asarray(widths) - 1).sum()) * self.scale["speculative"]

    def observe(self, kind: str, predicted: float, measured: float) -> None:
        if predicted > 0:
            self.scale[kind] = 0.8 * self.scale[kind] + 0.2 * measured / (predicted / self.scale[kind])

    def calibrate(self, target, draft, max_batch: int, max_width: int, past: int = 64, repeats: int = 3) -> None:
        def timed(engine, rows: int, width: int) -> float:
            cache = engine.new_cache(rows)
            scratch_call(engine, cache, np.ones((rows, past), np.int64))
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                scratch_call(engine, cache, np.ones((rows, width), np.int64))
                best = min(best, time.perf_counter() - start)
                engine.rollback(cache, cache.lengths - width)
            return best

        for rows in sorted({1, 2, 4, max_batch} | {b for b in (8, 16, 32) if b < max_batch}):
            self.batch[rows] = timed(target, rows, 1)
        for width in range(1, max_width + 1):
            self.verify[width] = timed(target, 1, width)
        self.draft = timed(draft, 1, 1) if draft is not None else 0.0


def scratch_call(engine, cache, tokens: np.ndarray) -> None:
    """A forward call on made-up tokens, for timing; a feature draft engine gets zero features of its width."""
    inner = getattr(engine, "engine", engine)
    if not getattr(inner, "takes_features", False):
        engine.forward(cache, tokens)
        return
    width = next(i.shape[-1] for i in inner.session.get_inputs() if i.name == "features")
    engine.forward(cache, tokens, features=np.zeros(tokens.shape + (width,), np.float32))


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify of k draft tokens yields when each is accepted with probability ``acceptance``."""
    a = min(acceptance, 0.99)
    return (1 - a ** (k + 1)) / (1 - a)
