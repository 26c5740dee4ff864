"""Stage 4: greedy acceptance on held-out prompts, replayed.

Greedy acceptance is computed exactly by replaying the speculative loop on the target's greedy continuation of each
held-out prompt: a step drafts up to k tokens, keeps the run of them that matches the target's tokens (teacher-forced
draft argmax), and emits one target token more. It equals what greedy speculative decoding would accept, up to
rounding differences between torch and the exported engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from builder.distill.corpus import Sample, batches, pad
from builder.distill.draft import head_weight, hidden_states

ACCEPTANCE_KS = (1, 2, 3, 4, 6, 8)


@dataclass
class Acceptance:
    top1: float  # teacher-forced top-1 agreement with the target's tokens over continuation positions
    positions: int
    greedy: dict = field(default_factory=dict)  # k -> {"acceptance", "tokens_per_step", "alpha"}

    def to_dict(self) -> dict:
        return {
            "top1_agreement": round(self.top1, 4),
            "positions": self.positions,
            "greedy": {str(k): v for k, v in self.greedy.items()},
        }


def draft_argmax(draft, samples: list[Sample], kept: np.ndarray | None, tokens_per_batch: int = 1024) -> list:
    """Teacher-forced draft argmax (full-vocabulary ids) at every next-token position of each sample."""
    import torch

    out = {}
    with torch.no_grad():
        weight = head_weight(draft, kept)
        for batch in batches(samples, tokens_per_batch, shuffle=None):
            ids, mask = pad([s.ids for s in batch])
            hidden = hidden_states(draft, ids, mask)
            best = (hidden @ weight.T).argmax(-1).numpy()
            if kept is not None:
                best = kept[best]
            for r, s in enumerate(batch):
                out[id(s)] = best[r, : len(s.ids) - 1]
    return [out[id(s)] for s in samples]


def acceptance(draft, samples: list[Sample], kept: np.ndarray | None = None, ks=ACCEPTANCE_KS) -> Acceptance:
    """Greedy acceptance on the target's greedy continuations, replayed exactly (see the module docstring)."""
    predictions = draft_argmax(draft, samples, kept)
    matches = []
    for s, pred in zip(samples, predictions):
        start = len(s.prompt) - 1  # position whose next token is the first continuation token
        want = np.asarray(s.continuation, np.int64)
        matches.append(pred[start : start + len(want)] == want)
    total = sum(len(m) for m in matches)
    top1 = float(sum(int(m.sum()) for m in matches) / total) if total else 0.0
    return Acceptance(top1, total, {k: replay(matches, k) for k in ks})


def replay(matches: list[np.ndarray], k: int) -> dict:
    """Greedy speculative decoding replayed over per-position matches (draft argmax == target token) of the target's
    continuations: each step drafts up to k tokens (leaving room for the target's own), keeps the matching run and
    emits one target token more. alpha[i]: the share of steps that reached draft position i and had it accepted."""
    drafted = accepted = steps = emitted = 0
    tried, kept_at = np.zeros(k), np.zeros(k)
    for m in matches:
        pos = 0
        while pos < len(m):
            d = min(k, len(m) - pos - 1)
            n = 0
            while n < d and m[pos + n]:
                n += 1
            tried[: min(d, n + 1)] += 1
            kept_at[:n] += 1
            drafted, accepted, steps, emitted = drafted + d, accepted + n, steps + 1, emitted + n + 1
            pos += n + 1
    return {
        "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
        "tokens_per_step": round(emitted / steps, 3) if steps else 0.0,
        "alpha": [round(float(a), 4) for a in kept_at / np.maximum(tried, 1)],
    }
