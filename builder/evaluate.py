"""Stage 5: what quantization cost. Teacher-forced top-1 agreement with the fp32 graph, and perplexity."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from runtime.engine import OnnxEngine, engine_class


def eval_text() -> str:
    return resources.files("builder").joinpath("data/eval.txt").read_text(encoding="utf-8")


def logits_of(engine: OnnxEngine, ids: list[int], features: np.ndarray | None = None) -> np.ndarray:
    """Teacher-forced logits [len(ids), V]. A feature draft scores ids[1:] from the target's hidden states
    ``features`` [len(ids), H] (pair j: the state after token j with token j+1), so its row j predicts token j+2."""
    cache = engine.new_cache(1)
    if getattr(engine, "takes_features", False):
        return engine.forward(cache, np.array([ids[1:]], np.int64), features=features[None, :-1])[0]
    return engine.forward(cache, np.array([ids], np.int64))[0]


def hidden_of(engine, ids: list[int]) -> np.ndarray | None:
    """The target's final hidden states over ids (a feature draft's input), None where the graph has none."""
    cache = engine.new_cache(1)
    engine.forward(cache, np.array([ids], np.int64))
    hidden = cache.extra.get("hidden")
    return None if hidden is None else hidden[0]


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp(mean negative log-likelihood of each next token)."""
    shifted = logits[:-1] - logits[:-1].max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    nll = -log_probs[np.arange(len(ids) - 1), ids[1:]]
    return float(np.exp(nll.mean()))


def agreement(logits: np.ndarray, reference: np.ndarray) -> float:
    return float((logits.argmax(-1) == reference.argmax(-1)).mean())


def report(engines: dict[str, OnnxEngine], references: dict[str, OnnxEngine], ids: list[int]) -> dict:
    """Per engine: agreement with its own fp32 graph and perplexity; plus draft/target greedy agreement. A feature
    draft reads the (quantized) target engine's hidden states, as at run time, and is scored from token 2 on."""
    out = {"eval_tokens": len(ids)}
    computed, scored = {}, {}
    reads_features = any(getattr(e, "takes_features", False) for e in engines.values())
    features = hidden_of(engines["target"], ids) if reads_features else None
    for name, engine in engines.items():
        reads = getattr(engine, "takes_features", False)
        scored[name] = ids[1:] if reads else ids
        reference = logits_of(references[name], ids, features)
        computed[name] = logits_of(engine, ids, features)
        out[name] = {"top1_agreement_vs_fp32": agreement(computed[name], reference),
                     "perplexity": perplexity(computed[name], scored[name]),
                     "fp32_perplexity": perplexity(reference, scored[name])}
    if "draft" in computed and "target" in computed:
        skip = len(ids) - len(scored["draft"])
        out["draft_target_top1_agreement"] = agreement(computed["draft"], computed["target"][skip:])
    return out


def engine_for(path: Path, info, max_context: int, threads: int = 0) -> OnnxEngine:
    return engine_class(info.graph)(path, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                      vocab_size=info.vocab_size, max_context=max_context, threads=threads)
