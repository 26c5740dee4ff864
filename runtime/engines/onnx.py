"""The engine interface the decoding loop talks to, and its ONNX Runtime implementations.

Longer than most modules: the interface, its two implementations (the exported graph's and the fused graph's) and
the reduced-vocabulary wrapper are one contract; the fused engine's rules for cutting calls make up most of it.

An engine owns no sequence state; a KVCache does. ``forward`` appends S slots per row and returns logits for every
new position; ``rollback`` forgets the newest live tokens of each row by clearing their slots in the attention mask
(no copy of the cache). Cleared slots are reclaimed by ``compact`` when they outnumber live ones.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from runtime.metrics import available_memory_bytes
from runtime.engines.sessions import make_session


@dataclass
class KVCache:
    """Per-batch cache state. Shapes: past[j] [B, H_kv, T, D]; mask [B, T] (1 = live slot); lengths [B] live tokens."""

    past: list
    mask: np.ndarray
    lengths: np.ndarray
    calls: int = 0  # forward calls made on this cache (tests count them)
    extra: dict = field(default_factory=dict)  # backend-specific state

    @property
    def batch(self) -> int:
        return int(self.mask.shape[0])

    @property
    def slots(self) -> int:
        return int(self.mask.shape[1])


class Engine(Protocol):
    """What the speculative loop needs from a compiled model."""

    vocab_size: int  # logits columns the loop reads (the tokenizer's vocabulary)
    max_context: int

    def new_cache(self, batch: int) -> KVCache: ...

    def forward(
        self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None = None, exact: bool = True
    ) -> np.ndarray:
        """Append tokens [B, S] (valid [B, S] marks real tokens; padding is 0) and return logits [B, S, V]."""

    def rollback(self, cache: KVCache, keep: np.ndarray) -> None:
        """Keep only the first keep[b] live tokens of each row."""

    def select(self, cache: KVCache, rows: np.ndarray) -> KVCache:
        """A cache holding only the given rows (sequences that are still running)."""

    def join(self, cache: KVCache, other: KVCache) -> KVCache:
        """A cache holding cache's rows, then other's (requests admitted into a running batch)."""


def live_keep_mask(mask: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """mask with every live slot past the first keep[b] of its row cleared."""
    return mask * (np.cumsum(mask, axis=1) <= keep[:, None])


PREFILL_POSITIONS = 256  # OnnxEngine: positions one call of a prompt's prefill takes (``prefill_positions``)


class OnnxEngine:
    """A decoder graph exported by builder.export, run with ONNX Runtime.

    A prompt (``prefill``, and ``forward(last=True)``, a drafter's first call) is fed in calls of at most
    ``prefill_positions`` positions: the graph scores every position it takes, and a whole 32k-token prompt in one
    call would make S x V logits and S x S attention scores per head (tens of gigabytes).

    ``cache_device`` None keeps the cache in ONNX Runtime's CPU memory and runs plain ``run_with_ort_values``;
    "cuda" (or "cpu", which tests use to exercise the same path) binds the present tensors to that device with an
    IO binding, so on a GPU the cache never crosses PCIe between steps: only ids, mask and logits do.
    """

    def __init__(
        self,
        path: Path,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        max_context: int,
        threads: int = 0,
        providers: list | None = None,
        session=None,
        cache_device: str | None = None,
        device_id: int = 0,
    ):
        self.session = session or make_session(path, threads, providers)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.vocab_size, self.max_context = vocab_size, max_context
        self.cache_device, self.device_id = cache_device, device_id
        self.past_names = [f"past.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
        self.output_names = ["logits"] + [n.replace("past", "present", 1) for n in self.past_names]
        self.dtype = np.float16 if "float16" in self.session.get_inputs()[3].type else np.float32
        # positions (rows x tokens) one prompt call takes: bounds its logits (positions x V) and its attention
        # scores (positions x heads x context), which a whole 32k-token prompt would make tens of gigabytes of
        self.prefill_positions = PREFILL_POSITIONS

    def new_cache(self, batch: int) -> KVCache:
        empty = np.zeros((batch, self.num_kv_heads, 0, self.head_dim), self.dtype)
        return KVCache(
            self._to_device([empty] * (2 * self.num_layers)), np.zeros((batch, 0), np.int64), np.zeros(batch, np.int64)
        )

    scores_last = True  # forward(last=True): a prompt in chunks, logits kept at each row's last token only

    def prefill(self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None = None) -> None:
        """Prompt tokens whose logits nobody reads: ``forward(last=True)``, its one row of logits dropped. This
        graph has no switch for its head, so each of its calls makes logits for every position it takes; fed in
        chunks of at most ``prefill_positions`` positions, that is a chunk's worth, never a whole prompt's."""
        self.forward(cache, tokens, valid, last=True)

    def forward(
        self,
        cache: KVCache,
        tokens: np.ndarray,
        valid: np.ndarray | None = None,
        exact: bool = True,
        last: bool = False,
    ) -> np.ndarray:
        """Append tokens [B, S] and return logits [B, S, V]; with ``last``, [B, 1, V] at each row's last valid
        token only (right-padded rows; junk for a row with none), fed in chunks as ``prefill`` is, so a drafter's
        first call on a long prompt holds a chunk's logits, never S x V of them."""
        if not last:
            return self._call(cache, tokens, valid)
        counts = np.full(len(tokens), tokens.shape[1]) if valid is None else np.asarray(valid).sum(axis=1)
        out = np.zeros((len(tokens), 1, self.vocab_size), np.float32)
        for start, stop in self._spans(tokens.shape):
            logits = self._call(cache, tokens[:, start:stop], None if valid is None else valid[:, start:stop])
            rows = np.flatnonzero((counts - 1 >= start) & (counts - 1 < stop))
            out[rows, 0] = logits[rows, counts[rows] - 1 - start]
        return out

    def _spans(self, shape: tuple[int, int]) -> list[tuple[int, int]]:
        """[start, stop) column ranges of a call of ``shape`` [B, S] whose chunks hold at most ``prefill_positions``
        positions (B x width; at least one column)."""
        width = max(1, self.prefill_positions // max(1, shape[0]))
        return [(start, min(start + width, shape[1])) for start in range(0, shape[1], width)]

    def _call(self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None) -> np.ndarray:
        """One call; the present tensors stay OrtValues and are fed back as the next past without a copy."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        valid = np.ones_like(tokens) if valid is None else valid.astype(np.int64)
        positions = np.maximum(cache.lengths[:, None] + np.cumsum(valid, axis=1) - 1, 0)
        mask = np.concatenate([cache.mask, valid], axis=1)
        small = {"input_ids": tokens, "attention_mask": mask, "position_ids": positions}
        feed = {name: self._ort.OrtValue.ortvalue_from_numpy(array) for name, array in small.items()}
        feed.update(zip(self.past_names, cache.past))
        logits, *present = self._run(feed)
        cache.past, cache.mask = present, mask
        cache.lengths = cache.lengths + valid.sum(axis=1)
        cache.calls += 1
        logits = logits.numpy()[..., : self.vocab_size]
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)  # fp16 engines: sample in fp32

    def _run(self, feed: dict) -> list:
        if self.cache_device is None:
            return self.session.run_with_ort_values(self.output_names, feed)
        binding = self.session.io_binding()
        for name, value in feed.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")  # the sampler reads logits on the host
        for name in self.output_names[1:]:
            binding.bind_output(name, self.cache_device, self.device_id)
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()

    def rollback(self, cache: KVCache, keep: np.ndarray) -> None:
        cache.mask = live_keep_mask(cache.mask, keep)
        cache.lengths = np.minimum(cache.lengths, keep)
        if cache.slots > 64 and cache.slots > 2 * int(cache.lengths.max()):
            self._compact(cache)

    def select(self, cache: KVCache, rows: np.ndarray) -> KVCache:
        picked = KVCache([p.numpy()[rows] for p in cache.past], cache.mask[rows], cache.lengths[rows], cache.calls)
        self._compact(picked)
        return picked

    def join(self, cache: KVCache, other: KVCache) -> KVCache:
        past, mask = stack_rows(
            [p.numpy() for p in cache.past], cache.mask, [p.numpy() for p in other.past], other.mask
        )
        return KVCache(self._to_device(past), mask, np.concatenate([cache.lengths, other.lengths]), cache.calls)

    def _compact(self, cache: KVCache) -> None:
        past = [p if isinstance(p, np.ndarray) else p.numpy() for p in cache.past]
        cache.past, cache.mask = compact(past, cache.mask, cache.lengths)
        cache.past = self._to_device(cache.past)

    def _to_device(self, arrays: list[np.ndarray]) -> list:
        device = self.cache_device or "cpu"
        return [self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), device, self.device_id) for a in arrays]

    @property
    def _ort(self):
        import onnxruntime

        return onnxruntime


def compact(past: list[np.ndarray], mask: np.ndarray, lengths: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Gather each row's live slots to the right end (left padding), dropping slots no row uses.

    The only full copy of the cache the runtime makes; it runs when rolled-back slots outnumber live ones, or when
    finished rows leave a batch.
    """
    slots = mask.shape[1]
    width = int(lengths.max()) if len(lengths) else 0
    if width == slots and bool(mask.all()):
        return past, mask
    order = np.argsort(mask, axis=1, kind="stable")[:, slots - width :]  # live slots last, in their order
    return [np.take_along_axis(p, order[:, None, :, None], axis=2) for p in past], np.take_along_axis(mask, order, 1)


def stack_rows(
    past: list[np.ndarray], mask: np.ndarray, more: list[np.ndarray], more_mask: np.ndarray, time_axis: int = 2
) -> tuple[list[np.ndarray], np.ndarray]:
    """Two batches' cache arrays as one: the shorter side is left-padded with dead slots (mask 0)."""
    width = max(mask.shape[1], more_mask.shape[1])

    def pad(array: np.ndarray, slots: int) -> np.ndarray:
        widths = [(0, 0)] * array.ndim
        widths[time_axis] = (width - slots, 0)
        return np.pad(array, widths)

    joined = [np.concatenate([pad(a, mask.shape[1]), pad(b, more_mask.shape[1])]) for a, b in zip(past, more)]
    masks = [np.pad(m, ((0, 0), (width - m.shape[1], 0))) for m in (mask, more_mask)]
    return joined, np.concatenate(masks).astype(np.int64)


class MappedVocabEngine:
    """A draft engine whose output head covers only some token ids (a reduced-vocabulary draft head).

    The wrapped engine returns logits [B, S, N] over ``kept_ids`` (column j is token kept_ids[j]); this one returns
    logits over the full vocabulary with -inf everywhere else. The draft's q is then exactly 0 outside the kept set,
    it proposes only kept tokens, and the acceptance rule (runtime.decoding.sampling) stays exact: the target's
    probability of
    any other token comes back through the residual max(0, p - q).
    """

    def __init__(self, engine: Engine, kept_ids, vocab_size: int):
        kept = np.asarray(kept_ids, dtype=np.int64)
        if kept.ndim != 1 or not len(kept) or len(np.unique(kept)) != len(kept) or kept.min() < 0:
            raise ValueError("kept_ids must be a non-empty list of distinct non-negative token ids")
        if int(kept.max()) >= vocab_size:
            raise ValueError(f"kept id {int(kept.max())} is outside the vocabulary ({vocab_size} tokens)")
        self.engine, self.kept_ids = engine, kept
        self.scores_last = getattr(engine, "scores_last", False)
        self.vocab_size = vocab_size  # may be lowered to the tokenizer's vocabulary, like any engine's
        self.max_context = engine.max_context

    def new_cache(self, batch: int) -> KVCache:
        return self.engine.new_cache(batch)

    def forward(self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None = None, **options) -> np.ndarray:
        small = self.engine.forward(cache, tokens, valid, **options)
        if small.shape[-1] != len(self.kept_ids):
            raise ValueError(
                f"the draft engine returned {small.shape[-1]} logits per position; its vocabulary map "
                f"has {len(self.kept_ids)} ids"
            )
        full = np.full(small.shape[:-1] + (self.vocab_size,), -np.inf, dtype=small.dtype)
        inside = self.kept_ids < self.vocab_size
        full[..., self.kept_ids[inside]] = small[..., inside]
        return full

    def rollback(self, cache: KVCache, keep: np.ndarray) -> None:
        self.engine.rollback(cache, keep)

    def select(self, cache: KVCache, rows: np.ndarray) -> KVCache:
        return self.engine.select(cache, rows)

    def join(self, cache: KVCache, other: KVCache) -> KVCache:
        return self.engine.join(cache, other)

    def __getattr__(self, name: str):  # session, num_layers, ...: whatever the wrapped engine has
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)


class FusedEngine:
    """A fused decoder graph (builder.graph: GroupQueryAttention over a fixed-capacity cache) run with ONNX Runtime.

    The cache is one float32 buffer [B, H_kv, T, D] per layer and kind, bound as both past and present, so the graph
    writes the new tokens' K/V in place: nothing is concatenated or copied per call. Row b's live tokens fill slots
    [0, lengths[b]); ``rollback`` only lowers lengths (the next call overwrites the dead slots). The buffer doubles
    when a call would run past it (rare; a copy), up to the bundle's context.

    Padding in a call (right-padded rows, a row with nothing to add) is computed like real tokens and then left dead:
    each new token only attends to slots before it, so padding never changes a real token's logits.

    GroupQueryAttention on CPU takes several new tokens on a past only at batch 1, so such a call over a batch runs
    row by row, each on a view of its own rows of the same buffers (no copy).

    ``min_call_tokens`` 2 pads one-token calls to two. A call of one token takes other kernels than a call of
    several, on every CPU measured: MatMulNBits with int8 activations (accuracy level 4) computes one row by another
    kernel than several rows, whose activation rounding turns that ~1e-7 difference into logits apart by up to ~2
    after 30 layers, and GroupQueryAttention's one-query SGEMM rounds otherwise at every head dim. A target
    therefore always takes the many-token kernels, so a verify call scores each token exactly as target-only decoding
    does (tests/test_fused_graph.py). A batched one-token step is padded too (and so runs row by row) unless the
    caller asks for ``exact=False``.

    ``class_points``: call totals across which GroupQueryAttention rounds a token's scores otherwise (head dim > 128;
    runtime.engines.attention_classes measures them on this CPU). Calls are cut so that each token is scored at a
    total in
    the class of its position + ``min_call_tokens``, the total target-only decoding scores it at, whatever the call,
    batch or prefill.

    ``one_token_calls``: the exact form where the load-time check (``call_shape_mismatch``) found this CPU scoring
    a token otherwise in a verify call: every scored call then runs one token at a time, as target-only does.
    """

    def __init__(
        self,
        path: Path,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        max_context: int,
        threads: int = 0,
        providers: list | None = None,
        session=None,
        initial_slots: int = 256,
        min_call_tokens: int = 1,
        class_points: tuple[int, ...] = (),
    ):
        self.session = session or make_session(path, threads, providers)
        self.class_points = np.asarray(class_points, np.int64)  # runtime.engines.attention_classes: calls are cut there
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.vocab_size, self.max_context = vocab_size, max_context
        self.initial_slots, self.min_call_tokens = initial_slots, min_call_tokens
        self.one_token_calls = False  # the exact form: set where call_shape_mismatch found a difference
        self.prefills_in_chunks = True  # False where prefill_chunks_differ: a server then prefills prompts whole
        self.past_names = [f"past.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
        self.present_names = [n.replace("past", "present", 1) for n in self.past_names]
        # graphs since the feature draft: every call's final hidden states (cache.extra["hidden"]); a feature
        # draft's graph also takes the hidden state before each token
        outputs = {o.name: o for o in self.session.get_outputs()}
        self.has_hidden = "hidden" in outputs
        inputs = {i.name for i in self.session.get_inputs()}
        self.takes_features = "features" in inputs
        # graphs since 2026-12-03 take each row's query length: one call then runs a ragged batch (see forward)
        self.ragged = "query_lengths" in inputs
        self.head_width = outputs["logits"].shape[-1]  # the graph's own head (a reduced draft head: its rows)
        self.hidden_width = outputs["hidden"].shape[-1] if self.has_hidden else 0
        self._outputs: dict = {}

    def new_cache(self, batch: int) -> KVCache:
        slots = min(self.initial_slots, self.max_context)
        return KVCache(
            self._buffers(batch, slots), np.zeros((batch, 0), np.int64), np.zeros(batch, np.int64), extra={"views": {}}
        )

    def _buffers(self, batch: int, slots: int) -> list[np.ndarray]:
        shape = (batch, self.num_kv_heads, slots, self.head_dim)
        return [np.zeros(shape, np.float32) for _ in self.past_names]

    def reserved_cache(self, rows: int) -> KVCache:
        """An empty batch cache whose buffers already hold ``rows`` rows of the whole context, written once so the
        memory is taken now (a server's KV cache, reserved at start as vLLM and TensorRT-LLM do): no request then
        makes the process grow, and rows join (``add_rows``), prefill in place (``prefill_row``) and leave
        (``select``) without a copy of the batch."""
        shape = (rows, self.num_kv_heads, self.max_context + self.min_call_tokens, self.head_dim)
        need = len(self.past_names) * int(np.prod(shape)) * 4
        available = available_memory_bytes()
        if available is not None and need > available:
            raise MemoryError(
                f"the batch's KV cache ({rows} rows of {self.max_context} tokens) needs "
                f"{need / 2**30:.2f} GiB and {available / 2**30:.2f} GiB is available: lower the batch "
                "(--max-batch) or build the bundle with a shorter --max-context"
            )
        return KVCache(
            [np.full(shape, 0.0, np.float32) for _ in self.past_names],
            np.zeros((0, 0), np.int64),
            np.zeros(0, np.int64),
            extra={"views": {}},
        )

    def add_rows(self, cache: KVCache, count: int) -> KVCache:
        """``cache`` with ``count`` empty rows after its own, in its buffers (grown only past their capacity)."""
        rows = cache.past[0].shape[0]
        if cache.batch + count > rows:
            self._grow(cache, 1 << (cache.batch + count - 1).bit_length(), cache.past[0].shape[2])
        return KVCache(
            cache.past,
            np.zeros((cache.batch + count, 0), np.int64),
            np.concatenate([cache.lengths, np.zeros(count, np.int64)]),
            cache.calls,
            extra=cache.extra,
        )

    def prefill_row(self, cache: KVCache, row: int, tokens) -> np.ndarray | None:
        """Prefill ``tokens`` after what row ``row`` of a batch cache holds (its prompt, or the next chunk of it), in
        place, without the head: the calls a lone request's prefill makes (the same kernels, cut at the same class
        points, so a prompt prefilled in chunks leaves the same cache), whatever else the batch holds. Returns the
        final hidden states [n, H] (None: the graph returns none, or no tokens)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if not len(tokens):
            return None
        self._reserve(cache, int(cache.lengths[row]) + len(tokens) + self.min_call_tokens - 1)
        _, hidden = self._row(cache, row, tokens, score=False, features=None)
        cache.lengths = cache.lengths.copy()
        cache.lengths[row] += len(tokens)
        cache.calls += 1
        return hidden

    def prefill(self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None = None) -> None:
        """``forward`` without the output head: a prompt's logits are not read (its last token is fed again)."""
        self.forward(cache, tokens, valid, score=False)

    scores_last = True  # forward(last=True): the head runs only where a row's last token is

    def forward(
        self,
        cache: KVCache,
        tokens: np.ndarray,
        valid: np.ndarray | None = None,
        score: bool = True,
        features: np.ndarray | None = None,
        last: bool = False,
        exact: bool = True,
    ) -> np.ndarray:
        """Append each row's valid tokens (right-padded in ``tokens``) and return logits [B, S, V]; with ``last``,
        [B, 1, V] at each row's last valid token only (a drafter reads nothing else: the head, and for a reduced
        one its expansion to the vocabulary, then cost one position, not a whole prompt's). A feature draft also
        takes ``features`` [B, S, H] (the hidden state before each token). The final hidden states [B, S, H] are
        left in ``cache.extra["hidden"]`` where the graph returns them. ``exact=False`` lets a batched one-token
        step run as one batched call (one query row per head: other kernels than a lone row's, so its logits can
        differ from target-only's in the last bits; the scheduler's "throughput" policy asks for it)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        counts = tokens.shape[1] * np.ones(len(tokens), np.int64) if valid is None else valid.sum(axis=1)
        asked = tokens.shape[1]
        last = last and score
        if self.takes_features:
            if features is None or features.shape[:2] != tokens.shape:
                raise ValueError("a feature draft engine takes features [B, S, H] with its tokens [B, S]")
            features = np.ascontiguousarray(features, dtype=np.float32)
        if self.one_token_calls and score and asked > 1:
            return self._one_token_at_a_time(cache, tokens, valid, features, last)
        if asked < self.min_call_tokens and (exact or len(tokens) * asked < self.min_call_tokens):
            # a lone token, or each row's one token of a batched step, padded: the kernels target-only decoding
            # takes (a batched step then runs row by row: GroupQueryAttention takes one new token a row at batch > 1)
            tokens = np.pad(tokens, ((0, 0), (0, self.min_call_tokens - asked)))
            if features is not None:
                features = np.pad(features, ((0, 0), (0, self.min_call_tokens - asked), (0, 0)))
        batch, new = tokens.shape
        one_call = batch == 1 or new == 1 or not cache.lengths.any()
        if one_call and not (len(self.class_points) and new > 1):
            self._reserve(cache, int(cache.lengths.max()) + new)  # every row writes ``new`` slots
            # the head sees the last ``keep`` positions: all, none, or from the earliest row's last token on
            keep = (new - int(counts[counts > 0].min(initial=new)) + 1) if last else (new if score else 0)
            logits, hidden = self._run(cache, slice(0, batch), tokens, cache.lengths + new, keep, features)
            if last:
                at = np.clip(counts - 1 - (new - keep), 0, keep - 1)
                logits = logits[np.arange(batch), at][:, None]
        else:  # several new tokens on a past over a batch: one ragged call, and a call per row where it must
            logits = np.zeros((batch, 1 if last else new if score else 0, self.vocab_size), np.float32)
            alone = self._rows_alone(cache, counts)
            hidden = self._ragged(cache, tokens, counts, alone, score, features, last, logits)
            widths = np.where(alone, counts + self.min_call_tokens - 1, 0)  # a cut's last call may pad
            self._reserve(cache, int((cache.lengths + widths).max()))  # each row its own chunk, not the widest
            for b in np.flatnonzero(alone):
                part, h = self._row(
                    cache,
                    b,
                    tokens[b, : counts[b]],
                    score,
                    None if features is None else features[b, : counts[b]],
                    last,
                )
                logits[b, : len(part)] = part
                if h is not None:
                    hidden = np.zeros((batch, new, h.shape[-1]), np.float32) if hidden is None else hidden
                    hidden[b, : counts[b]] = h
        if self.has_hidden:
            cache.extra["hidden"] = None if hidden is None else hidden[:, :asked]
        cache.lengths = cache.lengths + counts
        cache.calls += 1
        return logits if last else logits[:, :asked]

    def _rows_alone(self, cache: KVCache, counts: np.ndarray) -> np.ndarray:
        """Rows of a multi-token call over a batch that get calls of their own: every row with tokens where the graph
        takes no query lengths (the kernel's batch-1 path) or where the ragged call would not fit (the kernel wants
        room for the whole padded chunk after every row, idle ones too: only near the context), else only rows whose
        tokens a class point parts."""
        if not self.ragged:
            return counts > 0
        alone = np.array(
            [c > 0 and len(self._segments(int(n), int(c))) > 1 for n, c in zip(cache.lengths, counts)], dtype=bool
        )
        together = (counts > 0) & ~alone
        width = int(np.maximum(counts[together], self.min_call_tokens).max(initial=0))
        if int(cache.lengths.max()) + width > self.max_context + self.min_call_tokens:
            return counts > 0
        return alone

    def _ragged(
        self,
        cache: KVCache,
        tokens: np.ndarray,
        counts: np.ndarray,
        alone: np.ndarray,
        score: bool,
        features: np.ndarray | None,
        last: bool,
        logits: np.ndarray,
    ) -> np.ndarray | None:
        """One call for every row with tokens that is not scored alone: row b takes max(counts[b],
        ``min_call_tokens``) query positions (padded like a lone call of its own, so each row gets the kernels that
        call would give it; tests/test_fused_graph.py checks it bit for bit) after its own past; the other rows
        take none and stay as they are. Fills ``logits`` rows; returns the hidden states [B, S, H] (None: none)."""
        together = (counts > 0) & ~alone
        if not together.any():
            return None
        queries = np.where(together, np.maximum(counts, self.min_call_tokens), 0)
        queries[(queries == 0) & (cache.lengths == 0)] = 1  # the kernel needs a token in every row: a dead slot
        width = int(queries.max())
        chunk = np.pad(tokens, ((0, 0), (0, max(0, width - tokens.shape[1]))))[:, :width]
        feats = (
            None
            if features is None
            else np.pad(features, ((0, 0), (0, max(0, width - features.shape[1])), (0, 0)))[:, :width]
        )
        # each row's own tokens within the context, as its lone calls would be; then every row's buffer must hold
        # the whole padded chunk (the kernel's rule)
        self._reserve(cache, int((cache.lengths + np.where(together, counts + self.min_call_tokens - 1, 0)).max()))
        self._reserve(cache, int(cache.lengths.max()) + width)
        part, hidden = self._run(
            cache, slice(0, len(tokens)), chunk, cache.lengths + queries, width if score else 0, feats, queries
        )
        rows = np.flatnonzero(together)
        if last:
            logits[rows, 0] = part[rows, counts[rows] - 1]
        elif score:
            span = min(width, logits.shape[1])
            logits[rows, :span] = part[rows, :span]
        if hidden is None:
            return None
        out = np.zeros((len(tokens), tokens.shape[1], hidden.shape[-1]), np.float32)
        span = min(width, tokens.shape[1])
        out[rows, :span] = hidden[rows, :span]
        return out

    def _row(
        self, cache: KVCache, b: int, tokens: np.ndarray, score: bool, features: np.ndarray | None, last: bool = False
    ):
        """Row ``b``'s ``tokens`` [n] in calls cut where a class point parts them (``_segments``), each right-padded
        to ``min_call_tokens``: logits [n, V] (or [0, V]; [1, V] at the last token with ``last``) and hidden states
        [n, H] (None: the graph has none)."""
        start, m = int(cache.lengths[b]), self.min_call_tokens
        logits, hidden = [], []
        segments = self._segments(start, len(tokens))
        for a, z in segments:
            width = max(z - a, m)
            chunk = np.pad(tokens[a:z], (0, width - (z - a)))[None]
            feats = None if features is None else np.pad(features[a:z], ((0, width - (z - a)), (0, 0)))[None]
            keep = (width - (z - a) + 1 if z == segments[-1][1] else 0) if last else (width if score else 0)
            part, h = self._run(cache, slice(b, b + 1), chunk, np.array([start + a + width]), keep, feats)
            logits.append(part[0, :1] if last else part[0, : z - a])
            if h is not None:
                hidden.append(h[0, : z - a])
        return np.concatenate(logits), (np.concatenate(hidden) if hidden else None)

    def _segments(self, start: int, count: int) -> list[tuple[int, int]]:
        """[a, z) ranges of ``count`` new tokens after ``start`` live ones such that every token's call total lies in
        the class target-only decoding scores it in (position + ``min_call_tokens``;
        runtime.engines.attention_classes)."""
        if not len(self.class_points):
            return [(0, count)]
        classes = np.searchsorted(self.class_points, start + np.arange(count) + self.min_call_tokens)
        cuts = (np.flatnonzero(np.diff(classes)) + 1).tolist()
        return list(zip([0, *cuts], [*cuts, count]))

    def _one_token_at_a_time(
        self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None, features: np.ndarray | None, last: bool
    ) -> np.ndarray:
        """``forward`` as one call per column: the exact form where the load-time check (``call_shape_mismatch``)
        found a verify call scoring a token otherwise than target-only decoding, whose calls are one token wide."""
        counts = tokens.shape[1] * np.ones(len(tokens), np.int64) if valid is None else valid.sum(axis=1)
        logits, hidden = [], []
        for j in range(tokens.shape[1]):
            column = None if valid is None else valid[:, j : j + 1]
            logits.append(
                self.forward(
                    cache, tokens[:, j : j + 1], column, features=None if features is None else features[:, j : j + 1]
                )
            )
            hidden.append(cache.extra.get("hidden"))
        out = np.concatenate(logits, axis=1)
        if self.has_hidden:
            cache.extra["hidden"] = np.concatenate(hidden, axis=1)
        return out[np.arange(len(out)), np.maximum(counts - 1, 0)][:, None] if last else out

    def call_shape_mismatch(self, vocab: int, seed: int = 0) -> str | None:
        """Whether this CPU scores a token alike under every call shape the runtime uses, checked on the engine
        itself (ONNX Runtime picks kernels by ISA and matrix size, so this cannot be known from elsewhere): one
        token a call (target-only), inside verify calls, and in a batched step. None when all agree bit for bit;
        else the call shape that differed. Over the first 12 positions (class points are measured apart)."""
        length = min(12, self.max_context - self.min_call_tokens)
        if length < 8:
            return None
        tokens = np.random.default_rng(seed).integers(0, vocab, (2, length))
        reference = self._scored(tokens[:1], [1] * (length - 4))
        shapes = {
            "a verify call of 4 tokens": lambda: self._scored(tokens[:1], [4, length - 8]),
            "a verify call of 2 tokens": lambda: self._scored(tokens[:1], [2] * ((length - 4) // 2)),
            "a batched one-token step": lambda: self._scored(tokens, [1] * (length - 4))[:1],
            "a batched verify call": lambda: self._scored(tokens, [4, length - 8], ragged=True)[:1],
        }
        for name, scores in shapes.items():
            if not np.array_equal(scores(), reference):
                return name
        return None

    def prefill_chunks_differ(self, vocab: int, seed: int = 0) -> bool:
        """Whether a prompt prefilled in two calls leaves a cache that scores the next tokens otherwise than one
        prefill call does, on this CPU (a server's chunked prefill rests on it: runtime/serving/scheduler.py)."""
        length = min(12, self.max_context - self.min_call_tokens)
        if length < 8:
            return False
        tokens = np.random.default_rng(seed).integers(0, vocab, (1, length))
        widths = [1] * (length - 4)
        return not np.array_equal(self._scored(tokens, widths, prefill=(2, 2)), self._scored(tokens, widths))

    def _scored(
        self, tokens: np.ndarray, widths: list[int], ragged: bool = False, prefill: tuple[int, ...] = (4,)
    ) -> np.ndarray:
        """Logits of ``tokens`` [B, n] past a prefill of 4 (in calls of ``prefill`` tokens), fed in calls of
        ``widths`` tokens (``ragged``: the rows after the first take one token fewer a call, so rows of several
        lengths share each call)."""
        cache = self.new_cache(len(tokens))
        at = 0
        for width in prefill:
            self.prefill(cache, tokens[:, at : at + width])
            at += width
        at, out = 4, []
        for width in widths:
            valid = np.ones((len(tokens), width), np.int64)
            if ragged:
                valid[1:, width - 1 :] = 0
            out.append(self.forward(cache, tokens[:, at : at + width] * valid, valid))
            at += width
        return np.concatenate(out, axis=1)

    def _run(
        self,
        cache: KVCache,
        rows: slice,
        tokens: np.ndarray,
        totals: np.ndarray,
        keep: int,
        features: np.ndarray | None = None,
        queries: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One session call on ``rows`` of the cache; ``totals``: each row's slot count after the call; ``queries``:
        each row's tokens in it (None: all of ``tokens``' columns); logits for the last ``keep`` positions, and the
        hidden states of all new positions (None: the graph has none)."""
        binding = self._binding(cache, rows)
        binding.bind_cpu_input("input_ids", tokens)
        if self.ragged:
            queries = np.full(len(tokens), tokens.shape[1]) if queries is None else queries
            binding.bind_cpu_input("query_lengths", queries.astype(np.int32))
        binding.bind_cpu_input("logits_to_keep", np.array([keep], dtype=np.int64))
        binding.bind_cpu_input("seqlens_k", (totals - 1).astype(np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(int(totals.max()), dtype=np.int32))
        if features is not None:
            binding.bind_cpu_input("features", features)
        outputs = self._output_values(tokens.shape, keep)
        for name, value in outputs.items():
            binding.bind_ortvalue_output(name, value)
        self.session.run_with_iobinding(binding)
        # copies: the buffers are bound again by the next call of this shape
        logits = np.array(outputs["logits"].numpy()[..., : self.vocab_size])
        return logits, (np.array(outputs["hidden"].numpy()) if self.has_hidden else None)

    OUTPUT_CACHE = 64  # output shapes whose buffers are kept: a decode step's few (batch, tokens) shapes
    CACHED_TOKENS = 16  # calls of more tokens a row (prefills) get buffers of their own, not kept

    def _output_values(self, shape: tuple[int, int], keep: int) -> dict:
        """The logits (and hidden-state) outputs for a call of ``shape`` tokens keeping ``keep`` positions, made
        once per shape and bound again each call: reading them back needs no wrapper for each of the graph's ~60
        bound outputs (IOBinding.get_outputs), and ONNX Runtime allocates nothing for a shape seen before."""
        key = (shape[0], shape[1], keep)
        values = self._outputs.get(key)
        if values is None:
            ort = self._ort
            values = {
                "logits": ort.OrtValue.ortvalue_from_shape_and_type((shape[0], keep, self.head_width), np.float32)
            }
            if self.has_hidden:
                values["hidden"] = ort.OrtValue.ortvalue_from_shape_and_type((*shape, self.hidden_width), np.float32)
            if shape[1] <= self.CACHED_TOKENS:
                if len(self._outputs) >= self.OUTPUT_CACHE:
                    self._outputs.pop(next(iter(self._outputs)))
                self._outputs[key] = values
        return values

    def _binding(self, cache: KVCache, rows: slice):
        """An IO binding with past and present bound to the same buffers (rows' views), made once per rows."""
        views = cache.extra.setdefault("views", {})
        key = (rows.start, rows.stop)
        if key not in views:
            binding = self.session.io_binding()
            binding.bind_output("logits", "cpu")  # first: get_outputs()[0]
            if self.has_hidden:
                binding.bind_output("hidden", "cpu")  # second: get_outputs()[1]
            for past, present, buffer in zip(self.past_names, self.present_names, cache.past):
                value = self._ort.OrtValue.ortvalue_from_numpy(buffer[rows])
                binding.bind_ortvalue_input(past, value)
                binding.bind_ortvalue_output(present, value)
            views[key] = binding
        return views[key]

    def _reserve(self, cache: KVCache, needed: int) -> None:
        slots = cache.past[0].shape[2]
        if needed <= slots:
            return
        limit = self.max_context + self.min_call_tokens  # padding may pass the context by a slot; it stays dead
        if needed > limit:
            raise ValueError(f"a call would hold {needed} tokens; this engine's context is {self.max_context}")
        self._grow(cache, cache.past[0].shape[0], min(limit, max(needed, 2 * slots)))

    def _grow(self, cache: KVCache, rows: int, slots: int) -> None:
        """New buffers of ``rows`` x ``slots`` holding the old ones' contents (bindings are remade)."""
        bigger = self._buffers(rows, slots)
        old_rows, old_slots = cache.past[0].shape[0], cache.past[0].shape[2]
        for old, new in zip(cache.past, bigger):
            new[:old_rows, :, :old_slots] = old
        cache.past, cache.extra["views"] = bigger, {}

    def rollback(self, cache: KVCache, keep: np.ndarray) -> None:
        cache.lengths = np.minimum(cache.lengths, keep)

    def select(self, cache: KVCache, rows: np.ndarray) -> KVCache:
        """The given rows. Rows kept in order move down within the same buffers (only their live slots are copied,
        and the bindings stay valid: a server retires requests every few steps); otherwise new buffers trimmed to
        what the rows use (at least ``initial_slots``). Either way the old cache must not be used again."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows) or bool((np.diff(rows) > 0).all()):  # in order (or none): the buffers stay
            for i, r in enumerate(rows):
                if i != r:
                    used = int(cache.lengths[r])
                    for buffer in cache.past:
                        buffer[i, :, :used] = buffer[r, :, :used]
            return KVCache(cache.past, cache.mask[rows], cache.lengths[rows], cache.calls, extra=cache.extra)
        used = int(cache.lengths[rows].max()) if len(rows) else 0
        slots = min(cache.past[0].shape[2], max(used, self.initial_slots))
        past = [np.ascontiguousarray(p[rows][:, :, :slots]) for p in cache.past]
        return KVCache(past, cache.mask[rows], cache.lengths[rows], cache.calls, extra={"views": {}})

    def join(self, cache: KVCache, other: KVCache) -> KVCache:
        """cache's rows, then other's, in cache's buffers: they grow (rows to a power of two, so admitting one
        request at a time copies the batch only log-many times) when other does not fit."""
        n, m = cache.batch, other.batch
        used = int(other.lengths.max()) if m else 0
        rows, slots = cache.past[0].shape[0], cache.past[0].shape[2]
        if n + m > rows or used > slots:
            self._grow(cache, max(rows, 1 << (n + m - 1).bit_length()), max(slots, used))
        for buffer, more in zip(cache.past, other.past):
            buffer[n : n + m, :, :used] = more[:, :, :used]
        return KVCache(
            cache.past,
            np.zeros((n + m, 0), np.int64),
            np.concatenate([cache.lengths, other.lengths]),
            cache.calls,
            extra=cache.extra,
        )

    @property
    def _ort(self):
        import onnxruntime

        return onnxruntime


ENGINES = {"export": OnnxEngine, "fused": FusedEngine}  # bundle.GRAPHS -> the engine that runs that contract


def engine_class(graph: str):
    """The engine class for a ModelEntry's ``graph``."""
    if graph not in ENGINES:
        raise ValueError(f"unknown engine graph {graph!r}; this Draftsmith runs {sorted(ENGINES)}")
    return ENGINES[graph]


def new_engine(graph: str, path: Path, sizes, max_context: int, **options):
    """The engine for ``graph`` on ``path``, sized by ``sizes``: anything with ``num_layers``, ``num_kv_heads``,
    ``head_dim`` and ``vocab_size`` (a manifest's ModelEntry, the builder's GraphInfo). Public: the bundle loader,
    the builder's checks and evaluation and the profiler all open engines from such a record; ``options`` go to the
    class as they are (threads, session, initial_slots, ...)."""
    return engine_class(graph)(
        path,
        num_layers=sizes.num_layers,
        num_kv_heads=sizes.num_kv_heads,
        head_dim=sizes.head_dim,
        vocab_size=sizes.vocab_size,
        max_context=max_context,
        **options,
    )


@contextlib.contextmanager
def unpadded(engine):
    """The engine's one-token calls unpadded (``min_call_tokens`` 1) for the duration: plain target-only decoding,
    what a user's decoder runs and every printed speedup is over (the padded run is exactness's reference only)."""
    saved = getattr(engine, "min_call_tokens", 1)
    if hasattr(engine, "min_call_tokens"):
        engine.min_call_tokens = 1
    try:
        yield engine
    finally:
        if hasattr(engine, "min_call_tokens"):
            engine.min_call_tokens = saved
