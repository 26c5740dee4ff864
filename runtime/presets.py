"""Presets: YAML files of BuildSpec's field names (see configs/), plus ``out`` (where the bundle goes) and
``distill`` (the draft's recipe).

Beside the spec they describe, on the light side, so ``build-engines`` and ``draftsmith distill`` read them the same
way without importing each other.
"""

from __future__ import annotations

from pathlib import Path

from runtime.bundle import SpecError


def load_preset(path: str | Path) -> dict:
    """The preset at ``path`` as a mapping; SpecError when it cannot be read or is not a mapping."""
    import yaml
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise SpecError(f"cannot read config {path}: {err}") from None
    if not isinstance(data, dict):
        raise SpecError(f"config {path} must be a YAML mapping of build settings")
    return data
