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
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state of each parameter, beside its step count


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
        for key in MOMENTS:
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
        restored = _restored(load_file(str(weights_path)), record.get("adam_steps", {}), params)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(restored[f"param.{name}"])
            if f"step.{name}" in restored:
                optimizer.state[p] = {key: restored[f"{key}.{name}"].clone() for key in ("step", *MOMENTS)}
    if "torch_rng_state" in restored:
        torch.set_rng_state(restored["torch_rng_state"])
    return position


def _restored(tensors: dict, steps: dict, params: dict) -> dict:
    """What ``load`` restores, by key, each checked against what it goes into before anything is changed (KeyError,
    ValueError or TypeError otherwise): every parameter; its AdamW state where the record counts steps for it (both
    moments of the parameter's shape and type: AdamW would fail at its first step on any other); torch's random
    state where it is one."""
    import torch

    out = {}
    for name, p in params.items():
        keys = [f"param.{name}"] + ([f"{moment}.{name}" for moment in MOMENTS] if name in steps else [])
        for key in keys:
            if tensors[key].shape != p.shape or tensors[key].dtype != p.dtype:
                raise ValueError(f"{key}: {list(tensors[key].shape)} {tensors[key].dtype}, not {list(p.shape)}")
            out[key] = tensors[key]
        if name in steps:
            out[f"step.{name}"] = torch.tensor(float(steps[name]))
    state = tensors.get("torch_rng_state")
    if state is not None:
        if state.dtype != torch.uint8 or state.shape != torch.get_rng_state().shape:
            raise ValueError("torch_rng_state is not a random state of this torch")
        out["torch_rng_state"] = state
    return out


def remove(folder: Path) -> None:
    """Drop the checkpoint (its draft is published)."""
    for name in (STATE, WEIGHTS):
        (folder / name).unlink(missing_ok=True)
