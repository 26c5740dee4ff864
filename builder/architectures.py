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


REGISTRY: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM", "llama"),  # Llama 2/3, SmolLM/SmolLM2, TinyLlama
        Architecture("MistralForCausalLM", "mistral", {"sliding_window": 4096}, window_key="sliding_window"),
        Architecture("Qwen2ForCausalLM", "qwen2"),
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
        "Draftsmith exports decoder-only models of the Llama family.")
