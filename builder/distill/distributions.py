"""Stage 2: the teacher's distributions. One teacher-forced pass of the target over every prompt + continuation keeps
the top ``top_k`` probabilities of each position (sparse rows: the full 49152-wide rows of SmolLM2 would need
gigabytes).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from builder.distill.corpus import Sample, batches, pad


def teacher(
    model,
    samples: list[Sample],
    top_k: int,
    tokens_per_batch: int = 1024,
    advance: Callable[[int], None] = lambda n: None,
) -> None:
    """Fill each sample's sparse teacher rows: the target's top-k next-token probabilities at every position."""
    import torch

    for batch in batches(samples, tokens_per_batch, shuffle=None):
        ids, mask = pad([s.ids for s in batch])
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
            for r, s in enumerate(batch):
                n = len(s.ids) - 1
                probs = torch.softmax(logits[r, :n].float(), dim=-1)
                values, index = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
                s.top_ids, s.top_probs = index.numpy().astype(np.int64), values.numpy().astype(np.float32)
        del logits
        advance(len(batch))
