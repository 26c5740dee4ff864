"""Quality beside speed: perplexity on the evaluation set (``builder/data/eval_long.txt``, ~28,000 tokens of
human-written text the models were not tuned on), for our target engine and for each peer whose API returns logits.

The same token ids in the same windows for everyone (``builder.evaluate``'s windows of 512 tokens, each from an empty
cache, the build report's method), so the column tells a re-quantized or differently computed model from the file's
own: llama.cpp through ``logits_all``; OpenVINO GenAI's ``LLMPipeline`` returns no logits (no figure); ONNX Runtime
GenAI's graphs are the build report's re-quantized int4 (docs/building.md).
"""

from __future__ import annotations

import numpy as np

from builder.evaluate import eval_set_text, eval_windows, logits_of, nll_sum


def windows(generator, limit: int = 0) -> list[list[int]]:
    """The evaluation set in the bundle's token ids, in the build report's windows (``limit`` tokens; 0: all)."""
    ids = generator.tokenizer.encode(eval_set_text())  # as the build report tokenizes it
    return eval_windows(ids, generator.target.max_context, limit)


def perplexity(logits_of_ids, windows_ids: list[list[int]]) -> float:
    """exp(mean next-token NLL) over every window, ``logits_of_ids(ids) -> [len(ids), V]`` (the build report's sums)."""
    nll = sum(nll_sum(np.asarray(logits_of_ids(ids), dtype=np.float32), ids) for ids in windows_ids)
    scored = sum(len(ids) - 1 for ids in windows_ids)
    return float(np.exp(nll / max(scored, 1)))


def ours(generator, windows_ids: list[list[int]]) -> float:
    """Our target engine's perplexity, teacher-forced window by window (``builder.evaluate.logits_of``)."""
    return perplexity(lambda ids: logits_of(generator.target, ids), windows_ids)
