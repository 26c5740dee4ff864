"""Stage 1: the target continues every prompt (torch ``generate``, left-padded batches of similar length)."""

from __future__ import annotations

import math
import time
from typing import Callable

from builder.distill.corpus import Sample


def eos_ids_of(model, tokenizer) -> list[int]:
    ids = set()
    for value in (getattr(model.config, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)
                  if getattr(model, "generation_config", None) else None, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def generate(model, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
             eos_ids: list[int], pad_id: int, batch_size: int = 16, deadline: float = math.inf,
             advance: Callable[[int], None] = lambda n: None) -> list[Sample]:
    """Continue every prompt with the target (left-padded batches of similar length). Stops starting batches at
    ``deadline``; returns the samples made so far, in the order of ``prompts``."""
    import torch
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    done: dict[int, Sample] = {}
    torch.manual_seed(seed)
    for start in range(0, len(order), batch_size):
        if start and time.perf_counter() > deadline:  # the first batch always runs
            break
        rows = order[start: start + batch_size]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        options = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                       eos_token_id=eos_ids or None)
        if temperature > 0:
            options.update(temperature=temperature, top_k=0, top_p=1.0)
        else:
            options.update(temperature=None, top_k=None, top_p=None)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **options)
        for r, i in enumerate(rows):
            continuation = []
            for token in out[r, width:].tolist():
                continuation.append(token)
                if token in eos_ids:
                    break
            done[i] = Sample(list(prompts[i]), continuation)
        advance(len(rows))
    return [done[i] for i in sorted(done)]
