"""Feeding per-row chunks of different lengths to an engine in one call: the padding every caller shares (the
decode step, the drafters, the bench)."""

from __future__ import annotations

import numpy as np

from runtime.engines.base import Engine


def prefill(engine: Engine, cache, chunks: list[list[int]]) -> None:
    """Feed prompts whose logits nobody reads (the engine may skip its output head for them)."""
    tokens, valid = padded(chunks)
    engine.prefill(cache, tokens, valid)


def padded(chunks: list[list[int]], min_width: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per-row chunks right-padded into tokens and valid [B, max(min_width, longest chunk)] (padding is 0 and not
    valid)."""
    width = max(min_width, max(len(c) for c in chunks))
    tokens = np.zeros((len(chunks), width), np.int64)
    valid = np.zeros((len(chunks), width), np.int64)
    for b, chunk in enumerate(chunks):
        tokens[b, : len(chunk)], valid[b, : len(chunk)] = chunk, 1
    return tokens, valid


def last_logits(engine: Engine, cache, chunks: list[list[int]], **options) -> np.ndarray:
    """Feed per-row chunks in one call; the logits after each row's last token [B, V] (junk for empty rows): the
    engine's head runs there alone where it can (a drafter reads nothing else)."""
    tokens, valid = padded(chunks)
    return engine.forward(cache, tokens, valid, last=True, **options)[:, 0]


def feed(engine: Engine, cache, chunks: list[list[int]], exact: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """One forward call over per-row chunks of different lengths, right-padded; padding slots stay masked."""
    tokens, valid = padded(chunks)
    return engine.forward(cache, tokens, valid, exact=exact), valid
