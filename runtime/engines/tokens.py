"""The cache of an engine that returns tokens (runtime/engines/base.py ``returns_tokens``): its runtime keeps the
sequences' KV state itself (TensorRT-LLM's executor, which reuses a request's cached prefix blocks), so a row's cache
is only its token ids, sent whole with every call. ``TokenEngine`` keeps them and the cache fields the scheduler
reads (``mask``, ``lengths``; ``past`` stays empty) the way an ONNX engine's cache has them, so admission, retirement
and the decode step's invariant (every token but the last emitted one) read the same for both kinds of engine.
"""

from __future__ import annotations

import numpy as np

from runtime.engines.base import Engine, KVCache


class TokenEngine(Engine):
    """Base of the engines that return tokens: the token-id cache; a subclass implements ``emit``."""

    returns_tokens = True

    def __init__(self, *, vocab_size: int, max_context: int):
        self.vocab_size, self.max_context = vocab_size, max_context

    def emit(
        self, inputs: list[list[int]], drafts: list[list[int]], room: list[int], sampling: list
    ) -> list[list[int]]:
        """Per row, the tokens the runtime emits after ``inputs[b]`` (a whole history), verifying ``drafts[b]``,
        at most ``room[b]`` (>= 1) of them, sampled under ``sampling[b]`` (a ``RowSampling``; None: greedy); only
        rows with room are asked."""
        raise NotImplementedError

    def new_cache(self, batch: int) -> KVCache:
        return history_cache([[] for _ in range(batch)])

    def compute(
        self,
        cache: KVCache,
        tokens: np.ndarray,
        valid: np.ndarray | None = None,
        *,
        exact: bool = True,
        last: bool = False,
        score: bool = True,
        features: np.ndarray | None = None,
    ) -> None:
        """Prompt tokens recorded (``score`` False: a prefill, which the next call's whole history carries anyway);
        logits it has none to give, so a scoring call is refused."""
        if score:
            raise TypeError(f"{type(self).__name__} returns tokens, not logits: a step calls its generate_tokens")
        valid = np.ones_like(tokens) if valid is None else np.asarray(valid)
        self._extend(cache, [[int(t) for t, v in zip(row, keep) if v] for row, keep in zip(tokens, valid)])
        return None

    def compute_tokens(
        self,
        cache: KVCache,
        chunks: list[list[int]],
        drafts: list[list[int]],
        room: list[int],
        sampling: list | None = None,
    ) -> list[list[int]]:
        histories = cache.extra["tokens"]
        sampling = sampling or [None] * cache.batch
        if not self.samples and any(s is not None for s in sampling):
            raise TypeError(f"{type(self).__name__} decodes greedily: its rows cannot be sampled")
        asked = [b for b in range(cache.batch) if room[b] > 0]
        out: list[list[int]] = [[] for _ in range(cache.batch)]
        if asked:
            inputs = [histories[b] + list(chunks[b]) for b in asked]
            answers = self.emit(
                inputs, [list(drafts[b]) for b in asked], [room[b] for b in asked], [sampling[b] for b in asked]
            )
            for b, tokens in zip(asked, answers):
                out[b] = [int(t) for t in tokens][: room[b]]
        self._extend(cache, [list(chunk) + emitted[:-1] for chunk, emitted in zip(chunks, out)])
        return out

    def _extend(self, cache: KVCache, new: list[list[int]]) -> None:
        for history, tokens in zip(cache.extra["tokens"], new):
            history.extend(tokens)
        cache.calls += 1
        _follow(cache)

    def rollback(self, cache: KVCache, keep: np.ndarray) -> None:
        for b, history in enumerate(cache.extra["tokens"]):
            del history[int(keep[b]) :]
        _follow(cache)

    def select(self, cache: KVCache, rows: np.ndarray) -> KVCache:
        return history_cache([list(cache.extra["tokens"][int(r)]) for r in rows], cache.calls)

    def join(self, cache: KVCache, other: KVCache) -> KVCache:
        return history_cache([list(t) for t in cache.extra["tokens"] + other.extra["tokens"]], cache.calls)


def history_cache(histories: list[list[int]], calls: int = 0) -> KVCache:
    """A cache holding these token histories, its mask and lengths made to match."""
    cache = KVCache([], np.zeros((len(histories), 0), np.int64), np.zeros(len(histories), np.int64), calls)
    cache.extra["tokens"] = histories
    _follow(cache)
    return cache


def _follow(cache: KVCache) -> None:
    """``lengths`` and ``mask`` as the token histories now are (live slots first, as a rolled-back ONNX cache)."""
    cache.lengths = np.array([len(h) for h in cache.extra["tokens"]], np.int64)
    width = int(cache.lengths.max()) if len(cache.lengths) else 0
    cache.mask = (np.arange(width)[None, :] < cache.lengths[:, None]).astype(np.int64)
