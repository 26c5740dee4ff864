"""config.pbtxt from typed data: a plain dict is parsed into Triton's ModelConfig protobuf, then printed.

Parsing first means a misspelt field, a wrong type or a missing value is an error at generation time, never a
leftover ``${placeholder}`` found by the server at load time.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A model configuration does not fit Triton's ModelConfig schema."""


def model_config(data: dict[str, Any]):
    """Parse ``data`` (ModelConfig's JSON form: field names as in config.pbtxt) into a ModelConfig message."""
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2

    missing = _missing_values(data)
    if missing:
        raise ConfigError(f"model config {data.get('name', '?')!r} has no value for: {', '.join(missing)}")
    try:
        return json_format.ParseDict(data, model_config_pb2.ModelConfig(), ignore_unknown_fields=False)
    except json_format.ParseError as err:
        raise ConfigError(f"model config {data.get('name', '?')!r}: {err}") from None


def render(data: dict[str, Any]) -> str:
    """config.pbtxt text for ``data``."""
    from google.protobuf import text_format

    return text_format.MessageToString(model_config(data))


def parse(text: str):
    """config.pbtxt text -> ModelConfig (what the tests and the server read back)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _missing_values(value: Any, path: str = "") -> list[str]:
    if value is None:
        return [path or "<root>"]
    if isinstance(value, str) and "${" in value:
        return [f"{path} (unfilled {value})"]
    if isinstance(value, dict):
        return [m for k, v in value.items() for m in _missing_values(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list):
        return [m for i, v in enumerate(value) for m in _missing_values(v, f"{path}[{i}]")]
    return []
