"""The fused decoder graph's engine (builder/graph.py: GroupQueryAttention over a fixed-capacity cache), run with
ONNX Runtime: the CPU default, and the one whose calls are cut so that every token is scored exactly as target-only
decoding scores it (the checks of those rules on this CPU are runtime/engines/call_checks.py).

Longer than most modules: the rules for cutting a call (padding, ragged batches, rows alone, class points) and the
in-place buffers they write are one contract; split, neither half could be read alone."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from runtime.engines.base import Engine, KVCache
from runtime.engines.sessions import make_session
from runtime.metrics import available_memory_bytes


class FusedEngine(Engine):
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
    does (tests/test_fused_graph.py). A batched one-token step is padded too (and so runs row by row); a call with
    ``exact=False`` (a plan that does not promise lone-call kernels: the "throughput" policy, plain decoding) pads
    nothing.

    ``class_points``: call totals across which GroupQueryAttention rounds a token's scores otherwise (head dim > 128;
    runtime.engines.attention_classes measures them on this CPU). Calls are cut so that each token is scored at a
    total in the class of its position + ``min_call_tokens``, the total target-only decoding scores it at, whatever
    the call, batch or prefill.

    ``one_token_calls``: the exact form where the load-time check (runtime/engines/call_checks.py) found this CPU
    scoring a token otherwise in a verify call: every scored call then runs one token at a time, as target-only
    does. Both it and ``prefills_in_chunks`` are set once, when the bundle is opened (runtime/engines/loading.py).
    """

    prefills_in_chunks = True  # until the load-time check finds this CPU scoring a chunked prefill otherwise

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
        self.session_seconds = 0.0
        self.past_names = [f"past.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
        self.present_names = [n.replace("past", "present", 1) for n in self.past_names]
        # graphs since the feature draft: every call's final hidden states (cache.extra["hidden"]); a feature
        # draft's graph also takes the hidden state before each token
        outputs = {o.name: o for o in self.session.get_outputs()}
        self.has_hidden = "hidden" in outputs
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.takes_features = "features" in inputs
        self.feature_width = inputs["features"].shape[-1] if self.takes_features else 0
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
        makes the process grow, and rows join and prefill in place (``admit_rows``, ``prefill_rows``) and leave
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

    def admit_rows(self, cache: KVCache, chunks: list[list[int]]) -> tuple[KVCache, list[np.ndarray | None]]:
        """The new rows in ``cache``'s own buffers (``add_rows``), each prefilled in place (``prefill_rows``)."""
        grown = self.add_rows(cache, len(chunks))
        rows = list(range(cache.batch, cache.batch + len(chunks)))
        return grown, self.prefill_rows(grown, rows, chunks)

    def compute_rows(self, cache: KVCache, rows: list[int], chunks: list[list[int]]) -> list[np.ndarray | None]:
        """Each row's chunk after what it holds, in place, without the head, in the calls a lone request's prefill
        makes (the same kernels, cut at the same class points, so a prompt prefilled in chunks leaves the same
        cache), whatever else the batch holds: the final hidden states [n, H] per row (None: the graph returns
        none, or no tokens)."""
        return [self._prefill_row(cache, row, np.asarray(chunk, dtype=np.int64)) for row, chunk in zip(rows, chunks)]

    def _prefill_row(self, cache: KVCache, row: int, tokens: np.ndarray) -> np.ndarray | None:
        if not len(tokens):
            return None
        m = self.min_call_tokens
        self._reserve(cache, int(cache.lengths[row]) + len(tokens) + m - 1)
        _, hidden = self._row(cache, row, tokens, score=False, features=None, m=m)
        cache.lengths = cache.lengths.copy()
        cache.lengths[row] += len(tokens)
        cache.calls += 1
        return hidden

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
        """Append each row's valid tokens (right-padded in ``tokens``) and return logits [B, S, V]; with ``last``,
        [B, 1, V] at each row's last valid token only (a drafter reads nothing else: the head, and for a reduced
        one its expansion to the vocabulary, then cost one position, not a whole prompt's); with ``score`` False
        none (the head does not run). A feature draft also takes ``features`` [B, S, H] (the hidden state before
        each token). The final hidden states [B, S, H] are left in ``cache.extra["hidden"]`` where the graph
        returns them. ``exact=False`` pads no call: a batched one-token step is one batched call (one query row per
        head: other kernels than a lone row's, so its logits can differ from target-only's in the last bits)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        counts = tokens.shape[1] * np.ones(len(tokens), np.int64) if valid is None else valid.sum(axis=1)
        asked, m = tokens.shape[1], self.min_call_tokens if exact else 1
        last = last and score
        if self.takes_features:
            if features is None or features.shape[:2] != tokens.shape:
                raise ValueError("a feature draft engine takes features [B, S, H] with its tokens [B, S]")
            features = np.ascontiguousarray(features, dtype=np.float32)
        if self.one_token_calls and score and asked > 1:
            return self._one_token_at_a_time(cache, tokens, valid, features, last, exact)
        if asked < m:
            # a lone token, or each row's one token of a batched step, padded: the kernels target-only decoding
            # takes (a batched step then runs row by row: GroupQueryAttention takes one new token a row at batch > 1)
            tokens = np.pad(tokens, ((0, 0), (0, m - asked)))
            if features is not None:
                features = np.pad(features, ((0, 0), (0, m - asked), (0, 0)))
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
            logits, hidden = self._batched(cache, tokens, counts, score, features, last, m)
        if self.has_hidden:
            cache.extra["hidden"] = None if hidden is None else hidden[:, :asked]
        cache.lengths = cache.lengths + counts
        cache.calls += 1
        if not score:
            return None
        return logits if last else logits[:, :asked]

    def _batched(
        self,
        cache: KVCache,
        tokens: np.ndarray,
        counts: np.ndarray,
        score: bool,
        features: np.ndarray | None,
        last: bool,
        m: int,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Several new tokens on a past over a batch: one ragged call for the rows that can share it, a call of
        their own for the others (``_rows_alone``). Returns (logits, hidden states)."""
        batch, new = tokens.shape
        logits = np.zeros((batch, 1 if last else new if score else 0, self.vocab_size), np.float32)
        alone = self._rows_alone(cache, counts, m)
        hidden = self._ragged(cache, tokens, counts, alone, score, features, last, logits, m)
        widths = np.where(alone, counts + m - 1, 0)  # a cut's last call may pad
        self._reserve(cache, int((cache.lengths + widths).max()))  # each row its own chunk, not the widest
        for b in np.flatnonzero(alone):
            part, h = self._row(
                cache, b, tokens[b, : counts[b]], score, None if features is None else features[b, : counts[b]], m, last
            )
            logits[b, : len(part)] = part
            if h is not None:
                hidden = np.zeros((batch, new, h.shape[-1]), np.float32) if hidden is None else hidden
                hidden[b, : counts[b]] = h
        return logits, hidden

    def _rows_alone(self, cache: KVCache, counts: np.ndarray, m: int) -> np.ndarray:
        """Rows of a multi-token call over a batch that get calls of their own: every row with tokens where the graph
        takes no query lengths (the kernel's batch-1 path) or where the ragged call would not fit (the kernel wants
        room for the whole padded chunk after every row, idle ones too: only near the context), else only rows whose
        tokens a class point parts."""
        if not self.ragged:
            return counts > 0
        alone = np.array(
            [c > 0 and len(self._segments(int(n), int(c), m)) > 1 for n, c in zip(cache.lengths, counts)], dtype=bool
        )
        together = (counts > 0) & ~alone
        width = int(np.maximum(counts[together], m).max(initial=0))
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
        m: int,
    ) -> np.ndarray | None:
        """One call for every row with tokens that is not scored alone: row b takes max(counts[b], ``m``: the exact
        call's ``min_call_tokens``, else 1) query positions (padded like a lone call of its own, so each row gets the
        kernels that call would give it; tests/test_fused_graph.py checks it bit for bit) after its own past; the
        other rows take none and stay as they are. Fills ``logits`` rows; returns the hidden states [B, S, H] (None:
        none)."""
        together = (counts > 0) & ~alone
        if not together.any():
            return None
        queries = np.where(together, np.maximum(counts, m), 0)
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
        self._reserve(cache, int((cache.lengths + np.where(together, counts + m - 1, 0)).max()))
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
        self,
        cache: KVCache,
        b: int,
        tokens: np.ndarray,
        score: bool,
        features: np.ndarray | None,
        m: int,
        last: bool = False,
    ):
        """Row ``b``'s ``tokens`` [n] in calls cut where a class point parts them (``_segments``), each right-padded
        to ``m`` tokens: logits [n, V] (or [0, V]; [1, V] at the last token with ``last``) and hidden states [n, H]
        (None: the graph has none)."""
        start = int(cache.lengths[b])
        logits, hidden = [], []
        segments = self._segments(start, len(tokens), m)
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

    def _segments(self, start: int, count: int, m: int) -> list[tuple[int, int]]:
        """[a, z) ranges of ``count`` new tokens after ``start`` live ones such that every token's call total lies in
        the class target-only decoding scores it in (position + ``m``, the calls' least width;
        runtime.engines.attention_classes)."""
        if not len(self.class_points):
            return [(0, count)]
        classes = np.searchsorted(self.class_points, start + np.arange(count) + m)
        cuts = (np.flatnonzero(np.diff(classes)) + 1).tolist()
        return list(zip([0, *cuts], [*cuts, count]))

    def _one_token_at_a_time(
        self,
        cache: KVCache,
        tokens: np.ndarray,
        valid: np.ndarray | None,
        features: np.ndarray | None,
        last: bool,
        exact: bool,
    ) -> np.ndarray:
        """``compute`` as one call per column: the exact form where the load-time check (``call_shape_mismatch``)
        found a verify call scoring a token otherwise than target-only decoding, whose calls are one token wide."""
        counts = tokens.shape[1] * np.ones(len(tokens), np.int64) if valid is None else valid.sum(axis=1)
        logits, hidden = [], []
        for j in range(tokens.shape[1]):
            column = None if valid is None else valid[:, j : j + 1]
            feature = None if features is None else features[:, j : j + 1]
            logits.append(self.compute(cache, tokens[:, j : j + 1], column, exact=exact, features=feature))
            hidden.append(cache.extra.get("hidden"))
        out = np.concatenate(logits, axis=1)
        if self.has_hidden:
            cache.extra["hidden"] = np.concatenate(hidden, axis=1)
        return out[np.arange(len(out)), np.maximum(counts - 1, 0)][:, None] if last else out

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
        self.session_widest = max(self.session_widest, int(tokens.shape[1]))
        start = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.session_seconds += time.perf_counter() - start
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
