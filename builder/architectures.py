"""Which architectures build-engines exports, and what each needs. Add an entry here and a tiny-model test."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class UnsupportedArchitecture(ValueError):
    pass


@dataclass(frozen=True)
class Architecture:
    """What the exporter needs to know about one Hugging Face architecture."""

    name: str  # the class name in config.json's "architectures"
    model_type: str  # config.model_type (what GGUF files map to)
    tiny_config: dict[str, Any] = field(default_factory=dict)  # extra config keys of the test's tiny random model
    window_key: str | None = None  # config key of a sliding attention window, which caps the usable context
    tolerance: float = 1e-3  # max |logit difference| allowed between the fp32 ONNX graph and torch
    # what the fused graph (builder/graph.py) does differently from Llama's decoder; the rest (rotary scaling, layer
    # types, sliding windows, softcaps, query_pre_attn_scalar, activation) it reads from the config itself
    qkv_parts: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # self_attn linear layers, stacked in this order
    gate_up_parts: tuple[str, ...] = ("gate_proj", "up_proj")  # mlp linear layers: gate first, then up
    qk_norm: bool = False  # self_attn.q_norm / k_norm: RMSNorm of each head of q and k before the rotary embedding
    sandwich_norms: bool = False  # post_attention_layernorm after attention, pre/post_feedforward_layernorm round MLP
    norm_plus_one: bool = False  # RMSNorm scales by (1 + weight)
    scaled_embedding: bool = False  # the embedding module multiplies by its embed_scale (sqrt(hidden))
    attn_softcap: bool = False  # attention scores capped by config.attn_logit_softcapping (Gemma 3 ignores that key)
    multipliers: bool = False  # Granite: embedding/attention/residual_multiplier and logits_scaling from the config
    attn_implementation: str = "sdpa"  # how the build loads the torch model it checks against (Gemma 2: eager only)
    pre_norms: bool = True  # input_layernorm before attention, a norm before the MLP (OLMo 2 has neither)
    # llama.cpp's convert_hf_to_gguf.py stores attn_q / attn_k rows permuted for its rotary layout only in
    # LlamaModel.modify_tensors (Llama, Mistral and classes built on it); Qwen2/3, Gemma 2/3 and Phi-3 are written as
    # they are (builder.gguf.weights reads GGUF blocks in this order)
    gguf_permuted_qk: bool = True


REGISTRY: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM", "llama"),  # Llama 2/3, SmolLM/SmolLM2, TinyLlama
        Architecture("MistralForCausalLM", "mistral", {"sliding_window": 4096}, window_key="sliding_window"),
        Architecture("Qwen2ForCausalLM", "qwen2", gguf_permuted_qk=False),
        Architecture("Qwen3ForCausalLM", "qwen3", qk_norm=True, gguf_permuted_qk=False),
        # Phi-3/3.5/4-mini: fused projections (transformers' modeling_phi3 splits qkv_proj as q|k|v and gate_up_proj
        # as gate|up), partial rotary, longrope
        # (GroupQueryAttention's CPU kernel needs rotary_dim / 2 a multiple of 8: head_dim 32 x 0.5 in the test)
        Architecture(
            "Phi3ForCausalLM",
            "phi3",
            {
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "partial_rotary_factor": 0.5,
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                    "long_factor": [1.5, 2, 3, 4, 5, 6, 7, 8.0],
                },
                "original_max_position_embeddings": 64,
            },
            qkv_parts=("qkv_proj",),
            gate_up_parts=("gate_up_proj",),
            gguf_permuted_qk=False,
        ),
        # Gemma 2 / Gemma 3 (text): sandwich norms, (1 + w) norms, scaled embedding, gelu-tanh MLP, alternating
        # sliding/full layers; the fused graph keeps each layer's own window, so the context is not capped
        Architecture(
            "Gemma2ForCausalLM",
            "gemma2",
            {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 4},
            sandwich_norms=True,
            norm_plus_one=True,
            scaled_embedding=True,
            attn_softcap=True,
            attn_implementation="eager",
            gguf_permuted_qk=False,
        ),
        Architecture(
            "Gemma3ForCausalLM",
            "gemma3_text",
            {
                "head_dim": 16,
                "query_pre_attn_scalar": 24,
                "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                },
            },
            qk_norm=True,
            sandwich_norms=True,
            norm_plus_one=True,
            scaled_embedding=True,
            gguf_permuted_qk=False,
        ),
        # SmolLM3: Llama with no rotary embedding in every no_rope_layer_interval-th layer (config.no_rope_layers)
        Architecture("SmolLM3ForCausalLM", "smollm3", {"no_rope_layer_interval": 2}),
        Architecture(
            "GraniteForCausalLM",
            "granite",
            {
                "embedding_multiplier": 12.0,
                "attention_multiplier": 0.1,
                "residual_multiplier": 0.25,
                "logits_scaling": 8.0,
            },
            multipliers=True,
        ),
        # OLMo 2: no norm before attention or MLP, one after each; q/k normalized over the whole projection
        Architecture(
            "Olmo2ForCausalLM", "olmo2", qk_norm=True, sandwich_norms=True, pre_norms=False, gguf_permuted_qk=False
        ),
    )
}


def lookup(name: str | None, model_type: str | None = None) -> Architecture:
    """The registry entry for an architecture class name (or, for GGUF files, a model type)."""
    if name in REGISTRY:
        return REGISTRY[name]
    for arch in REGISTRY.values():
        if name is None and model_type == arch.model_type:
            return arch
    raise UnsupportedArchitecture(
        f"unsupported architecture {name or model_type!r}; supported: {', '.join(sorted(REGISTRY))}. "
        'Use a checkpoint of one of these (config.json\'s "architectures"), or add an entry to '
        "builder/architectures.py with a tiny-model test in tests/test_fused_graph.py."
    )
