"""The exported graph's engine (``OnnxEngine``, builder/export.py's graph run with ONNX Runtime), the cache
arithmetic it shares with the test engines, and the table of which engine runs which graph (``new_engine``).

``OnnxEngine`` appends S slots per row a call and returns logits for every new position; ``rollback`` forgets the
newest live tokens of each row by clearing their slots in the attention mask (no copy of the cache). Cleared slots
are reclaimed by ``compact`` when they outnumber live ones. The contract is runtime/engines/base.py; the fused
graph's engine runtime/engines/fused.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from runtime.engines.base import Engine, KVCache, live_keep_mask
from runtime.engines.fused import FusedEngine
from runtime.engines.sessions import make_session

PREFILL_POSITIONS = 256  # OnnxEngine: positions one call of a prompt's prefill takes (``prefill_positions``)


class OnnxEngine(Engine):
    """A decoder graph exported by builder.export, run with ONNX Runtime.

    A prompt (``prefill``, and ``last``, a drafter's first call) is fed in calls of at most
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
        self.session_seconds = 0.0

    def new_cache(self, batch: int) -> KVCache:
        empty = np.zeros((batch, self.num_kv_heads, 0, self.head_dim), self.dtype)
        return KVCache(
            self._to_device([empty] * (2 * self.num_layers)), np.zeros((batch, 0), np.int64), np.zeros(batch, np.int64)
        )

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
        """Append tokens [B, S] and return logits [B, S, V]; with ``last`` (or without ``score``: a prompt whose
        logits nobody reads, this graph having no switch for its head), [B, 1, V] at each row's last valid token only
        (right-padded rows; junk for a row with none), fed in chunks of at most ``prefill_positions`` positions, so a
        long prompt holds a chunk's logits, never S x V of them. Every call of this graph is exact (it pads
        nothing)."""
        if score and not last:
            return self._call(cache, tokens, valid)
        counts = np.full(len(tokens), tokens.shape[1]) if valid is None else np.asarray(valid).sum(axis=1)
        out = np.zeros((len(tokens), 1, self.vocab_size), np.float32)
        for start, stop in self._spans(tokens.shape):
            logits = self._call(cache, tokens[:, start:stop], None if valid is None else valid[:, start:stop])
            rows = np.flatnonzero((counts - 1 >= start) & (counts - 1 < stop))
            out[rows, 0] = logits[rows, counts[rows] - 1 - start]
        return out if score else None

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
        self.session_widest = max(self.session_widest, int(tokens.shape[1]))
        logits, *present = self._run(feed)
        cache.past, cache.mask = present, mask
        cache.lengths = cache.lengths + valid.sum(axis=1)
        cache.calls += 1
        logits = logits.numpy()[..., : self.vocab_size]
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)  # fp16 engines: sample in fp32

    def _run(self, feed: dict) -> list:
        start = time.perf_counter()
        try:
            return self._run_session(feed)
        finally:
            self.session_seconds += time.perf_counter() - start

    def _run_session(self, feed: dict) -> list:
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
