"""Stage 3 (fused): write a decoder straight to an ONNX graph of ONNX Runtime's fused CPU operators.

The exported graph (builder.export) is torch's decoder op by op: ~86 nodes a layer, attention unfused, K/V expanded to
every query head and the whole cache concatenated on each call. This graph is what ONNX Runtime's own fast decoders
are made of, written by us from the weights::

    Gather(embedding) -> per layer:
        [Skip]SimplifiedLayerNormalization -> MatMul(qkv) -> GroupQueryAttention(rotary inside, cache in place)
        -> MatMul(o) -> SkipSimplifiedLayerNormalization -> MatMul(gate|up) -> Split -> SiLU * up -> MatMul(down)
    -> SkipSimplifiedLayerNormalization -> MatMul(head)

About 10 nodes a layer. The contract (runtime.engine.FusedEngine relies on it)::

    inputs   input_ids             int64 [B, S]      S >= 1 new tokens
             seqlens_k             int32 [B]         live tokens of each row after this call, minus 1
             total_sequence_length int32 []          max over rows of live tokens after this call
             logits_to_keep        int64 [1]         the last positions to score (S; 0 for a prefill)
             past.{i}.key / past.{i}.value  float32 [B, H_kv, T, D]   a fixed-capacity buffer (T slots)
    outputs  logits                float32 [B, logits_to_keep, V]
             present.{i}.key / present.{i}.value   the same buffer, written in place (bound to the past buffer)
             hidden                float32 [B, S, H]  the final norm's output at every new position (what the head
                                                      reads): a feature draft's input, already computed
    a feature draft also takes
             features              float32 [B, S, H]  the hidden state before each token (x = [emb, features] @ fc)

GroupQueryAttention writes the new tokens' K/V at slots [len, len + S) of the buffer and attends to slots < len + S,
rotating by slot position. Rolling back is therefore only a shorter length: the next call overwrites the dead slots.
Its CPU kernel takes several new tokens on a past only at batch 1 and needs each row's tokens left-aligned in the
buffer (padding at the end); the runtime keeps both (shared/FACTS.md).

Linear layers come as float weights (quantized afterwards by builder.quantize, ONNX Runtime's MatMulNBits
quantizer) or as blocks already quantized in a GGUF file (builder.gguf_weights), written as MatMulNBits as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MS = "com.microsoft"


class GraphError(ValueError):
    """The model has a feature the fused graph does not cover; the message says which (use --graph export)."""


@dataclass(frozen=True)
class BlockQuant:
    """A weight already quantized in blocks along K, ready for MatMulNBits.

    Shapes (N outputs, K inputs, block b): ``packed`` uint8 [N, K/b, b*bits/8] (two 4-bit values a byte, low nibble
    first); ``scales`` float32 [N, K/b]; ``zero_points`` uint8 packed like ONNX Runtime's quantizer writes them, or
    None; ``offsets`` float32 [N, K/b'] or None, b' a multiple of b: a per-block additive term (GGUF Q4_1's m), so
    that w[n, k] = scale * (q - zero_point) + offset, applied as blocksum(x) @ offsets^T.
    """

    bits: int
    block: int
    k: int
    n: int
    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None = None
    offsets: np.ndarray | None = None


@dataclass
class Linear:
    """y = x @ weight + bias. ``weight`` float32 [K, N], or ``quant`` for pre-quantized blocks."""

    weight: np.ndarray | None = None
    quant: BlockQuant | None = None
    bias: np.ndarray | None = None


@dataclass
class Layer:
    attn_norm: np.ndarray
    qkv: Linear  # q, k and v projections side by side: N = (H + 2 H_kv) * D
    o: Linear
    mlp_norm: np.ndarray
    gate_up: Linear  # gate and up projections side by side: N = 2 * I
    down: Linear


@dataclass
class Decoder:
    """Everything the graph needs: shapes, rotary settings and weights."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    rope_theta: float
    max_positions: int
    embedding: np.ndarray  # float32 [V_in, H]
    layers: list[Layer]
    final_norm: np.ndarray
    head: Linear  # N = vocab (may be a reduced draft head)
    sliding_window: int = 0
    notes: list[str] = field(default_factory=list)
    # a feature draft (builder/distill/feature_draft.py): x = [embedding(token), features] @ feature_fc, float32
    # [2H, H], where features are the target's final hidden states (its ``hidden`` output) or the draft's own
    feature_fc: np.ndarray | None = None


def cache_names(num_layers: int, prefix: str) -> list[str]:
    return [f"{prefix}.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


def input_names(num_layers: int, features: bool = False) -> tuple[str, ...]:
    return ("input_ids", "seqlens_k", "total_sequence_length", "logits_to_keep", *cache_names(num_layers, "past"),
            *(("features",) if features else ()))


def output_names(num_layers: int) -> tuple[str, ...]:
    return ("logits", *cache_names(num_layers, "present"), "hidden")


# --- from a transformers model --------------------------------------------------------------------------------------

def from_transformers(model) -> Decoder:
    """The weights of a Llama-family transformers model (Llama, SmolLM2, Mistral, Qwen2) as a Decoder."""
    config = model.config
    _check_rope(config)
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv_bias = [state.get(p + f"self_attn.{x}_proj.bias") for x in "qkv"]
        layers.append(Layer(
            attn_norm=state[p + "input_layernorm.weight"],
            qkv=Linear(np.concatenate([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).T,
                       bias=np.concatenate(qkv_bias) if all(b is not None for b in qkv_bias) else None),
            o=Linear(state[p + "self_attn.o_proj.weight"].T),
            mlp_norm=state[p + "post_attention_layernorm.weight"],
            gate_up=Linear(np.concatenate([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]).T),
            down=Linear(state[p + "mlp.down_proj.weight"].T)))
    embedding = state["model.embed_tokens.weight"]
    head = state.get("lm_head.weight", embedding)
    return Decoder(hidden=config.hidden_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   intermediate=config.intermediate_size, vocab=head.shape[0], eps=float(config.rms_norm_eps),
                   rope_theta=float(_rope_theta(config)), max_positions=int(config.max_position_embeddings),
                   embedding=embedding, layers=layers, final_norm=state["model.norm.weight"],
                   head=Linear(np.ascontiguousarray(head.T)),
                   sliding_window=int(getattr(config, "sliding_window", 0) or 0)
                   if getattr(config, "use_sliding_window", True) else 0)


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0


def _check_rope(config) -> None:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise GraphError(f"rotary scaling {kind!r} is not in the fused graph; build with --graph export")


# --- the graph ------------------------------------------------------------------------------------------------------

class _Graph:
    """Collects nodes and initializers with unique names."""

    def __init__(self):
        self.nodes, self.inits, self.count = [], [], 0
        self.accuracy_level = 4

    def const(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, kind: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", name: str = "",
           **attrs) -> list[str]:
        from onnx import helper
        self.count += 1
        base = name or f"{kind}_{self.count}"
        outs = outputs if isinstance(outputs, list) else [f"{base}/out{j}" for j in range(outputs)]
        self.nodes.append(helper.make_node(kind, inputs, outs, name=base, domain=domain, **attrs))
        return outs


def build(decoder: Decoder, path: Path, accuracy_level: int = 4) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Write the fused graph of ``decoder`` to ``path`` (one file); returns (input names, output names).

    ``accuracy_level``: MatMulNBits' compute type for pre-quantized weights (4: int8 activations, the fast CPU path,
    which is also how llama.cpp computes its Q4/Q8 dot products; 0: fp32 activations, exact to the file)."""
    import onnx
    from onnx import TensorProto, helper
    g = _Graph()
    g.accuracy_level = accuracy_level
    layers = len(decoder.layers)
    cos, sin = _rotary_tables(decoder.head_dim, decoder.rope_theta, decoder.max_positions)
    g.const("cos_cache", cos)
    g.const("sin_cache", sin)
    g.const("embedding", decoder.embedding.astype(np.float32))
    (x,) = g.op("Gather", ["embedding", "input_ids"], name="embed")
    if decoder.feature_fc is not None:
        (both,) = g.op("Concat", [x, "features"], name="embed_features", axis=-1)
        (x,) = g.op("MatMul", [both, g.const("feature_fc", decoder.feature_fc.astype(np.float32))], name="fc")
    residual, pending = x, None  # pending: the block output still to be added to the residual stream
    for i, layer in enumerate(decoder.layers):
        normed, residual = _norm(g, f"layers.{i}.attn_norm", layer.attn_norm, residual, pending, decoder.eps)
        qkv = _linear(g, f"layers.{i}.qkv", normed, layer.qkv)
        attn, _, _ = g.op("GroupQueryAttention",
                          [qkv, "", "", f"past.{i}.key", f"past.{i}.value", "seqlens_k", "total_sequence_length",
                           "cos_cache", "sin_cache"],
                          ["attn_" + str(i), f"present.{i}.key", f"present.{i}.value"], domain=MS,
                          name=f"layers.{i}.attention", num_heads=decoder.heads, kv_num_heads=decoder.kv_heads,
                          do_rotary=1, rotary_interleaved=0,
                          local_window_size=decoder.sliding_window or -1)
        pending = _linear(g, f"layers.{i}.o", attn, layer.o)
        normed, residual = _norm(g, f"layers.{i}.mlp_norm", layer.mlp_norm, residual, pending, decoder.eps)
        gate_up = _linear(g, f"layers.{i}.gate_up", normed, layer.gate_up)
        gate, up = g.op("Split", [gate_up, g.const(f"layers.{i}.split", np.array([decoder.intermediate] * 2))],
                        2, name=f"layers.{i}.split", axis=-1)
        (sig,) = g.op("Sigmoid", [gate])
        (silu,) = g.op("Mul", [gate, sig])
        (act,) = g.op("Mul", [silu, up])
        pending = _linear(g, f"layers.{i}.down", act, layer.down)
    normed, _ = _norm(g, "final_norm", decoder.final_norm, residual, pending, decoder.eps, out="hidden")
    # only the last logits_to_keep positions reach the head (0 in a prefill whose logits nobody reads)
    (new,) = g.op("Shape", ["input_ids"], start=1, end=2)
    (start,) = g.op("Sub", [new, "logits_to_keep"])
    (kept,) = g.op("Slice", [normed, start, g.const("int64_max", np.array([2 ** 62], np.int64)),
                             g.const("axis_1", np.array([1], np.int64))])
    (logits,) = [_linear(g, "head", kept, decoder.head, out="logits")]
    dyn = ["batch", "slots"]
    kv_shape = [dyn[0], decoder.kv_heads, dyn[1], decoder.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "new"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
              helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, [1])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in cache_names(layers, "past")]
    features = decoder.feature_fc is not None
    if features:
        inputs.append(helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", "new", decoder.hidden]))
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "kept", decoder.vocab])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in cache_names(layers, "present")]
    outputs.append(helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "new", decoder.hidden]))
    graph = helper.make_graph(g.nodes, "draftsmith_fused_decoder", inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)],
                              producer_name="draftsmith")
    model.ir_version = 9
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=model.ByteSize() > 1_800_000_000,
                    location=path.name + ".data")
    return input_names(layers, features), output_names(layers)


def _rotary_tables(head_dim: int, theta: float, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position x frequency [positions, head_dim / 2], computed in float64 then rounded once."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _norm(g: _Graph, name: str, weight: np.ndarray, residual: str, pending: str | None, eps: float,
          out: str = ""):
    """RMSNorm of residual (+ pending, added into the residual stream first); returns (normed, new residual)."""
    gamma = g.const(name + ".weight", weight.astype(np.float32))
    normed = out or name + "/normed"
    if pending is None:
        g.op("SimplifiedLayerNormalization", [residual, gamma], [normed], name=name, axis=-1, epsilon=eps,
             stash_type=1)
        return normed, residual
    total = name + "/sum"
    g.op("SkipSimplifiedLayerNormalization", [pending, residual, gamma], [normed, "", "", total], domain=MS,
         name=name, epsilon=eps)
    return normed, total


def _linear(g: _Graph, name: str, x: str, linear: Linear, out: str | None = None) -> str:
    """x @ W (+ offsets correction) (+ bias) as MatMul or MatMulNBits."""
    outs = [out] if out and linear.bias is None and (linear.quant is None or linear.quant.offsets is None) else 1
    if linear.quant is None:
        (y,) = g.op("MatMul", [x, g.const(name + ".weight", linear.weight.astype(np.float32))], outs, name=name)
    else:
        q = linear.quant
        inputs = [x, g.const(name + ".qweight", q.packed), g.const(name + ".scales", q.scales.astype(np.float32))]
        if q.zero_points is not None:
            inputs.append(g.const(name + ".zero_points", q.zero_points))
        (y,) = g.op("MatMulNBits", inputs, outs, domain=MS, name=name, K=q.k, N=q.n, bits=q.bits,
                    block_size=q.block, accuracy_level=g.accuracy_level)
        if q.offsets is not None:
            y = _block_offsets(g, name, x, q, y, out if linear.bias is None else None)
    if linear.bias is not None:
        (y,) = g.op("Add", [y, g.const(name + ".bias", linear.bias.astype(np.float32))], [out] if out else 1)
    return y


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
    return GraphInfo(num_layers=layers, num_kv_heads=decoder.kv_heads, head_dim=decoder.head_dim,
                     vocab_size=decoder.vocab, input_names=input_names(layers, decoder.feature_fc is not None),
                     output_names=output_names(layers),
                     graph="fused")


def check_against_torch(model, path: Path, info, tolerance: float, seed: int = 0) -> dict:
    """The fused engine (through the runtime's own FusedEngine) against torch, on what decoding does with it:
    a prefill, a verify pass of 7 tokens after a prefill without logits and 3 junk tokens rolled back, a right-padded batch prefill, then a
    batched one-token step and a batched 3-token verify (which runs row by row). Raises ExportError past
    ``tolerance`` (builder.export.compare_cases)."""
    import torch
    from builder.export import compare_cases
    from runtime.engine import FusedEngine
    engine = FusedEngine(path, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                         vocab_size=info.vocab_size, max_context=64, initial_slots=8)  # 8: the buffer grows too
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
        "batched_verify": (wide.reshape(-1, wide.shape[-1]),
                           np.concatenate([reference[0, 8:11], reference[1, 13:16]])),
    }
    return compare_cases(cases, tolerance, vocab)
