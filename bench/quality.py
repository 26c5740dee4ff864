"""Quality beside speed: perplexity on the evaluation set (``builder/data/eval_long.txt``, ~28,000 tokens of
human-written text the models were not tuned on), for our target engine and for each peer whose API returns logits.

The same token ids in the same windows for everyone (``builder.evaluate``'s windows of 512 tokens, each from an empty
cache, the build report's method), so the column tells a re-quantized or differently computed model from the file's
own: llama.cpp through ``logits_all``; OpenVINO GenAI's ``LLMPipeline`` returns no logits (no figure); ONNX Runtime
GenAI's graphs are the build report's re-quantized int4 (docs/building.md).
"""

from __future__ import annotations

import numpy as np

from builder.evaluate import eval_set_text, eval_windows


def windows(generator, limit: int = 0) -> list[list[int]]:
    """The evaluation set in the bundle's token ids, in the build report's windows (``limit`` tokens; 0: all)."""
    ids = generator.tokenizer.encode(eval_set_text())  # as the build report tokenizes it
    return eval_windows(ids, generator.target.max_context, limit)


def perplexity(logits_of, windows_ids: list[list[int]]) -> float:
    """exp(mean next-token NLL) over every window, ``logits_of(ids) -> [len(ids), V]`` (float64 sums)."""
    nll, scored = 0.0, 0
    for ids in windows_ids:
        logits = np.asarray(logits_of(ids), dtype=np.float64)[:-1]
        logits -= logits.max(axis=-1, keepdims=True)
        log_probs = logits[np.arange(len(ids) - 1), ids[1:]] - np.log(np.exp(logits).sum(axis=-1))
        nll -= float(log_probs.sum())
        scored += len(ids) - 1
    return float(np.exp(nll / max(scored, 1)))


def ours(generator, windows_ids: list[list[int]]) -> float:
    """Our target engine's perplexity, teacher-forced window by window (as target-only decoding computes it)."""
    def logits_of(ids):
        cache = generator.target.new_cache(1)
        return generator.target.forward(cache, np.array([ids], np.int64))[0]
    return perplexity(logits_of, windows_ids)
