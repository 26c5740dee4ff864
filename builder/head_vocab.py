"""Which target tokens a reduced draft head keeps (``draft_head: N``; FR-Spec, Zhao et al. 2025).

A draft's head is a large share of what it reads a token (Qwen2.5-Coder-0.5B: 151,936 rows, 37% of its bytes), yet
most of those rows are tokens a decode rarely emits. The kept ids, in order of preference:

1. the tokenizer's special and added tokens and the bundle's EOS ids (a chat reply ends on one);
2. the tokens of the builder's prompt text (``builder/data/distill_prompts.txt``: 208 code and chat requests, none
   of the bench's held-out prompts), most frequent first;
3. then by id: byte-level BPE tokenizers (GPT-2's, Qwen's, Llama 3's, SmolLM's) number their tokens in merge order,
   and a merge is learned earlier the more often its pair occurred in the tokenizer's own training text, so low ids
   are the frequent ones. Measured on Qwen2.5-Coder's tokenizer: ids below 32,768 hold 95.4% of the tokens of the
   held-out code prompts and 94.6% of the build report's evaluation set (ids below 65,536: 98.8% / 98.5%).

The build report scores the draft on the evaluation set (``draft_vocab.eval_coverage``: the share of its tokens the
head keeps), text that played no part in choosing them. What is dropped only lowers acceptance: the draft proposes
kept tokens only, and the target's verification restores any other (runtime.engines.mapped).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from importlib import resources

import numpy as np

PROMPT_TEXT = "data/distill_prompts.txt"


def frequent_ids(tokenizer, size: int, vocab: int, always: Iterable[int] = ()) -> np.ndarray:
    """``size`` distinct token ids below ``vocab`` (see the module's docstring for the order), sorted ascending."""
    if not 0 < size < vocab:
        raise ValueError(f"a reduced head keeps between 1 and {vocab - 1} rows, not {size}")
    special = [*always, *getattr(tokenizer, "all_special_ids", ()), *_added_ids(tokenizer)]
    text = resources.files("builder").joinpath(PROMPT_TEXT).read_text(encoding="utf-8")
    counts = Counter(tokenizer(text)["input_ids"])
    by_count = sorted(counts, key=lambda t: (-counts[t], t))
    chosen = dict.fromkeys(t for t in (*special, *by_count) if 0 <= t < vocab)
    chosen = list(chosen)[:size]
    have = set(chosen)
    for t in range(vocab):
        if len(chosen) >= size:
            break
        if t not in have:
            chosen.append(t)
    return np.asarray(sorted(chosen), np.int64)


def _added_ids(tokenizer) -> list[int]:
    """Ids of the tokenizer's added tokens (Qwen's <|im_start|>, <|im_end|>, tool and FIM markers)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return [int(t) for t in added]
