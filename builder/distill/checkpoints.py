"""A training run's checkpoint: the trained weights, the optimizer's state and where the run was, so a killed
distillation resumes its training where it stopped rather than from the start.

Written as safetensors (tensors only: loading it runs no code) plus a JSON file of the counters, each renamed into
place whole, the JSON last: a checkpoint whose JSON names it is complete. ``fingerprint`` says what it was trained
on and how (the data's and recipe's); one made for anything else is ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

WEIGHTS = "train_checkpoint.safetensors"
STATE = "train_checkpoint.json"


@dataclass
class Position:
    """Where a training run is: optimizer steps taken, the epoch and the batch within it, and the seconds trained
    (the learning-rate schedule runs over ``elapsed`` + the time left)."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    elapsed: float = 0.0


def save(folder: Path, fingerprint: dict, position: Position, params: dict, optimizer) -> None:
    """The named trainable ``params``, the AdamW state of each, torch's random state (the feature noise draws from
    it) and ``position``, into ``folder``."""
    import torch
    from safetensors.torch import save_file

    tensors = {f"param.{name}": p.detach().contiguous() for name, p in params.items()}
    tensors["torch_rng_state"] = torch.get_rng_state()
    steps = {}
    for name, p in params.items():
        state = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                tensors[f"{key}.{name}"] = state[key].contiguous()
        if "step" in state:
            steps[name] = float(state["step"])
    partial = folder / (WEIGHTS + ".partial")
    save_file(tensors, str(partial))
    os.replace(partial, folder / WEIGHTS)
    record = {"fingerprint": fingerprint, "position": asdict(position), "adam_steps": steps}
    partial = folder / (STATE + ".partial")
    partial.write_text(json.dumps(record), encoding="utf-8")
    os.replace(partial, folder / STATE)


def load(folder: Path, fingerprint: dict, params: dict, optimizer) -> Position | None:
    """Restore ``params`` and ``optimizer`` from ``folder``'s checkpoint made with ``fingerprint``; its position, or
    None (no checkpoint, another fingerprint, or one whose tensors do not fit: training starts afresh)."""
    import torch
    from safetensors.torch import load_file

    state_path, weights_path = folder / STATE, folder / WEIGHTS
    if not (state_path.is_file() and weights_path.is_file()):
        return None
    try:
        record = json.loads(state_path.read_text(encoding="utf-8"))
        if record.get("fingerprint") != json.loads(json.dumps(fingerprint)):
            return None
        position = Position(**record["position"])
        tensors = load_file(str(weights_path))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if any(tensors.get(f"param.{n}") is None or tensors[f"param.{n}"].shape != p.shape for n, p in params.items()):
        return None
    if "torch_rng_state" in tensors:
        torch.set_rng_state(tensors["torch_rng_state"])
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[f"param.{name}"])
            if f"exp_avg.{name}" in tensors and name in record.get("adam_steps", {}):
                optimizer.state[p] = {
                    "step": torch.tensor(record["adam_steps"][name]),
                    "exp_avg": tensors[f"exp_avg.{name}"].clone(),
                    "exp_avg_sq": tensors[f"exp_avg_sq.{name}"].clone(),
                }
    return position


def remove(folder: Path) -> None:
    """Drop the checkpoint (its draft is published)."""
    for name in (STATE, WEIGHTS):
        (folder / name).unlink(missing_ok=True)
