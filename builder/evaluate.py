"""Stage 5: what quantization cost. Teacher-forced top-1 agreement with the fp32 graph, and perplexity."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from runtime.engine import OnnxEngine, engine_class


def eval_text() -> str:
    return resources.files("builder").joinpath("data/eval.txt").read_text(encoding="utf-8")


def logits_of(engine: OnnxEngine, ids: list[int]) -> np.ndarray:
    cache = engine.new_cache(1)
    return engine.forward(cache, np.array([ids], np.int64))[0]


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp(mean negative log-likelihood of each next token)."""
    shifted = logits[:-1] - logits[:-1].max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    nll = -log_probs[np.arange(len(ids) - 1), ids[1:]]
    return float(np.exp(nll.mean()))


def agreement(logits: np.ndarray, reference: np.ndarray) -> float:
    return float((logits.argmax(-1) == reference.argmax(-1)).mean())


def report(engines: dict[str, OnnxEngine], references: dict[str, OnnxEngine], ids: list[int]) -> dict:
    """Per engine: agreement with its own fp32 graph and perplexity; plus draft/target greedy agreement."""
    out = {"eval_tokens": len(ids)}
    computed = {}
    for name, engine in engines.items():
        reference = logits_of(references[name], ids)
        computed[name] = logits_of(engine, ids)
        out[name] = {"top1_agreement_vs_fp32": agreement(computed[name], reference),
                     "perplexity": perplexity(computed[name], ids), "fp32_perplexity": perplexity(reference, ids)}
    if "draft" in computed and "target" in computed:
        out["draft_target_top1_agreement"] = agreement(computed["draft"], computed["target"])
    return out


def engine_for(path: Path, info, max_context: int, threads: int = 0) -> OnnxEngine:
    return engine_class(info.graph)(path, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                      vocab_size=info.vocab_size, max_context=max_context, threads=threads)
