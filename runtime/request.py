"""The decoding settings one request may carry, validated once into one typed object (``DecodeRequest``) that every
entry point passes down: the Python API, the CLI, the scheduler, the OpenAI server and the Triton model.

A pydantic model (strict types, frozen, unknown keys refused), so every caller gets the same rules and the same
messages, naming the field, what was expected and what was received. The bounds that depend on the bundle (k up to
its ``max_k``, a drafter that needs its draft engine) and compiling a response format are the generator's, on top.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from runtime.bundle import describe
from runtime.decoding.config import AdaptiveK, Fallback
from runtime.drafters.registry import DRAFTERS
from runtime.errors import RequestError

Seed = Optional[Union[int, list[Optional[int]]]]  # one for the batch, or one per prompt
MIN_TEMPERATURE = 1e-5  # smaller positive temperatures decode greedily (as vLLM's sampling epsilon)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


def check_text(value, field: str, error: type[Exception] = RequestError) -> None:
    """Text must be valid Unicode: a lone surrogate ("\\ud800", which JSON can carry) cannot be encoded as UTF-8,
    and a tokenizer or a detokenizer given one fails deep inside; say so at the door instead. ``value``: a string,
    or chat messages (every string in them)."""
    texts = (
        [value]
        if isinstance(value, str)
        else [v for m in value if isinstance(m, dict) for v in m.values() if isinstance(v, str)]
    )
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise error(
                f"{field + ': ' if field else ''}not valid Unicode text ({err.reason} at character "
                f"{err.start}); send UTF-8 without lone surrogates"
            ) from None


def invalid_text_path(value) -> tuple[str, str] | None:
    """(the dotted path of the first string, or key, in a JSON-like value that is not valid Unicode text, why) or
    None when every one is. A server walks each request body with it before using any field (a lone surrogate would
    fail whichever encoder meets it first: a grammar compiler, a tokenizer, a log line), so every such string is a
    400 naming where it is, ignored fields included. A loop, not recursion: the body is client input."""
    stack = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            why = _encoding_error(item)
            if why:
                return path, why
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                where = f"{path}.{_printable(key)}".lstrip(".")
                why = _encoding_error(key) if isinstance(key, str) else ""
                if why:
                    return where, why
                stack.append((where, child))
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{path}.{i}".lstrip("."), v) for i, v in reversed(list(enumerate(item))))
    return None


def _encoding_error(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"{err.reason} at character {err.start}"
    return ""


def _printable(key) -> str:
    """A key as a path segment that can itself be written as UTF-8 (a lone surrogate as its escape)."""
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


class DecodeRequest(BaseModel):
    """What to generate and how; ``decode_request`` makes one (or says every field that is wrong)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid", arbitrary_types_allowed=True)

    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)  # 0: greedy
    top_k: Optional[int] = Field(None, ge=0)  # None or 0: all tokens
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)  # None or 1: all
    seed: Seed = None
    k: Optional[int] = Field(None, ge=1)  # draft tokens per step; None: the bundle's default
    stop: Union[str, list[str], None] = None
    mode: Literal["speculative", "target"] = "speculative"
    drafter: Optional[str] = None  # a name in DRAFTERS; None: the bundle's
    draft_confidence: Optional[float] = Field(None, ge=0.0, lt=1.0, allow_inf_nan=False)  # None: the bundle's
    # OpenAI's {"type": "json_object" | "json_schema" | ...} or a runtime.decoding.grammar.Constraint; compiled by the
    # generator (its tokenizer's grammar compiler), which refuses what it cannot compile
    response_format: Any = None
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the n most likely tokens at each position
    adaptive: Union[bool, AdaptiveK, None] = None  # True: AdaptiveK up to the bundle's max_k
    fallback: Union[bool, Fallback, None] = None  # True: Fallback()
    forced_drafts: bool = True  # with a response_format: propose the tokens it forces without a draft call
    # over a batch: each step's draft lengths (0 included) planned from measured call costs and each row's
    # acceptance (runtime/decoding/step_costs.py); False: every row drafts k at every step
    plan: bool = True
    # a batch's target calls (Python API, bench): "exact" pads every row as its lone call would be, so each row is
    # bit for bit the request alone; "throughput" leaves them unpadded (cheaper; a quantized target's greedy answers
    # can then part from a lone run's at near ties). Servers take theirs from --policy.
    policy: Literal["exact", "throughput"] = "exact"

    @field_validator("drafter")
    @classmethod
    def _drafter_is_registered(cls, drafter):
        if drafter is not None and drafter not in DRAFTERS:
            raise ValueError(f"expected one of {DRAFTERS}, received {drafter!r}")
        return drafter

    @field_validator("seed")
    @classmethod
    def _seeds_are_not_negative(cls, seed):
        seeds = seed if isinstance(seed, list) else [seed]
        if any(s is not None and s < 0 for s in seeds):
            raise ValueError(f"expected integers >= 0, received {seed}")
        return seed

    @field_validator("temperature")
    @classmethod
    def _tiny_temperatures_are_greedy(cls, temperature):
        # logits / T overflows to inf (then NaN) for subnormal T; below MIN_TEMPERATURE sampling is greedy anyway
        return 0.0 if temperature < MIN_TEMPERATURE else temperature

    @field_validator("stop")
    @classmethod
    def _stops_are_not_empty(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        for s in stops:
            check_text(s, "", ValueError)
        return stop

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


def decode_request(**fields) -> DecodeRequest:
    """A DecodeRequest, or a RequestError saying every field that is wrong. NumPy scalars count as the Python
    numbers they hold (servers parse tensors)."""
    fields = {key: value.item() if isinstance(value, np.generic) else value for key, value in fields.items()}
    try:
        return DecodeRequest(**fields)
    except ValidationError as err:
        raise RequestError(describe(err, DecodeRequest)) from None
