"""The exactness a fused target promises, checked on this CPU when a bundle is opened (ONNX Runtime picks kernels
by ISA and matrix size, so this cannot be known from elsewhere): whether verify calls, batched steps and a prompt
prefilled in chunks score each token as target-only decoding does (runtime/engines/fused.py relies on it;
runtime/engines/loading.py acts on the answers)."""

from __future__ import annotations

import numpy as np

from runtime.engines.base import Engine


def call_shape_mismatch(engine: Engine, vocab: int, seed: int = 0) -> str | None:
    """Whether this CPU scores a token alike under every call shape the runtime uses: one token a call
    (target-only), inside verify calls, and in a batched step. None when all agree bit for bit; else the call shape
    that differed. Over the first 12 positions (class points are measured apart)."""
    length = min(12, engine.max_context - engine.min_call_tokens)
    if length < 8:
        return None
    tokens = np.random.default_rng(seed).integers(0, vocab, (2, length))
    reference = scored(engine, tokens[:1], [1] * (length - 4))
    shapes = {
        "a verify call of 4 tokens": lambda: scored(engine, tokens[:1], [4, length - 8]),
        "a verify call of 2 tokens": lambda: scored(engine, tokens[:1], [2] * ((length - 4) // 2)),
        "a batched one-token step": lambda: scored(engine, tokens, [1] * (length - 4))[:1],
        "a batched verify call": lambda: scored(engine, tokens, [4, length - 8], ragged=True)[:1],
    }
    for name, scores in shapes.items():
        if not np.array_equal(scores(), reference):
            return name
    return None


def prefill_chunks_differ(engine: Engine, vocab: int, seed: int = 0) -> bool:
    """Whether a prompt prefilled in two calls leaves a cache that scores the next tokens otherwise than one prefill
    call does, on this CPU (a server's chunked prefill rests on it: runtime/core/scheduler.py)."""
    length = min(12, engine.max_context - engine.min_call_tokens)
    if length < 8:
        return False
    tokens = np.random.default_rng(seed).integers(0, vocab, (1, length))
    widths = [1] * (length - 4)
    return not np.array_equal(scored(engine, tokens, widths, prefill=(2, 2)), scored(engine, tokens, widths))


def scored(
    engine: Engine, tokens: np.ndarray, widths: list[int], ragged: bool = False, prefill: tuple[int, ...] = (4,)
) -> np.ndarray:
    """Logits of ``tokens`` [B, n] past a prefill of 4 (in calls of ``prefill`` tokens), fed in calls of ``widths``
    tokens (``ragged``: the rows after the first take one token fewer a call, so rows of several lengths share each
    call)."""
    cache = engine.new_cache(len(tokens))
    at = 0
    for width in prefill:
        engine.prefill(cache, tokens[:, at : at + width])
        at += width
    at, out = 4, []
    for width in widths:
        valid = np.ones((len(tokens), width), np.int64)
        if ragged:
            valid[1:, width - 1 :] = 0
        out.append(engine.forward(cache, tokens[:, at : at + width] * valid, valid))
        at += width
    return np.concatenate(out, axis=1)
