"""Stage 3 (fused): write a decoder straight to an ONNX graph of ONNX Runtime's fused CPU operators.

Longer than most modules: one graph writer, a short function per block (embedding, layer, attention, norms,
head, inputs and outputs), the names of the contract below and the check of what it wrote against torch, which
read those names; the GGUF blocks it writes are builder/gguf/, the quantizer builder/quantize.py.

The exported graph (builder.export) is torch's decoder op by op: ~86 nodes a layer, attention unfused, K/V expanded to
every query head and the whole cache concatenated on each call. This graph is what ONNX Runtime's own fast decoders
are made of, written by us from the weights::

    Gather(embedding) -> per layer:
        [Skip]SimplifiedLayerNormalization -> MatMul(qkv) -> GroupQueryAttention(rotary inside, cache in place)
        -> MatMul(o) -> SkipSimplifiedLayerNormalization -> MatMul(gate|up) -> Split -> SiLU * up -> MatMul(down)
    -> SkipSimplifiedLayerNormalization -> MatMul(head)

About 10 nodes a layer. Families differ only where builder.architectures says so (its Architecture fields) or their
config does: Qwen3 and Gemma 3 normalize each head of q and k (Split -> Reshape -> SimplifiedLayerNormalization ->
Reshape, into GroupQueryAttention's separate q/k/v inputs); Gemma 2/3 add a norm after attention and after the MLP,
scale the embedding and use GELU (tanh); rotary scaling (linear, llama3, yarn, longrope), partial rotary (Phi-3) and
per-layer-type bases (Gemma 3) are cos/sin tables GroupQueryAttention takes as inputs; sliding-window layers set its
local_window_size, Gemma 2's score softcap its softcap and query_pre_attn_scalar its scale. Semantics follow
transformers 5's modeling_<family>.py and are checked against it (check_fused_against_torch, through the runtime's
FusedEngine; tests/test_fused_graph.py).

The contract (runtime.engines.fused.FusedEngine relies on it)::

    inputs   input_ids             int64 [B, S]      S >= 1 new tokens
             seqlens_k             int32 [B]         live tokens of each row after this call, minus 1
             total_sequence_length int32 []          max over rows of live tokens after this call
             logits_to_keep        int64 [1]         the last positions to score (S; 0 for a prefill)
             query_lengths         int32 [B]         each row's tokens in this call (its first ones; the rest of its
                                                     S is padding, never written to the cache)
             past.{i}.key / past.{i}.value  float32 [B, H_kv, T, D]   a fixed-capacity buffer (T slots)
    outputs  logits                float32 [B, logits_to_keep, V]
             present.{i}.key / present.{i}.value   the same buffer, written in place (bound to the past buffer)
             hidden                float32 [B, S, H]  the final norm's output at every new position (what the head
                                                      reads): a feature draft's input, already computed
    a feature draft also takes
             features              float32 [B, S, H]  the hidden state before each token (x = [emb, features] @ fc)

GroupQueryAttention writes the new tokens' K/V at slots [len, len + S) of the buffer and attends to slots < len + S,
rotating by slot position. Rolling back is therefore only a shorter length: the next call overwrites the dead slots.
Its CPU kernel needs each row's tokens left-aligned in the buffer (padding at the end). Without ``query_lengths`` it
takes several new tokens on a past only at batch 1; with it (its ``query_seqlens`` input, onnxruntime 1.32:
onnxruntime/contrib_ops/cpu/bert/group_query_attention.cc and the operator's schema) a call over a batch takes each
row's own number of new tokens after its own past, so one call verifies every row's draft (a ragged batch).

Linear layers come as float weights (quantized afterwards by builder.quantize, ONNX Runtime's MatMulNBits
quantizer) or as blocks already quantized in a GGUF file (builder.gguf.weights), written as MatMulNBits as they are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from builder.decoder import BlockQuant, Decoder, GgufBlocks, Layer, Linear, RotaryTable

from runtime.engines import gguf_ops

MS = "com.microsoft"


# --- the contract's names -------------------------------------------------------------------------------------------
# Here, beside the writer, not in builder.decoder: they name this graph's inputs and outputs (the contract above), which
# the writer and the GraphInfo it reports share; a Decoder is the model's data and knows no graph.


def cache_names(num_layers: int, prefix: str) -> list[str]:
    return [f"{prefix}.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


def input_names(num_layers: int, features: bool = False) -> tuple[str, ...]:
    return (
        "input_ids",
        "seqlens_k",
        "total_sequence_length",
        "logits_to_keep",
        "query_lengths",
        *cache_names(num_layers, "past"),
        *(("features",) if features else ()),
    )


def output_names(num_layers: int) -> tuple[str, ...]:
    return ("logits", *cache_names(num_layers, "present"), "hidden")


def rope_keys(layers) -> set[str | None]:
    """The rotary tables the layers use (without making lazy ones: LazyLayers knows each layer's key)."""
    ropes = getattr(layers, "ropes", None)
    return set(ropes) if ropes is not None else {layer.rope for layer in layers}


# --- the graph ------------------------------------------------------------------------------------------------------

EXTERNAL_FROM_BYTES = 1024  # an initializer this large is written to the external-data file as it is made
ALIGN_FROM_BYTES, ALIGNMENT = 1 << 16, 4096  # large ones start on a page (ONNX Runtime can map them)
# a graph with less external data is folded back into one file (small bundles keep one-file engines); folding reads
# the data back and writes it again (~3x its size at once: a 380 MB draft engine added 1.4 GB to a build's peak)
INLINE_UP_TO_BYTES = 128 << 20
CHUNK_BYTES = 64 << 20  # a view (not contiguous) is copied this much at a time as it is written


class _Graph:
    """Collects nodes and initializers with unique names. With ``data`` (an open file), every initializer of
    EXTERNAL_FROM_BYTES or more goes to it as soon as it is made and only its location stays in memory: a graph is
    written with one weight at a time held, not the whole model as TensorProtos (and protobuf's copies of them when
    the graph and the model are assembled: three fp32 copies of every weight before, 7.6 GB for a 0.5B model)."""

    def __init__(self, data=None, location: str = ""):
        self.nodes, self.inits, self.count = [], [], 0
        self.accuracy_level = 4
        self.data, self.location = data, location
        self._written: dict[int, tuple[np.ndarray, str]] = {}  # id -> (the array, its name): one array, one copy

    def const(self, name: str, array: np.ndarray) -> str:
        """``array`` as an initializer; a large one may be a view in any order (a transposed head): it is written
        in row chunks, never copied whole. An array written before (a tied embedding and head reading the same
        GGUF blocks) is not written again: its first name is returned."""
        from onnx import numpy_helper

        if id(array) in self._written and self._written[id(array)][0] is array:
            return self._written[id(array)][1]
        if array.nbytes >= EXTERNAL_FROM_BYTES:
            self._written[id(array)] = (array, name)

        if self.data is None or array.nbytes < EXTERNAL_FROM_BYTES:
            self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        else:
            self.inits.append(self._external(name, array))
        return name

    def _external(self, name: str, array: np.ndarray):
        """A TensorProto naming where ``array``'s bytes were written (little-endian, as ONNX stores them)."""
        from onnx import TensorProto, helper

        offset = self.data.tell()
        if array.nbytes >= ALIGN_FROM_BYTES and offset % ALIGNMENT:
            self.data.write(bytes(ALIGNMENT - offset % ALIGNMENT))
            offset = self.data.tell()
        rows = max(1, CHUNK_BYTES // max(array[:1].nbytes, 1)) if array.ndim else 1
        for start in range(0, max(len(array), 1) if array.ndim else 1, rows):
            part = array[start : start + rows] if array.ndim else array
            np.ascontiguousarray(part).astype(array.dtype.newbyteorder("<"), copy=False).tofile(self.data)
        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor.dims.extend(array.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", offset), ("length", array.nbytes)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        return tensor

    def op(
        self, kind: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", name: str = "", **attrs
    ) -> list[str]:
        from onnx import helper

        self.count += 1
        base = name or f"{kind}_{self.count}"
        outs = outputs if isinstance(outputs, list) else [f"{base}/out{j}" for j in range(outputs)]
        self.nodes.append(helper.make_node(kind, inputs, outs, name=base, domain=domain, **attrs))
        return outs


def build(decoder: Decoder, path: Path, accuracy_level: int = 4) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Write the fused graph of ``decoder`` to ``path``, its weights streamed to ``path`` + ".data" as each is made
    (folded back into one file where they come to less than INLINE_UP_TO_BYTES); returns (input names, output
    names).

    ``accuracy_level``: MatMulNBits' compute type for pre-quantized weights (4: int8 activations, the fast CPU path,
    which is also how llama.cpp computes its Q4/Q8 dot products; 0: fp32 activations, exact to the file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data_path = path.with_name(path.name + ".data")
    with open(data_path, "wb") as data:
        names = _write(decoder, path, accuracy_level, _Graph(data, data_path.name))
    if data_path.stat().st_size <= INLINE_UP_TO_BYTES:
        _fold_external_data(path, data_path)
    return names


def _fold_external_data(path: Path, data_path: Path) -> None:
    """``path`` as one file: its external data read back into the graph (a small graph stays one file, as before)."""
    import onnx

    model = onnx.load(str(path))  # reads the external data into each tensor
    onnx.save_model(model, str(path))
    data_path.unlink()


def _write(decoder: Decoder, path: Path, accuracy_level: int, g: "_Graph") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The fused decoder into ``g`` and then ``path``: embedding, every layer, the head, then the graph's inputs and
    outputs."""
    g.accuracy_level = accuracy_level
    rotary = _rotary_inputs(g, decoder)
    residual, pending = _embed(g, decoder), None  # pending: the block output still to be added to the residual stream
    for i, layer in enumerate(decoder.layers):
        residual, pending = _layer(g, i, layer, decoder, rotary, residual, pending)
    normed, _ = _norm(g, "final_norm", decoder.final_norm, residual, pending, decoder.eps, out="hidden")
    _head(g, decoder, normed)
    return _save_graph(g, decoder, path)


def _embed(g: "_Graph", decoder: Decoder) -> str:
    """The input embedding (the file's blocks or float rows), scaled, with a feature draft's features fused in."""
    if decoder.embedding_gguf is not None:
        x = _gguf_gather(g, "embedding", decoder.embedding_gguf)
    elif decoder.embedding_quant is not None:
        x = _gathered_blocks(g, "embedding", decoder.embedding_quant)
    else:
        g.const("embedding", np.asarray(decoder.embedding, np.float32))  # no copy of a float32 array
        (x,) = g.op("Gather", ["embedding", "input_ids"], name="embed")
    if decoder.embed_scale != 1.0:  # float32 like transformers' embed_scale buffer
        (x,) = g.op("Mul", [x, g.const("embed_scale", np.array(decoder.embed_scale, np.float32))], name="embed_scale")
    if decoder.feature_fc is not None:
        (both,) = g.op("Concat", [x, "features"], name="embed_features", axis=-1)
        if isinstance(decoder.feature_fc, Linear):  # on the kernel: blocks (builder.gguf.float_draft.on_kernel)
            x = _linear(g, "fc", both, decoder.feature_fc)
        else:
            (x,) = g.op("MatMul", [both, g.const("feature_fc", decoder.feature_fc.astype(np.float32))], name="fc")
    return x


def _layer(g: "_Graph", i: int, layer, decoder: Decoder, rotary, residual: str, pending: str | None) -> tuple[str, str]:
    """Layer ``i``: attention then the gated MLP, each added to the residual stream by the next norm; returns the
    residual stream and the MLP's output still to be added."""
    normed, residual = _norm(g, f"layers.{i}.attn_norm", layer.attn_norm, residual, pending, decoder.eps)
    qkv = _linear(g, f"layers.{i}.qkv", normed, layer.qkv)
    if layer.q_norm is not None:
        qkv = _qk_norm(g, f"layers.{i}", qkv, layer, decoder)
    pending = _scaled(
        g, _linear(g, f"layers.{i}.o", _attention(g, i, qkv, layer, decoder, rotary), layer.o), decoder.residual_scale
    )
    if layer.post_attn_norm is not None:
        pending = _plain_norm(g, f"layers.{i}.post_attn_norm", layer.post_attn_norm, pending, decoder.eps)
    normed, residual = _norm(g, f"layers.{i}.mlp_norm", layer.mlp_norm, residual, pending, decoder.eps)
    gate_up = _linear(g, f"layers.{i}.gate_up", normed, layer.gate_up)
    gate, up = g.op(
        "Split",
        [gate_up, g.const(f"layers.{i}.split", np.array([decoder.intermediate] * 2))],
        2,
        name=f"layers.{i}.split",
        axis=-1,
    )
    pending = _scaled(
        g, _linear(g, f"layers.{i}.down", _gated(g, decoder.activation, gate, up), layer.down), decoder.residual_scale
    )
    if layer.post_mlp_norm is not None:
        pending = _plain_norm(g, f"layers.{i}.post_mlp_norm", layer.post_mlp_norm, pending, decoder.eps)
    return residual, pending


def _head(g: "_Graph", decoder: Decoder, normed: str) -> None:
    """The logits of the last logits_to_keep positions (0 in a prefill whose logits nobody reads), softcapped or
    divided where the model does."""
    (new,) = g.op("Shape", ["input_ids"], start=1, end=2)
    (start,) = g.op("Sub", [new, "logits_to_keep"])
    (kept,) = g.op(
        "Slice",
        [normed, start, g.const("int64_max", np.array([2**62], np.int64)), g.const("axis_1", np.array([1], np.int64))],
    )
    if decoder.final_softcap:  # Gemma: softcap * tanh(logits / softcap)
        cap = g.const("final_softcap", np.array(decoder.final_softcap, np.float32))
        (y,) = g.op("Div", [_linear(g, "head", kept, decoder.head), cap])
        (y,) = g.op("Tanh", [y])
        g.op("Mul", [y, cap], ["logits"], name="final_softcap")
    elif decoder.logit_divisor != 1.0:
        divisor = g.const("logit_divisor", np.array(decoder.logit_divisor, np.float32))
        g.op("Div", [_linear(g, "head", kept, decoder.head), divisor], ["logits"], name="logit_divisor")
    else:
        _linear(g, "head", kept, decoder.head, out="logits")


def _save_graph(g: "_Graph", decoder: Decoder, path: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The graph's inputs and outputs around ``g``'s nodes, saved to ``path``; returns the input and output names."""
    import onnx
    from onnx import TensorProto, helper

    layers = len(decoder.layers)
    dyn = ["batch", "slots"]
    kv_shape = [dyn[0], decoder.kv_heads, dyn[1], decoder.head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "new"]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, [1]),
        helper.make_tensor_value_info("query_lengths", TensorProto.INT32, ["batch"]),
    ]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in cache_names(layers, "past")]
    features = decoder.feature_fc is not None
    if features:
        inputs.append(helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", "new", decoder.hidden]))
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "kept", decoder.vocab])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in cache_names(layers, "present")]
    outputs.append(helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "new", decoder.hidden]))
    graph = helper.make_graph(g.nodes, "draftsmith_fused_decoder", inputs, outputs, g.inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)]
    if any(node.domain == gguf_ops.DOMAIN for node in g.nodes):
        opsets.append(helper.make_opsetid(gguf_ops.DOMAIN, 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="draftsmith")
    model.ir_version = 9
    del graph, g.inits[:]  # the model holds its own copies of the (small) protos
    onnx.save_model(model, str(path))  # every large tensor is already in the data file
    return input_names(layers, features), output_names(layers)


def _rotary_tables(head_dim: int, theta: float, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position x frequency [positions, head_dim / 2], computed in float64 then rounded once."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rotary_inputs(g: _Graph, decoder: Decoder) -> dict[str, tuple[str, str]]:
    """{table key: (cos name, sin name)} for the layers' GroupQueryAttention nodes. A longrope table with a long
    form is both stacked in one constant, [short; long], of which each call slices the rows of its own factor set
    (total_sequence_length > switch: long), rows [0, total) only: a copy proportional to the call's context."""
    tables = decoder.rotary or {
        "default": RotaryTable(*_rotary_tables(decoder.head_dim, decoder.rope_theta, decoder.max_positions))
    }
    names, used = {}, rope_keys(decoder.layers)
    for key, table in tables.items():
        if key not in used:  # a truncated draft may keep only sliding layers
            continue
        cos, sin = f"cos_cache.{key}", f"sin_cache.{key}"
        if table.long is None:
            names[key] = (g.const(cos, table.cos), g.const(sin, table.sin))
            continue
        rows = table.cos.shape[0]
        (past,) = g.op(
            "Greater", ["total_sequence_length", g.const(f"rope_switch.{key}", np.array(table.switch, np.int32))]
        )
        (start,) = g.op("Mul", [g.op("Cast", [past], to=7)[0], g.const(f"rope_rows.{key}", np.array(rows, np.int64))])
        (start,) = g.op("Reshape", [start, g.const(f"rope_one.{key}", np.array([1], np.int64))])
        (total,) = g.op("Cast", ["total_sequence_length"], to=7)
        (end,) = g.op("Add", [start, total])
        zero = g.const(f"rope_axis.{key}", np.array([0], np.int64))
        names[key] = tuple(
            g.op("Slice", [g.const(n + ".stacked", np.concatenate([short, long])), start, end, zero], name=n)[0]
            for n, short, long in ((cos, table.cos, table.long.cos), (sin, table.sin, table.long.sin))
        )
    return names


def _attention(g: _Graph, i: int, qkv, layer: Layer, decoder: Decoder, rotary: dict) -> str:
    """GroupQueryAttention over the packed q|k|v (or the three parts), rotary inside, cache in place.

    local_window_size is transformers' sliding_window as it is: with it onnxruntime 1.32's CPU kernel masks exactly
    as transformers' sliding_window_overlay (kv > q - window); window - 1 and window + 1 both disagree with torch
    (tested on tiny models whose window is shorter than the checked sequence)."""
    window = decoder.sliding_window if layer.window is None else layer.window
    parts = [qkv, "", ""] if isinstance(qkv, str) else list(qkv)
    cos, sin = rotary[layer.rope] if layer.rope is not None else ("", "")
    attrs = {"scale": decoder.attn_scale} if decoder.attn_scale is not None else {}
    if own_attention(layer, decoder):
        g.op(
            gguf_ops.ATTENTION,
            [qkv, f"past.{i}.key", f"past.{i}.value", "seqlens_k", "total_sequence_length", cos, sin, "query_lengths"],
            ["attn_" + str(i), f"present.{i}.key", f"present.{i}.value"],
            domain=gguf_ops.DOMAIN,
            name=f"layers.{i}.attention",
            num_heads=decoder.heads,
            kv_num_heads=decoder.kv_heads,
            do_rotary=int(layer.rope is not None),
            local_window_size=window if window else -1,
            **attrs,
        )
        return "attn_" + str(i)
    if decoder.attn_softcap:
        attrs["softcap"] = decoder.attn_softcap
    g.op(
        "GroupQueryAttention",
        [
            *parts,
            f"past.{i}.key",
            f"past.{i}.value",
            "seqlens_k",
            "total_sequence_length",
            cos,
            sin,
            *[""] * 7,
            "query_lengths",
        ],
        ["attn_" + str(i), f"present.{i}.key", f"present.{i}.value"],
        domain=MS,
        name=f"layers.{i}.attention",
        num_heads=decoder.heads,
        kv_num_heads=decoder.kv_heads,
        do_rotary=int(layer.rope is not None),
        rotary_interleaved=0,
        local_window_size=window if window else -1,
        **attrs,
    )
    return "attn_" + str(i)


def own_attention(layer: Layer, decoder: Decoder) -> bool:
    """Whether a layer's attention is Draftsmith's CausalAttention rather than GroupQueryAttention: where its q|k|v
    is one GgufMatMul (the graph needs the library anyway) and it has no score softcap (Gemma 2). Every operator of
    such a layer then scores a token the same way in any call, so its engine needs no padding to be exact
    (runtime.engines.fused.FusedEngine, min_call_tokens)."""
    return layer.qkv.gguf is not None and not decoder.attn_softcap and layer.q_norm is None and layer.k_norm is None


def _qk_norm(g: _Graph, name: str, qkv: str, layer: Layer, decoder: Decoder) -> tuple[str, str, str]:
    """Per-head RMSNorm of q and of k: SimplifiedLayerNormalization over the last axis of [B, S, heads, D]; returns
    (q, k, v) for GroupQueryAttention's separate inputs (no Concat back into one packed tensor)."""
    d, h, kv = decoder.head_dim, decoder.heads, decoder.kv_heads
    q, k, v = g.op(
        "Split",
        [qkv, g.const(name + ".qkv_split", np.array([h * d, kv * d, kv * d]))],
        3,
        name=name + ".qkv_split",
        axis=-1,
    )
    per_head = layer.q_norm.shape[0] == d
    if per_head:
        heads = g.const(name + ".heads_shape", np.array([0, 0, -1, d], np.int64))
        flat = g.const(name + ".flat_shape", np.array([0, 0, -1], np.int64))
    out = []
    for part, weight, kind in ((q, layer.q_norm, "q_norm"), (k, layer.k_norm, "k_norm")):
        x = g.op("Reshape", [part, heads])[0] if per_head else part
        (x,) = g.op(
            "SimplifiedLayerNormalization",
            [x, g.const(f"{name}.{kind}.weight", weight.astype(np.float32))],
            name=f"{name}.{kind}",
            axis=-1,
            epsilon=decoder.eps,
            stash_type=1,
        )
        out.append(g.op("Reshape", [x, flat])[0] if per_head else x)
    return out[0], out[1], v


def _gated(g: _Graph, activation: str, gate: str, up: str) -> str:
    """act(gate) * up: SiLU as x * sigmoid(x); GELU's tanh form (gelu_pytorch_tanh) as ONNX Runtime's FastGelu."""
    if activation == "gelu_tanh":
        (act,) = g.op("FastGelu", [gate], domain=MS)
    else:
        (sig,) = g.op("Sigmoid", [gate])
        (act,) = g.op("Mul", [gate, sig])
    (out,) = g.op("Mul", [act, up])
    return out


def _scaled(g: _Graph, x: str, scale: float) -> str:
    if scale == 1.0:
        return x
    (y,) = g.op("Mul", [x, g.const(f"scale_{g.count}", np.array(scale, np.float32))])
    return y


def _plain_norm(g: _Graph, name: str, weight: np.ndarray, x: str, eps: float) -> str:
    (y,) = g.op(
        "SimplifiedLayerNormalization",
        [x, g.const(name + ".weight", weight.astype(np.float32))],
        name=name,
        axis=-1,
        epsilon=eps,
        stash_type=1,
    )
    return y


def _norm(
    g: _Graph, name: str, weight: np.ndarray | None, residual: str, pending: str | None, eps: float, out: str = ""
):
    """RMSNorm of residual (+ pending, added into the residual stream first); returns (normed, new residual).
    Without a weight (a block that reads the stream unnormalized) only the addition: (new residual, itself)."""
    if weight is None:
        if pending is None:
            return residual, residual
        (total,) = g.op("Add", [pending, residual], name=name + "/sum")
        return total, total
    gamma = g.const(name + ".weight", weight.astype(np.float32))
    normed = out or name + "/normed"
    if pending is None:
        g.op("SimplifiedLayerNormalization", [residual, gamma], [normed], name=name, axis=-1, epsilon=eps, stash_type=1)
        return normed, residual
    total = name + "/sum"
    g.op(
        "SkipSimplifiedLayerNormalization",
        [pending, residual, gamma],
        [normed, "", "", total],
        domain=MS,
        name=name,
        epsilon=eps,
    )
    return normed, total


def _linear(g: _Graph, name: str, x: str, linear: Linear, out: str | None = None) -> str:
    """x @ W (+ offsets correction) (+ bias) as MatMul, MatMulNBits or GgufMatMul (a GGUF file's own blocks)."""
    outs = [out] if out and linear.bias is None and (linear.quant is None or linear.quant.offsets is None) else 1
    if linear.gguf is not None:
        (y,) = _gguf_matmul(g, name, x, linear.gguf, outs)
    elif linear.quant is None:
        (y,) = g.op("MatMul", [x, g.const(name + ".weight", np.asarray(linear.weight, np.float32))], outs, name=name)
    else:
        q = linear.quant
        inputs = [x, g.const(name + ".qweight", q.packed), g.const(name + ".scales", q.scales.astype(np.float32))]
        if q.zero_points is not None:
            inputs.append(g.const(name + ".zero_points", q.zero_points))
        (y,) = g.op(
            "MatMulNBits",
            inputs,
            outs,
            domain=MS,
            name=name,
            K=q.k,
            N=q.n,
            bits=q.bits,
            block_size=q.block,
            accuracy_level=g.accuracy_level,
        )
        if q.offsets is not None:
            y = _block_offsets(g, name, x, q, y, out if linear.bias is None else None)
    if linear.bias is not None:
        (y,) = g.op("Add", [y, g.const(name + ".bias", linear.bias.astype(np.float32))], [out] if out else 1)
    return y


def _gguf_matmul(g: _Graph, name: str, x: str, blocks: GgufBlocks, outs) -> list[str]:
    """Draftsmith's GgufMatMul over the file's blocks, one uint8 initializer a part (runtime.engines.gguf_ops)."""
    weights = [g.const(f"{name}.gguf{i}", data) for i, (_, data) in enumerate(blocks.parts)]
    return g.op(
        gguf_ops.OP,
        [x, *weights],
        outs,
        domain=gguf_ops.DOMAIN,
        name=name,
        K=blocks.k,
        types=[gguf_ops.GGML_TYPE_IDS[kind] for kind, _ in blocks.parts],
        rows=[len(data) for _, data in blocks.parts],
        layout=blocks.layout,
    )


def _gguf_gather(g: _Graph, name: str, blocks: GgufBlocks) -> str:
    """The rows ``input_ids`` picks from a table in the file's own bytes (GgufGather); a tied head's blocks are the
    same initializer as the head's GgufMatMul reads (``_Graph.const`` writes one array once)."""
    ((kind, data),) = blocks.parts
    (x,) = g.op(
        gguf_ops.GATHER,
        [g.const(name + ".gguf", data), "input_ids"],
        domain=gguf_ops.DOMAIN,
        name=name,
        K=blocks.k,
        type=gguf_ops.GGML_TYPE_IDS[kind],
        layout=blocks.layout,
    )
    return x


def _gathered_blocks(g: _Graph, name: str, q: BlockQuant) -> str:
    """The rows ``input_ids`` picks from a table kept in blocks (a GGUF file's token_embd): GatherBlockQuantized
    (onnxruntime contrib op: (q - zero point) * scale per block along the row), then each block's offset added
    (K-quants' -dmin*min; Q4_1's m). The table stays 4 or 8 bits a value: for a 151,936 x 1536 Q4_K embedding
    175 MB instead of 933 MB in float32."""
    data = q.packed.reshape(q.n, -1)  # [V, K * bits / 8], MatMulNBits' layout flattened: the same row order
    zero = _gather_zero_points(q)
    (x,) = g.op(
        "GatherBlockQuantized",
        [
            g.const(name + ".qweight", data),
            "input_ids",
            g.const(name + ".scales", q.scales.astype(np.float32)),
            g.const(name + ".zero_points", zero),
        ],
        domain=MS,
        name=name,
        gather_axis=0,
        quantize_axis=1,
        block_size=q.block,
        bits=q.bits,
    )
    if q.offsets is None:
        return x
    width = q.k // q.offsets.shape[1]
    (off,) = g.op("Gather", [g.const(name + ".offsets", q.offsets.astype(np.float32)), "input_ids"])
    (off,) = g.op("Unsqueeze", [off, g.const(name + ".last_axis", np.array([-1], np.int64))])
    (blocks,) = g.op("Reshape", [x, g.const(name + ".block_shape", np.array([0, 0, -1, width], np.int64))])
    (summed,) = g.op("Add", [blocks, off])
    (x,) = g.op("Reshape", [summed, g.const(name + ".row_shape", np.array([0, 0, q.k], np.int64))])
    return x


def _gather_zero_points(q: BlockQuant) -> np.ndarray:
    """GatherBlockQuantized's zero points, always given: 8-bit values are stored around 128 (builder.gguf.weights'
    packing), 4-bit ones around their own zero points (8 where the packing left them out), two a byte."""
    blocks = q.k // q.block
    if q.bits == 8:
        return np.full((q.n, blocks), 128, np.uint8)
    if q.zero_points is not None:
        return q.zero_points
    return np.full((q.n, (blocks + 1) // 2), 0x88, np.uint8)


def _block_offsets(g: _Graph, name: str, x: str, q: BlockQuant, y: str, out: str | None) -> str:
    """y + blocksum(x) @ offsets^T: the per-block additive term of GGUF Q4_1 (w = d*q + m), exact in fp32. Offsets
    may span wider blocks than the weights (gguf_weights.split)."""
    blocks = q.offsets.shape[1]
    shape = g.const(name + ".block_shape", np.array([0, 0, blocks, q.k // blocks], dtype=np.int64))
    (blocks,) = g.op("Reshape", [x, shape])
    (sums,) = g.op("ReduceSum", [blocks, g.const(name + ".axis", np.array([-1], dtype=np.int64))], keepdims=0)
    (corr,) = g.op("MatMul", [sums, g.const(name + ".offsets", np.ascontiguousarray(q.offsets.T, np.float32))])
    (total,) = g.op("Add", [y, corr], [out] if out else 1)
    return total


# --- the check against torch ----------------------------------------------------------------------------------------


def info_of(decoder: Decoder):
    from builder.export import GraphInfo

    layers = len(decoder.layers)
    return GraphInfo(
        num_layers=layers,
        num_kv_heads=decoder.kv_heads,
        head_dim=decoder.head_dim,
        vocab_size=decoder.vocab,
        input_names=input_names(layers, decoder.feature_fc is not None),
        output_names=output_names(layers),
        graph="fused",
        notes=tuple(decoder.notes),
    )


def check_fused_against_torch(model, path: Path, info, tolerance: float, seed: int = 0) -> dict:
    """The fused engine (through the runtime's own FusedEngine) against torch, on what decoding does with it:
    a prefill, a verify pass of 7 tokens after a prefill without logits and 3 junk tokens rolled back, a right-padded
    batch prefill, then a batched one-token step and a batched 3-token verify (which runs row by row). Raises
    ExportError past ``tolerance`` (builder.export.compare_cases)."""
    import torch
    from builder.export import compare_cases
    from runtime.engines.onnx import new_engine

    engine = new_engine("fused", path, info, 64, initial_slots=8)  # 8: the buffer grows too
    rng = np.random.default_rng(seed)
    vocab = min(info.vocab_size, int(model.config.vocab_size))
    seq = rng.integers(0, vocab, (2, 16))
    with torch.no_grad():
        reference = model(torch.from_numpy(seq)).logits.numpy()
    prefill = engine.forward(engine.new_cache(1), seq[:1, :5])
    cache = engine.new_cache(1)
    engine.prefill(cache, seq[:1, :5])  # no logits: the output head is skipped, the cache must be the same
    engine.forward(cache, rng.integers(0, vocab, (1, 3)))
    engine.rollback(cache, np.array([5]))
    verify = engine.forward(cache, seq[:1, 5:12])
    lengths = np.array([7, 12])
    batch = engine.new_cache(2)
    valid = (np.arange(12)[None, :] < lengths[:, None]).astype(np.int64)
    padded = engine.forward(batch, seq[:, :12] * valid, valid)
    step = engine.forward(batch, np.stack([seq[0, 7:8], seq[1, 12:13]]))
    wide = engine.forward(batch, np.stack([seq[0, 8:11], seq[1, 13:16]]))
    cases = {
        "prefill": (prefill[0], reference[0, :5]),
        "verify_after_rollback": (verify[0], reference[0, 5:12]),
        "right_padded_batch": (padded[0, :7], reference[0, :7]),
        "batch_row_2": (padded[1], reference[1, :12]),
        "batched_step": (step[:, 0], np.stack([reference[0, 7], reference[1, 12]])),
        "batched_verify": (wide.reshape(-1, wide.shape[-1]), np.concatenate([reference[0, 8:11], reference[1, 13:16]])),
    }
    return compare_cases(cases, tolerance, vocab)
