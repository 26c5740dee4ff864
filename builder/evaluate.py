"""Stage 5: what quantization cost. Teacher-forced top-1 agreement with the fp32 graph, and perplexity."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np

from runtime.engine import OnnxEngine, engine_class


EVAL_SET = "data/eval_long.txt"  # the build report's evaluation set (below)
WINDOW = 512  # tokens a window: the set is scored in windows, each from an empty cache (logits [512, V] at most)


def eval_text() -> str:
    """A short text (302 tokens; TensorRT-LLM's calibration paragraphs read it)."""
    return resources.files("builder").joinpath("data/eval.txt").read_text(encoding="utf-8")


def eval_set_text() -> str:
    """The evaluation set: 106 docstrings of 70 Python 3.11 standard-library modules (human-written English
    about code, none in the distillation prompts), the first two of at least 400 characters per module in
    alphabetical order, 110,729 characters: ~25,000 tokens, enough to tell +1% perplexity from +3%. Fixed: shipped
    as a file, not regenerated from whatever Python runs."""
    return resources.files("builder").joinpath(EVAL_SET).read_text(encoding="utf-8")


def eval_windows(ids: list[int], max_context: int, limit: int = 0) -> list[list[int]]:
    """``ids`` (the first ``limit`` of them; 0: all) in consecutive windows of WINDOW tokens (or the context)."""
    ids = ids[:limit] if limit else ids
    width = max(2, min(WINDOW, max_context))
    return [ids[i: i + width] for i in range(0, len(ids), width) if len(ids[i: i + width]) > 1]


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


def report(engines: dict[str, OnnxEngine], references: dict[str, OnnxEngine], windows: list[list[int]],
           advance: Callable[[int], None] = lambda n: None) -> dict:
    """Per engine: agreement with its own fp32 graph and perplexity over every window; plus draft/target greedy
    agreement. A feature draft reads the (quantized) target engine's hidden states, as at run time, and is scored
    from each window's second token on. ``advance(1)`` after each window (a build's progress line)."""
    sums = {name: {"nll": 0.0, "fp32_nll": 0.0, "scored": 0, "agree": 0, "rows": 0} for name in engines}
    pair = [0, 0]  # draft/target argmax agreements, rows
    reads_features = any(getattr(e, "takes_features", False) for e in engines.values())
    for ids in windows:
        features = hidden_of(engines["target"], ids) if reads_features else None
        computed = {}
        for name, engine in engines.items():
            scored = ids[1:] if getattr(engine, "takes_features", False) else ids
            reference = logits_of(references[name], ids, features)
            computed[name] = logits_of(engine, ids, features)
            total = sums[name]
            total["nll"] += nll_sum(computed[name], scored)
            total["fp32_nll"] += nll_sum(reference, scored)
            total["scored"] += len(scored) - 1
            total["agree"] += int((computed[name].argmax(-1) == reference.argmax(-1)).sum())
            total["rows"] += len(reference)
            del reference
        if "draft" in computed and "target" in computed:
            skip = len(computed["target"]) - len(computed["draft"])
            pair[0] += int((computed["draft"].argmax(-1) == computed["target"][skip:].argmax(-1)).sum())
            pair[1] += len(computed["draft"])
        advance(1)
    out = {"eval_tokens": sum(len(ids) for ids in windows), "eval_windows": len(windows)}
    for name, total in sums.items():
        out[name] = {"top1_agreement_vs_fp32": total["agree"] / max(total["rows"], 1),
                     "perplexity": float(np.exp(total["nll"] / max(total["scored"], 1))),
                     "fp32_perplexity": float(np.exp(total["fp32_nll"] / max(total["scored"], 1)))}
    if pair[1]:
        out["draft_target_top1_agreement"] = pair[0] / pair[1]
    return out


def nll_sum(logits: np.ndarray, ids: list[int]) -> float:
    """The summed negative log-likelihood of each next token (float64 sums: 25,000 terms)."""
    shifted = logits[:-1] - logits[:-1].max(axis=-1, keepdims=True)
    log_probs = shifted[np.arange(len(ids) - 1), ids[1:]] - np.log(np.exp(shifted).sum(axis=-1))
    return float(-log_probs.astype(np.float64).sum())


def engine_for(path: Path, info, max_context: int, threads: int = 0) -> OnnxEngine:
    return engine_class(info.graph)(path, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                      vocab_size=info.vocab_size, max_context=max_context, threads=threads)
