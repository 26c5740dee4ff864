"""The engine contract: what the decode step, the drafters and the scheduler ask of a compiled model.

One base class instead of a Protocol plus probes (as the drafters' runtime/decoding/drafter.py): every capability an
engine may have is declared here with the default an engine without it gets, so callers read each one and never
``hasattr``/``getattr`` for it (tests/test_engine_contract.py fails on a probe). An engine owns no sequence state; a
``KVCache`` does. Like llama.cpp's ``llama_decode(ctx, batch)``, a call says what it wants as data: which tokens are
real (``valid``), whether logits are read at every new position, at each row's last one only (``last``) or not at
all (``prefill``), and whether the call must score each row as its lone call would (``exact``); nothing about a
call is set on the engine.

Two kinds of engine answer a step. Most return logits (``compute``): the decode step samples and verifies draft
tokens itself. An engine whose runtime decides the tokens itself and returns no logits (``returns_tokens``:
TensorRT-LLM's executor, whose ``draft_tokens_external`` engines cannot gather logits) answers a step with the tokens
it emits (``compute_tokens``), and declares how it speculates (``speculation``): it verifies draft tokens given to it,
or it drafts and verifies inside itself (Medusa, EAGLE, lookahead, draft-target in the executor), so a step is one
call. Either way the one scheduler (runtime/core/scheduler.py) runs the loop and the engine one step of it.

A subclass implements ``compute`` or ``compute_tokens`` (and the cache methods); the public calls (``forward``,
``prefill``, ``prefill_rows``, ``generate_tokens``) are the base class's, so every call an engine makes is reported
to its observers (``watch``: the Triton model's metrics and the bench's timings) without anyone wrapping or
patching a method.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass
class KVCache:
    """Per-batch cache state. Shapes: past[j] [B, H_kv, T, D]; mask [B, T] (1 = live slot); lengths [B] live tokens."""

    past: list
    mask: np.ndarray
    lengths: np.ndarray
    calls: int = 0  # forward calls made on this cache (tests count them)
    extra: dict = field(default_factory=dict)  # backend-specific state; "hidden": the last call's hidden states

    @property
    def batch(self) -> int:
        return int(self.mask.shape[0])

    @property
    def slots(self) -> int:
        return int(self.mask.shape[1])


@dataclass(frozen=True)
class Call:
    """One call an engine made, as its observers see it."""

    # "forward", "prefill" (no logits read), "prefill_rows" (prompts of admitted rows, in place) or "generate_tokens"
    kind: str
    rows: int  # the call's batch (B); for "prefill_rows", the rows it prefilled (those given tokens)
    width: int  # new positions per row (S)
    seconds: float  # the whole call
    session_seconds: float  # inside its runtime's sessions (ONNX Runtime's run); the whole call where it has none
    first: bool  # the first call on its cache (a prompt's prefill, a drafter's first call)
    exact: bool = True  # it asked for lone-call kernels (``compute``'s ``exact``)
    # the widest query (tokens a row) its runtime's sessions ran, the engine's own padding included; the call's width
    # where an engine does not say
    session_width: int = 0


CallObserver = Callable[[Call], None]


class Engine:
    """Base of every engine; the members after the first group are capabilities with their defaults."""

    vocab_size: int  # logits columns callers read (the tokenizer's vocabulary)
    max_context: int  # the longest sequence

    min_call_tokens = 1  # an exact call pads each row's tokens to this many (FusedEngine: 2, see there)
    has_hidden = False  # calls leave their final hidden states [B, S, H] in cache.extra["hidden"]
    takes_features = False  # compute needs ``features`` [B, S, feature_width] (a feature draft's graph)
    feature_width = 0
    # a prompt prefilled in several calls leaves the cache one call would, and a chunk can ride in a decode step's
    # call without its logits held: a server may then chunk a long prompt's prefill between decode steps. Only a
    # fused graph can (it keeps the logits asked for; checked on this CPU when the bundle opens, call_checks.py); the
    # others prefill a prompt whole at admission (the export graph in calls of ``prefill_positions``)
    prefills_in_chunks = False
    session_seconds = 0.0  # seconds its runtime's sessions have run so far (what a Call's session_seconds counts)
    session_widest = 0  # the widest query its sessions ran since an observed call began (a Call's session_width)
    observers: tuple = ()  # told of every call (``watch``)
    # its calls return tokens its runtime chose (``generate_tokens``), not logits: no per-position scores, so the
    # front door refuses logprobs and grammars for it, and sampling unless it ``samples`` (LoadedBundle.check_config)
    returns_tokens = False
    # an engine that returns tokens whose runtime samples each row under the row's own parameters and seed
    # (``generate_tokens``' ``sampling``); without it such an engine decodes greedily and sampling is refused
    samples = False
    # how an engine that returns tokens speculates: "" not at all (one greedy token a row per step, or a draft
    # engine's k), "verifies" (it checks the draft tokens a step gives it: the accepted ones, then its own next
    # token), "internal" (its runtime drafts and verifies inside the call: a step is that one call, and no drafter
    # runs beside it)
    speculation = ""

    # --- what a subclass implements -------------------------------------------------------------------------------

    def new_cache(self, batch: int) -> KVCache:
        """An empty cache of ``batch`` rows."""
        raise NotImplementedError

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
    ) -> np.ndarray | None:
        """Append each row's valid tokens (tokens [B, S], right-padded; valid [B, S] marks real ones, None: all);
        return logits [B, S, V] of every new position, [B, 1, V] at each row's last valid token with ``last``, or
        nothing with ``score`` False (an engine may then skip its head). ``exact``: every row scored with the
        kernels its lone call would take (``min_call_tokens``); False: one-token calls unpadded."""
        raise NotImplementedError

    def compute_tokens(
        self,
        cache: KVCache,
        chunks: list[list[int]],
        drafts: list[list[int]],
        room: list[int],
        sampling: list | None = None,
    ) -> list[list[int]]:
        """Where ``returns_tokens``, in place of ``compute``: each row's ``chunks[b]`` (the tokens it feeds: a
        step's last emitted token, a drafter's pending ones) decoded inside the engine with ``drafts[b]`` to verify
        (``speculation`` "verifies" only), at most ``room[b]`` tokens (0: the row only takes its chunk); returns the
        tokens each row emits (the draft tokens it accepted, then its own). ``sampling[b]``: the row's
        ``RowSampling`` for this call (runtime/decoding/sampling.py), only where the engine ``samples``; None (or no
        list): greedy. The cache then holds each row's chunk and what it emitted but the last token: the decode
        step's invariant, which needs no rollback."""
        raise NotImplementedError

    def rollback(self, cache: KVCache, keep: np.ndarray) -> None:
        """Keep only the first keep[b] live tokens of each row."""
        raise NotImplementedError

    def select(self, cache: KVCache, rows: np.ndarray) -> KVCache:
        """A cache holding only the given rows (sequences that are still running)."""
        raise NotImplementedError

    def join(self, cache: KVCache, other: KVCache) -> KVCache:
        """A cache holding cache's rows, then other's (requests admitted into a running batch)."""
        raise NotImplementedError

    # --- capabilities with their defaults ----------------------------------------------------------------------------

    def admit_rows(self, cache: KVCache, chunks: list[list[int]]) -> tuple[KVCache, list[np.ndarray | None]]:
        """``cache`` with ``len(chunks)`` new rows after its own, row i prefilled with ``chunks[i]`` (an admitted
        prompt but its last token; [] for none yet), each as its lone prefill would be, and their hidden states
        (``prefill_rows``). Default: prefilled in a cache of their own, then joined. On failure it raises and
        ``cache`` holds its own rows as before (a scheduler then admits each prompt alone)."""
        fresh = self.new_cache(len(chunks))
        states = self.prefill_rows(fresh, list(range(len(chunks))), chunks)
        return self.join(cache, fresh), states

    def reserved_cache(self, rows: int) -> KVCache:
        """A server's empty batch cache; an engine that can (FusedEngine) takes the memory of ``rows`` rows of the
        whole context at once, so no request makes the process grow. Default: an empty cache that grows
        (``admit_rows``)."""
        return self.new_cache(0)

    def compute_rows(self, cache: KVCache, rows: list[int], chunks: list[list[int]]) -> list[np.ndarray | None]:
        """``prefill_rows``' work. Default: one call in which only the given rows have (valid) tokens, so the others
        stay as they are; their hidden states from ``cache.extra["hidden"]`` where the engine returns them."""
        width = max(len(chunk) for chunk in chunks)
        tokens = np.zeros((cache.batch, width), np.int64)
        valid = np.zeros((cache.batch, width), np.int64)
        for row, chunk in zip(rows, chunks):
            tokens[row, : len(chunk)], valid[row, : len(chunk)] = chunk, 1
        self.compute(cache, tokens, valid, score=False)
        hidden = cache.extra.get("hidden") if self.has_hidden else None
        return [None if hidden is None else hidden[row, : len(chunk)] for row, chunk in zip(rows, chunks)]

    # --- the calls (observed) ---------------------------------------------------------------------------------------

    def forward(
        self,
        cache: KVCache,
        tokens: np.ndarray,
        valid: np.ndarray | None = None,
        *,
        exact: bool = True,
        last: bool = False,
        features: np.ndarray | None = None,
    ) -> np.ndarray:
        """``compute`` with its logits read (see there)."""
        return self._observed(
            "forward",
            cache,
            np.shape(tokens),
            lambda: self.compute(cache, tokens, valid, exact=exact, last=last, features=features),
            exact,
        )

    def prefill(self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None = None) -> None:
        """Append prompt tokens whose logits nobody reads (the next call feeds each prompt's last token again)."""
        self._observed("prefill", cache, np.shape(tokens), lambda: self.compute(cache, tokens, valid, score=False))

    def prefill_rows(self, cache: KVCache, rows: list[int], chunks: list[list[int]]) -> list[np.ndarray | None]:
        """Prefill ``chunks[i]`` after what row ``rows[i]`` of a batch cache holds (an admitted prompt, or its next
        chunk), in place, each as its lone prefill would; the other rows stay as they are. Returns each row's hidden
        states [n_i, H] (None: the engine returns none). On failure the rows may hold part of their chunk: the
        caller rolls them back (``rollback``) or drops them (``select``)."""
        if not any(chunks):
            return [None for _ in rows]
        shape = (sum(1 for chunk in chunks if chunk), max(len(chunk) for chunk in chunks))
        return self._observed("prefill_rows", cache, shape, lambda: self.compute_rows(cache, rows, chunks))

    def generate_tokens(
        self,
        cache: KVCache,
        chunks: list[list[int]],
        drafts: list[list[int]],
        room: list[int],
        sampling: list | None = None,
    ) -> list[list[int]]:
        """``compute_tokens`` (see there), observed: an engine that returns tokens answers a step with this call."""
        shape = (len(chunks), max((len(c) + len(d) for c, d in zip(chunks, drafts)), default=0))
        return self._observed(
            "generate_tokens", cache, shape, lambda: self.compute_tokens(cache, chunks, drafts, room, sampling)
        )

    def watch(self, observer: CallObserver) -> None:
        """Report every call to ``observer`` (a Triton model's call counter, the bench's timings) from now on."""
        self.observers = (*self.observers, observer)

    def unwatch(self, observer: CallObserver) -> None:
        self.observers = tuple(o for o in self.observers if o != observer)

    def _observed(self, kind: str, cache: KVCache, shape: tuple, work: Callable, exact: bool = True):
        if not self.observers:
            return work()
        first, start, session = cache.calls == 0, time.perf_counter(), self.session_seconds
        self.session_widest = 0
        out = work()
        seconds = time.perf_counter() - start
        inside = self.session_seconds - session
        width = int(shape[1]) if len(shape) > 1 else 1
        call = Call(kind, int(shape[0]), width, seconds, inside or seconds, first, exact, self.session_widest or width)
        for observer in self.observers:
            observer(call)
        return out


class EngineWrapper(Engine):
    """An engine seen through another (a reduced draft head's vocabulary map, a bench's recorder of what a draft
    proposes): every member is the wrapped engine's, read when asked (so what a bundle's loader sets on it later holds
    here too), and a subclass overrides ``compute`` to change what a call returns. Its calls are observed here, not
    on the wrapped engine (``admit_rows`` is the base class's, through the wrapped engine's cache methods, so its
    prefill is observed here too)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.vocab_size, self.max_context = engine.vocab_size, engine.max_context

    min_call_tokens = property(lambda self: self.engine.min_call_tokens)
    has_hidden = property(lambda self: self.engine.has_hidden)
    takes_features = property(lambda self: self.engine.takes_features)
    feature_width = property(lambda self: self.engine.feature_width)
    prefills_in_chunks = property(lambda self: self.engine.prefills_in_chunks)
    returns_tokens = property(lambda self: self.engine.returns_tokens)
    samples = property(lambda self: self.engine.samples)
    speculation = property(lambda self: self.engine.speculation)
    session_seconds = property(lambda self: self.engine.session_seconds)
    session_widest = property(
        lambda self: self.engine.session_widest, lambda self, value: setattr(self.engine, "session_widest", value)
    )

    def new_cache(self, batch: int) -> KVCache:
        return self.engine.new_cache(batch)

    def compute(self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None = None, **options):
        return self.engine.compute(cache, tokens, valid, **options)

    def rollback(self, cache: KVCache, keep: np.ndarray) -> None:
        self.engine.rollback(cache, keep)

    def select(self, cache: KVCache, rows: np.ndarray) -> KVCache:
        return self.engine.select(cache, rows)

    def join(self, cache: KVCache, other: KVCache) -> KVCache:
        return self.engine.join(cache, other)

    def reserved_cache(self, rows: int) -> KVCache:
        return self.engine.reserved_cache(rows)

    def compute_rows(self, cache: KVCache, rows: list[int], chunks: list[list[int]]) -> list[np.ndarray | None]:
        return self.engine.compute_rows(cache, rows, chunks)

    def compute_tokens(
        self,
        cache: KVCache,
        chunks: list[list[int]],
        drafts: list[list[int]],
        room: list[int],
        sampling: list | None = None,
    ) -> list[list[int]]:
        return self.engine.compute_tokens(cache, chunks, drafts, room, sampling)


def live_keep_mask(mask: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """mask with every live slot past the first keep[b] of its row cleared."""
    return mask * (np.cumsum(mask, axis=1) <= keep[:, None])
