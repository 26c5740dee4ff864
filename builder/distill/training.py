"""Stage 3: train the draft on KL(target || draft) at temperature 1 over the teacher's top-k rows (or cross-entropy on
the target's tokens, ``loss="tokens"``), embeddings and (tied) head frozen, for a number of steps (never a time).
"""

from __future__ import annotations

import math
import random
import time
from typing import Callable

import numpy as np

from builder.distill.corpus import DistillError, Sample, batches, pad
from builder.distill.draft import head_weight, hidden_states


def train(
    draft,
    samples: list[Sample],
    *,
    steps: int,
    lr: float = 5e-4,
    loss: str = "kl",
    kept: np.ndarray | None = None,
    tokens_per_batch: int = 1024,
    seed: int = 0,
    train_prompt_positions: bool = True,
    on_step: Callable[[int, float, float], None] = lambda *a: None,
) -> dict:
    """Train the draft's decoder layers and final norm (embeddings and head frozen) for ``steps`` optimizer steps
    (epoch after epoch of shuffled batches). Learning rate: short warm-up, then cosine decay over the steps."""
    import torch

    if loss not in ("kl", "tokens"):
        raise DistillError(f"loss must be 'kl' or 'tokens', received {loss!r}")
    for p in draft.parameters():
        p.requires_grad_(False)
    base = getattr(draft, draft.base_model_prefix)
    trainable = [p for name, p in base.named_parameters() if "embed" not in name]
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    vocab = draft.get_output_embeddings().weight.shape[0]
    remap = None
    if kept is not None:
        remap = torch.full((max(vocab, int(kept.max()) + 1),), -1, dtype=torch.long)
        remap[torch.as_tensor(kept)] = torch.arange(len(kept))
    started = time.perf_counter()
    step, losses = 0, []
    draft.train()
    while True:
        for batch in batches(samples, tokens_per_batch, shuffle=rng):
            progress = step / max(steps, 1)
            if progress >= 1.0:
                draft.eval()
                return {
                    "steps": step,
                    "seconds": round(time.perf_counter() - started, 1),
                    "final_loss": round(float(np.mean(losses[-20:])), 4) if losses else None,
                }
            rate = set_rate(optimizer, lr, step, progress)
            losses.append(
                optimize(optimizer, _loss(draft, batch, loss, kept, remap, train_prompt_positions), trainable)
            )
            step += 1
            on_step(step, losses[-1], rate)


def set_rate(optimizer, lr: float, step: int, progress: float) -> float:
    """Warm-up over 20 steps, then cosine decay over the budget's ``progress`` (0..1); returns the rate set."""
    rate = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    for group in optimizer.param_groups:
        group["lr"] = rate
    return rate


def optimize(optimizer, value, params) -> float:
    """One AdamW step on ``value`` with gradients clipped to norm 1; returns the loss."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    value.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return float(value.detach())


def _loss(draft, batch: list[Sample], loss: str, kept, remap, prompt_positions: bool):
    import torch

    ids, mask = pad([s.ids for s in batch])
    hidden = hidden_states(draft, ids, mask)
    rows, targets_ids, targets_probs = [], [], []
    for r, s in enumerate(batch):
        n = len(s.ids) - 1
        first = 0 if (prompt_positions and loss == "kl") else len(s.prompt) - 1
        if loss == "kl":
            first = max(first, s.rows_from)
            targets_ids.append(torch.from_numpy(s.top_ids[first - s.rows_from : n - s.rows_from]))
            targets_probs.append(torch.from_numpy(s.top_probs[first - s.rows_from : n - s.rows_from]))
        else:
            targets_ids.append(torch.tensor(s.ids[first + 1 : n + 1])[:, None])
            targets_probs.append(torch.ones(n - first, 1))
        rows.append(hidden[r, first:n])
    h = torch.cat(rows)
    t_ids, t_probs = torch.cat(targets_ids), torch.cat(targets_probs)
    if remap is not None:
        t_ids = remap[t_ids.clamp(max=len(remap) - 1)]
        t_probs = torch.where(t_ids >= 0, t_probs, torch.zeros_like(t_probs))  # q is 0 there: drop, as the sampler does
        t_ids = t_ids.clamp(min=0)
    logits = h @ head_weight(draft, kept).T
    log_q = torch.log_softmax(logits, dim=-1).gather(1, t_ids)
    weight = t_probs.sum(1).clamp(min=1e-6)
    # cross-entropy against the (sparse) target distribution: KL(p || q) up to p's entropy, a constant
    return -((t_probs * log_q).sum(1) / weight).mean()
