"""Stage 3: train the draft on KL(target || draft) at temperature 1 over the teacher's top-k rows (or cross-entropy on
the target's tokens, ``loss="tokens"``), embeddings and (tied) head frozen, for a number of steps (never a time).

A feature draft (builder/distill/feature_draft.py) trains here too (``train_feature_draft``, with its losses and
``chained_agreement``): the same warm-up and cosine rate (``set_rate``) and the same clipped AdamW step
(``optimize``), its own batches (features beside the tokens) and checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
from pathlib import Path
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


# --- a feature draft's training (builder/distill/feature_draft.py's model) --------------------------------------------


def _batch(samples: list[Sample]):
    """Right-padded tokens, features and masks of samples that carry features."""
    import torch

    width = max(len(s.ids) - 1 for s in samples)
    hidden = samples[0].features.shape[1]
    tokens = torch.zeros((len(samples), width + 1), dtype=torch.long)
    feats = torch.zeros((len(samples), width, hidden))
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for r, s in enumerate(samples):
        n = len(s.ids) - 1
        tokens[r, : n + 1] = torch.tensor(s.ids)
        feats[r, :n] = torch.from_numpy(s.features[:n].astype(np.float32))
        mask[r, :n] = 1
    return tokens, feats, mask


def unrolled(draft, tokens, feats, mask, levels: int, noise: float = 0.0):
    """Each level's (predicted features, logits) over the batch: level s at index i drafts the token at i+s+1 from
    the true pairs up to i and its own chain (see the module docstring)."""
    import torch

    b, width = mask.shape
    positions = torch.arange(width)[None].expand(b, width)
    inputs = feats + noise * (torch.rand_like(feats) - 0.5) if noise else feats
    past, outs = [], []
    for s in range(levels):
        # level s: token at i+s+1 (padding past the end: masked out of the loss)
        toks = torch.nn.functional.pad(tokens[:, s + 1 :], (0, s))[:, :width]
        pred, logits, kv = draft.level(toks, inputs, positions + s, past, mask)
        past.append(kv)
        outs.append((pred, logits))
        inputs = pred
    return outs


def feature_loss(draft, batch: list[Sample], levels: int, noise: float, logit_weight: float = 1.0):
    """Sum over levels of smooth-L1(feature) + logit_weight * cross-entropy to the target's kept-vocabulary
    distribution; returns (loss, level-0 top-1 agreement with the target's argmax)."""
    import torch

    tokens, feats, mask = _batch(batch)
    total, agree = 0.0, 0.0
    for s, (pred, logits) in enumerate(unrolled(draft, tokens, feats, mask, levels, noise)):
        # level s at index i predicts feature i+s+1 (the target feature exists while i+s+1 < n)
        target = torch.nn.functional.pad(feats[:, s + 1 :], (0, 0, 0, s + 1))
        valid = torch.nn.functional.pad(mask[:, s + 1 :], (0, s + 1)).bool()
        if not valid.any():
            continue
        p, t, lg = pred[valid], target[valid], logits[valid]
        with torch.no_grad():
            teacher = torch.softmax(draft.head_logits(t), dim=-1)
        regression = torch.nn.functional.smooth_l1_loss(p, t)
        ce = -(teacher * torch.log_softmax(lg, dim=-1)).sum(-1).mean()
        total = total + (regression + logit_weight * ce) / (1 + s)
        if s == 0:
            agree = float((lg.argmax(-1) == teacher.argmax(-1)).float().mean())
    return total, agree


def train_feature_draft(
    draft,
    samples: list[Sample],
    *,
    steps: int,
    lr: float = 3e-3,
    tokens_per_batch: int = 2048,
    levels: int = 1,
    noise: float = 0.2,
    seed: int = 0,
    on_step: Callable[[int, float, float], None] = lambda *a: None,
    checkpoint: tuple[Path, dict] | None = None,
    save_every: float = 300.0,
    dtype: str = "auto",
) -> dict:
    """AdamW on the layer and fc (embeddings and head frozen) for ``steps`` optimizer steps; warm-up then cosine
    decay over the steps. Epoch e's batches are shuffled by ``seed + e``.

    ``checkpoint`` (folder, fingerprint): the run saves its weights, optimizer state and position there every
    ``save_every`` seconds (builder/distill/checkpoints.py) and, started again with a checkpoint of the same
    fingerprint, resumes from it: the same batches, rates and random draws follow, so it ends on the weights an
    unbroken run ends on.

    ``dtype``: what the matrix products read while training (``FeatureDraft.set_matmul_dtype``): ``auto`` is
    bfloat16 where this CPU multiplies it natively (``matmul_dtype``), else float32; the draft is measured and
    saved in float32 either way."""
    import torch
    from builder.distill import checkpoints

    usable = [s for s in samples if s.features is not None and len(s.ids) > 2]
    if not usable:
        raise DistillError("no training sample carries target features (the teacher must be the ONNX engine)")
    chosen = matmul_dtype(dtype)
    named = {name: p for name, p in draft.named_parameters() if p.requires_grad}
    params = list(named.values())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    torch.manual_seed(seed)
    at = (checkpoint and checkpoints.load(*checkpoint, named, optimizer)) or checkpoints.Position()
    resumed, started, last_save = at.step, time.perf_counter(), time.perf_counter()
    losses: list[float] = []

    def trained() -> float:
        return at.elapsed + time.perf_counter() - started

    while True:
        epoch = batches_of(usable, tokens_per_batch, seed + at.epoch)
        for batch in epoch[at.batch :]:
            progress = at.step / max(steps, 1)
            if progress >= 1.0:
                return {
                    "steps": at.step,
                    "resumed_at_step": resumed,
                    "seconds": round(trained(), 1),
                    "levels": levels,
                    "dtype": chosen,
                    "final_loss": round(float(np.mean(losses[-20:])), 4) if losses else None,
                }
            rate = set_rate(optimizer, lr, at.step, progress)
            with matmuls_in(draft, chosen):
                losses.append(optimize(optimizer, feature_loss(draft, batch, levels, noise)[0], params))
            at.step, at.batch = at.step + 1, at.batch + 1
            on_step(at.step, losses[-1], rate)
            if checkpoint and time.perf_counter() - last_save > save_every:
                checkpoints.save(*checkpoint, dataclasses.replace(at, elapsed=trained()), named, optimizer)
                last_save = time.perf_counter()
        at.epoch, at.batch = at.epoch + 1, 0


@contextlib.contextmanager
def matmuls_in(draft, dtype: str):
    """The draft's matrix products in ``dtype`` for the duration (``FeatureDraft.set_matmul_dtype``), float32 after."""
    import torch

    draft.set_matmul_dtype(getattr(torch, dtype))
    try:
        yield draft
    finally:
        draft.set_matmul_dtype(torch.float32)


def matmul_dtype(asked: str = "auto") -> str:
    """``asked`` (float32 or bfloat16), or for ``auto`` bfloat16 where this CPU multiplies it natively (oneDNN's
    check: AVX-512 BF16 or AMX; a 2048x1536 by 1536x16384 product measured 0.28 s against 0.64 in float32 on 2
    AMD EPYC cores), else float32 (elsewhere bfloat16 is emulated, slower than float32)."""
    import torch

    if asked not in ("auto", "float32", "bfloat16"):
        raise DistillError(f"training dtype must be auto, float32 or bfloat16, received {asked!r}")
    if asked != "auto":
        return asked
    native = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return "bfloat16" if native is not None and native() else "float32"


def batches_of(samples: list[Sample], tokens: int, seed: int) -> list[list[Sample]]:
    """One epoch's batches, shuffled by ``seed`` (builder.distill.corpus.batches)."""
    from builder.distill.corpus import batches

    return batches(samples, tokens, shuffle=random.Random(seed))


def chained_agreement(
    draft, samples: list[Sample], kept: np.ndarray | None, levels: int = 4, tokens_per_batch: int = 4096
) -> dict:
    """Greedy agreement of the chained draft with the target's own continuation, per draft position: position s
    counts where positions 1..s all matched (so it is the share of steps that reach and keep draft token s), and
    ``top1`` is position 1 alone; ``mean_accepted`` = sum over positions, the expected accepted tokens at k=levels.
    Exact for the run-time chain, teacher-forced on the target's tokens (a rejected token ends the chain)."""
    import torch
    from builder.distill.corpus import batches

    usable = [s for s in samples if s.features is not None and len(s.continuation) > 1]
    reached = np.zeros(levels)
    positions = 0
    with torch.no_grad():
        for batch in batches(usable, tokens_per_batch, shuffle=None):
            tokens, feats, mask = _batch(batch)
            outs = unrolled(draft, tokens, feats, mask, levels)
            best = [lg.argmax(-1).numpy() for _, lg in outs]
            if kept is not None:
                best = [kept[b] for b in best]
            for r, s in enumerate(batch):
                ids = np.asarray(s.ids)
                start, n = len(s.prompt) - 2, len(s.ids) - 1  # index i drafts token i+2: from the first continuation
                for i in range(max(start, 0), n - 1):
                    positions += 1
                    for lvl in range(levels):
                        j = i + lvl + 2
                        if j > n or best[lvl][r, i] != ids[j]:
                            break
                        reached[lvl] += 1
    rates = reached / max(positions, 1)
    return {
        "top1": round(float(rates[0]), 4),
        "per_position": [round(float(x), 4) for x in rates],
        "mean_accepted": round(float(rates.sum()), 3),
        "positions": positions,
    }
