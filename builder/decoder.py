"""Stage 2 (fused): a decoder's weights and shape as plain data (Decoder, Layer, Linear, BlockQuant, GgufBlocks,
RotaryTable),
and ``from_transformers``, which reads them off a transformers model of any registered family (builder/
architectures.py: the differences from Llama). builder/graph.py writes the fused ONNX graph from a Decoder;
builder/gguf/weights.py swaps its float linear layers for a GGUF file's own blocks.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


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


@dataclass(frozen=True)
class GgufBlocks:
    """A weight as a GGUF file stores it, for Draftsmith's GgufMatMul (runtime.engines.gguf_ops): one or more parts
    side by side along N (a fused q|k|v whose parts differ in type), each ``(type, data)`` with ``data`` uint8
    [rows, K / block values * block bytes], the file's blocks for those output rows (in Hugging Face row order), as
    they are (layout 0) or with every 16 rows regrouped for the column kernels (layout 1)."""

    k: int
    parts: tuple[tuple[str, np.ndarray], ...]  # (ggml type name, data)
    layout: int = 0  # 0: the file's rows as they are; 1: groups of 16 rows regrouped (weights.interleave16)

    @property
    def n(self) -> int:
        return sum(len(data) for _, data in self.parts)


@dataclass
class Linear:
    """y = x @ weight + bias. ``weight`` float32 [K, N], or ``quant`` for blocks in MatMulNBits' form, or ``gguf``
    for a GGUF file's own blocks."""

    weight: np.ndarray | None = None
    quant: BlockQuant | None = None
    bias: np.ndarray | None = None
    gguf: GgufBlocks | None = None


@dataclass
class Layer:
    attn_norm: np.ndarray | None  # None: attention reads the residual stream as it is (OLMo 2)
    qkv: Linear  # q, k and v projections side by side: N = (H + 2 H_kv) * D
    o: Linear
    mlp_norm: np.ndarray | None  # None: so does the MLP
    gate_up: Linear  # gate and up projections side by side: N = 2 * I
    down: Linear
    # RMSNorm of q and of k before the rotary embedding: per head over head_dim (Qwen3, Gemma 3; weights [D]) or
    # over the whole projection (OLMo 2; weights [H * D], [H_kv * D])
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    # Gemma 2/3: RMSNorm of the attention output and of the MLP output, each before its residual add
    post_attn_norm: np.ndarray | None = None
    post_mlp_norm: np.ndarray | None = None
    rope: str | None = "default"  # the key of Decoder.rotary this layer rotates by; None: no rotary embedding
    window: int | None = None  # tokens a query sees, itself included (transformers' sliding_window); None: Decoder's


class LazyLayers(Sequence):
    """Layers made when asked for, one at a time, and not kept: a graph is written holding one layer's weights, not
    the model's (builder.gguf.stream reads a GGUF file this way). ``ropes``: each layer's rotary key, known without
    making the layer (the graph's rotary inputs need them first). ``map(fn)``: the same layers, each passed through
    ``fn(i, layer)`` when made (a GGUF file's own blocks replacing float weights)."""

    def __init__(self, make: Callable[[int], "Layer"], ropes: Sequence[str | None]):
        self.make, self.ropes = make, tuple(ropes)

    def __len__(self) -> int:
        return len(self.ropes)

    def __getitem__(self, index):
        if isinstance(index, slice):
            kept = range(len(self))[index]
            if kept.step != 1 or kept.start != 0:
                raise IndexError("lazy layers slice to a prefix only (a truncated draft)")
            return LazyLayers(self.make, self.ropes[: len(kept)])
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self.make(index % len(self))

    def map(self, fn: Callable[[int, "Layer"], "Layer"]) -> "LazyLayers":
        make = self.make
        return LazyLayers(lambda i: fn(i, make(i)), self.ropes)


@dataclass
class RotaryTable:
    """cos and sin of position x frequency, float32 [positions, rotary_dim / 2], the attention scaling applied.

    ``long`` (longrope above its original context): the table a call uses when its total length exceeds ``switch``,
    as transformers' ``dynamic_rope_update`` picks it per call from max(position_ids) + 1."""

    cos: np.ndarray
    sin: np.ndarray
    long: "RotaryTable | None" = None
    switch: int = 0


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
    layers: Sequence[Layer]  # a list, or LazyLayers made one at a time
    final_norm: np.ndarray
    head: Linear  # N = vocab (may be a reduced draft head)
    sliding_window: int = 0  # tokens a query sees, itself included, in every layer without its own window; 0: all
    notes: list[str] = field(default_factory=list)
    # a feature draft (builder/distill/feature_draft.py): x = [embedding(token), features] @ feature_fc, float32
    # [2H, H], where features are the target's final hidden states (its ``hidden`` output) or the draft's own; a
    # Linear of blocks on Draftsmith's kernel (builder.gguf.float_draft.on_kernel)
    feature_fc: "np.ndarray | Linear | None" = None
    # the tables each Layer.rope names; empty: one plain table from rope_theta and max_positions
    rotary: dict[str, RotaryTable] = field(default_factory=dict)
    embed_scale: float = 1.0  # Gemma: the embedding lookup times sqrt(hidden)
    activation: str = "silu"  # of the gated MLP: silu or gelu_tanh
    attn_scale: float | None = None  # q.k scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # Gemma 2: scores -> softcap * tanh(scores / softcap); 0: none
    final_softcap: float = 0.0  # Gemma 2/3: the same on the logits
    residual_scale: float = 1.0  # Granite: each block's output times residual_multiplier before its residual add
    logit_divisor: float = 1.0  # Granite: logits / logits_scaling
    # the embedding in a GGUF file's own blocks (builder.gguf.weights): a GatherBlockQuantized of the token rows
    # (+ their blocks' offsets) instead of a float32 table, exact to the file; ``embedding`` then only says its shape
    embedding_quant: BlockQuant | None = None
    # ... or the file's own bytes read by GgufGather (runtime.engines.gguf_ops); a tied head's blocks are the same
    # object as ``head.gguf``'s, written once and read by both
    embedding_gguf: GgufBlocks | None = None


def clean_config(config, layers: int | None = None):
    """A copy of a transformers ``config`` for a plain fp32 model of its first ``layers`` layers (all: None).

    Here, beside ``from_transformers``, because every path that makes such a model needs it: a truncated self draft
    (builder/build.py, builder/distill/draft.py) and a GGUF file's reference layers (builder/gguf/stream.py), which
    must not reach up into distill/ for it."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded target: the draft is plain fp32
    if layers is not None:
        config.num_hidden_layers = layers
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:layers]
    return config


# --- from a transformers model --------------------------------------------------------------------------------------

ROPE_KINDS = ("default", "linear", "llama3", "yarn", "longrope")  # rotary types the fused graph writes as tables
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config hidden_act -> the graph's gated MLP


def from_transformers(model, max_context: int | None = None) -> Decoder:
    """The weights of a transformers decoder of a registered architecture (builder.architectures) as a Decoder.

    ``max_context``: the most tokens a sequence will hold (the build's context); the rotary tables get that many
    rows (+ the runtime's padding slot), not max_position_embeddings. None: max_position_embeddings."""
    from builder.architectures import lookup

    config = model.config
    arch = lookup((getattr(config, "architectures", None) or [None])[0], config.model_type)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    positions = int(max_context or config.max_position_embeddings) + 2  # one-token calls may be padded to two
    rotary, notes = _rotary_of(model, positions)
    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    norm = norm_of(arch)
    layers = [layer_of(state, i, arch, *attention_of(config, i, rotary)) for i in range(config.num_hidden_layers)]
    embedding = state["model.embed_tokens.weight"]
    head = state.get("lm_head.weight", embedding)
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if activation not in ACTIVATIONS:
        raise GraphError(
            f"MLP activation {activation!r} is not in the fused graph (it has {sorted(ACTIVATIONS)}); "
            "build with --graph export"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise GraphError("bidirectional attention is not in the fused graph (causal only); build with --graph export")
    scalar = getattr(config, "query_pre_attn_scalar", None)
    attn_scale = float(scalar) ** -0.5 if scalar else None
    if arch.multipliers:  # Granite's four scalars, applied where its modeling applies them
        attn_scale = float(config.attention_multiplier)
    return Decoder(
        hidden=config.hidden_size,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=config.intermediate_size,
        vocab=head.shape[0],
        eps=float(config.rms_norm_eps),
        rope_theta=float(_rope_theta(config)),
        max_positions=positions,
        embedding=embedding,
        layers=layers,
        final_norm=norm(state["model.norm.weight"]),
        head=Linear(head.T),
        notes=notes,
        rotary=rotary,  # a view: written in row chunks
        embed_scale=_embed_scale(model, arch),
        activation=ACTIVATIONS[activation],
        attn_scale=attn_scale,
        attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0) * arch.attn_softcap,
        final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
        residual_scale=float(config.residual_multiplier) if arch.multipliers else 1.0,
        logit_divisor=float(config.logits_scaling) if arch.multipliers else 1.0,
    )


def _embed_scale(model, arch) -> float:
    """The factor transformers multiplies the embedding by: Gemma's embed_scale buffer in the weights' float type
    (as it applies it), Granite's embedding_multiplier; else 1."""
    if arch.multipliers:
        return float(model.config.embedding_multiplier)
    if not arch.scaled_embedding:
        return 1.0
    embeddings = model.get_input_embeddings()
    return float(embeddings.embed_scale.to(embeddings.weight.dtype))


def norm_of(arch) -> Callable[[np.ndarray], np.ndarray]:
    """What the graph's RMSNorm weight is, given transformers' (Gemma scales by 1 + weight)."""
    return (lambda w: np.float32(1.0) + w) if arch.norm_plus_one else (lambda w: w)


def layer_of(state: dict, i: int, arch, rope: str | None, window: int) -> Layer:
    """Layer ``i`` from a state dict with transformers' names (``model.layers.{i}.``; only that layer's entries
    are read) of an architecture whose names and norms the registry entry gives."""
    p, norm = f"model.layers.{i}.", norm_of(arch)
    sandwich = arch.sandwich_norms
    optional = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"} if arch.qk_norm else {}
    if sandwich:
        optional.update(
            post_attn_norm="post_attention_layernorm.weight", post_mlp_norm="post_feedforward_layernorm.weight"
        )
    mlp_norm = "pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight"
    pre = arch.pre_norms
    return Layer(
        attn_norm=norm(state[p + "input_layernorm.weight"]) if pre else None,
        qkv=Linear(
            np.concatenate([state[p + f"self_attn.{x}.weight"] for x in arch.qkv_parts]).T,
            bias=_stacked_bias(state, p + "self_attn.", arch.qkv_parts),
        ),
        o=Linear(state[p + "self_attn.o_proj.weight"].T, bias=state.get(p + "self_attn.o_proj.bias")),
        mlp_norm=norm(state[p + mlp_norm]) if pre else None,
        gate_up=Linear(
            np.concatenate([state[p + f"mlp.{x}.weight"] for x in arch.gate_up_parts]).T,
            bias=_stacked_bias(state, p + "mlp.", arch.gate_up_parts),
        ),
        down=Linear(state[p + "mlp.down_proj.weight"].T, bias=state.get(p + "mlp.down_proj.bias")),
        rope=rope,
        window=window,
        **{k: norm(state[p + v]) for k, v in optional.items()},
    )


def _stacked_bias(state: dict, prefix: str, parts: tuple[str, ...]) -> np.ndarray | None:
    biases = [state.get(f"{prefix}{x}.bias") for x in parts]
    return np.concatenate(biases) if all(b is not None for b in biases) else None


def attention_of(config, i: int, rotary: dict) -> tuple[str | None, int]:
    """(rotary table key, sliding window) of layer ``i``: layer_types name each layer's kind (Gemma, Qwen); without
    them a sliding_window applies to every layer (Mistral, Phi-3)."""
    types = getattr(config, "layer_types", None)
    kind = types[i] if types else None
    window = int(getattr(config, "sliding_window", None) or 0) if getattr(config, "use_sliding_window", True) else 0
    if kind is not None and kind != "sliding_attention":
        window = 0
    no_rope = getattr(config, "no_rope_layers", None)  # SmolLM3: 0 marks a layer without rotary embedding
    if no_rope is not None and not no_rope[i]:
        return None, window
    return (kind if kind in rotary else "default"), window


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0


def _rope_params(config) -> dict:
    """{layer type or "default": rope parameters}: Gemma 3 keeps one set per layer type (transformers 5)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return dict(params)
    return {"default": params}


def _rotary_of(model, positions: int) -> tuple[dict[str, RotaryTable], list[str]]:
    """The cos/sin tables transformers computes: inv_freq and attention scaling from the model's own rotary module
    (its default) or transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS (scaled kinds); angles in float32 as
    its rotary forward does (position.float() * inv_freq, then cos/sin, then times the scaling). ``positions``:
    rows, the context + 2 (the runtime may pad a lone token to two)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config, tables, notes = model.config, {}, []
    per_type = _rope_params(config)
    for key, params in per_type.items():
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in ROPE_KINDS:
            why = " (its frequencies change with the sequence length at every call)" if kind == "dynamic" else ""
            raise GraphError(
                f"rotary scaling {kind!r} is not in the fused graph{why}; it has {list(ROPE_KINDS)}; "
                "build with --graph export"
            )
        layer = {"layer_type": key} if key != "default" else {}
        if kind == "default":
            init = type(model.model.rotary_emb).compute_default_rope_parameters
        else:
            init = ROPE_INIT_FUNCTIONS[kind]
        inv, scaling = init(config, device=None, **layer)
        if len(inv) % 8:  # onnxruntime 1.32: "cos_cache dimension 1 must be <= head_size / 2 and a multiple of 8"
            raise GraphError(
                f"a rotary dimension of {2 * len(inv)} is not in the fused graph (GroupQueryAttention's "
                "CPU kernel needs a multiple of 16); build with --graph export"
            )
        table = _table(inv, scaling, positions)
        if kind == "longrope":
            original = int(
                params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", 0)
            )
            if positions - 2 > original:  # past it transformers switches to the long factors, call by call
                long_inv, _ = init(config, device=None, seq_len=original + 1, **layer)
                table.long, table.switch = _table(long_inv, scaling, positions), original
                notes.append(
                    f"longrope: a call whose sequence exceeds {original} tokens rotates by the long "
                    "factors (keys already cached keep the short ones), as transformers does; build with "
                    f"--max-context {original} to stay on the short factors"
                )
        tables[key] = table
    return tables, notes


def _table(inv_freq, scaling: float, positions: int) -> RotaryTable:
    import torch

    angles = torch.arange(positions, dtype=torch.int64).float()[:, None] * inv_freq.float()[None, :]
    return RotaryTable((angles.cos() * scaling).numpy(), (angles.sin() * scaling).numpy())
