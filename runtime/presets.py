"""Presets: YAML files of BuildSpec's field names (see configs/), plus ``out`` (where the bundle goes), ``distill``
(the draft's recipe) and an optional ``schema_version``.

Beside the spec they describe, on the light side, so ``build-engines`` and ``draftsmith distill`` read them the same
way without importing each other. The spec's own fields are validated when the BuildSpec is made (after the command
line's flags are merged in); the preset's other keys here, as strictly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from pydantic.dataclasses import dataclass

from runtime.bundle import STRICT, BuildSpec, SpecError, raising

PRESET_SCHEMA_VERSION = 1


@raising(SpecError)
@dataclass(frozen=True, config=STRICT)
class PresetKeys:
    """A preset's keys that are not BuildSpec fields."""

    out: str | None = None  # the bundle folder build-engines writes when --out is not given
    distill: dict[str, Any] | None = None  # `draftsmith distill --config` options (builder/distill/recipe.py)
    schema_version: Literal[1] = PRESET_SCHEMA_VERSION  # absent in older presets: the same schema


def load_preset(path: str | Path) -> dict:
    """The preset at ``path`` as a mapping (without ``schema_version``); SpecError when it cannot be read, is not a
    mapping, or has keys or values no preset may have."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise SpecError(f"cannot read config {path}: {err}") from None
    if not isinstance(data, dict):
        raise SpecError(f"config {path} must be a YAML mapping of build settings")
    spec_keys = {f.name for f in dataclasses.fields(BuildSpec)}
    own_keys = {f.name for f in dataclasses.fields(PresetKeys)}
    unknown = sorted(str(key) for key in data if key not in spec_keys | own_keys)
    if unknown:
        raise SpecError(f"config {path}: unknown keys {unknown}; known: {sorted(spec_keys | own_keys)}")
    try:
        PresetKeys(**{key: value for key, value in data.items() if key in own_keys})
    except SpecError as err:
        raise SpecError(f"config {path}: {err}") from None
    data.pop("schema_version", None)
    return data
