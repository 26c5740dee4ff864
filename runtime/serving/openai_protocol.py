"""The OpenAI API's request and response bodies as pydantic models, and this server's bounds on them.

Requests are strict: an unknown field is a 400 (OpenAI's own behaviour), so a client never believes a setting took
effect when it did not. OpenAI fields we do not implement come in two kinds: harmless ones (``user``, ``metadata``,
``store``, ...) are accepted and ignored; ones that would change the output (``logit_bias``, penalties, ``echo``,
``best_of`` ...) are accepted only at their neutral value, otherwise a 400 names them.

Structured output (runtime/decoding/grammar.py), exact under speculation: ``response_format`` (``json_object``,
``json_schema``; on completions too, as vLLM), ``tools`` with ``tool_choice`` "required" or a named function (the
output is constrained to the tool's parameter schema and returned as ``tool_calls``; "auto" is refused: no chat
template this server renders takes tools, and free-form tool calls are not parsed). ``logprobs``: the target's own
log-probabilities of the emitted tokens (before temperature, top-k/top-p and the grammar's mask), in streamed chunks
too. Extensions: ``top_k`` (0 or -1: off), ``num_draft_tokens`` (draft tokens per step, 0: target only) and the
response formats ``{"type": "regex", "regex": ...}`` and ``{"type": "grammar", "grammar": LARK}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runtime.core.request import Asked

# The scheduler's finish reasons in OpenAI's terms. A timeout (the server's --request-timeout) is "timeout": not
# "length", which a client reads as its own max_tokens (and would not retry differently); OpenAI's clients keep a
# finish_reason they do not know as its string. "cancelled" is reached only when the client went away, so nobody
# should see it; if a response ever carries it, it says "abort" as vLLM does.
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length", "timeout": "timeout", "cancelled": "abort"}

# OpenAI fields that would change the output, which this server does not implement: the values that change nothing,
# the only ones accepted (anything else is a 400 naming the field).
NEUTRAL: dict[str, tuple] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}


# OpenAI's bounds on ``metadata``, which this server ignores: checked before anything walks it
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def bounded_metadata(metadata: Any) -> Any:
    """``metadata`` as OpenAI takes it (at most 16 pairs of strings, keys up to 64 characters, values up to 512),
    refused otherwise before pydantic reads any of it: the server ignores it, so nothing else bounds it."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise ValueError(f"expected an object of string values, received {type(metadata).__name__}")
    if len(metadata) > METADATA_KEYS:
        raise ValueError(f"{len(metadata)} keys; at most {METADATA_KEYS}")
    for key, value in metadata.items():
        if not isinstance(key, str) or len(key) > METADATA_KEY_CHARS:
            raise ValueError(f"keys are strings of at most {METADATA_KEY_CHARS} characters, received {key!r:.80}")
        if not isinstance(value, str) or len(value) > METADATA_VALUE_CHARS:
            kind = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
            raise ValueError(
                f"{key!r}: values are strings of at most {METADATA_VALUE_CHARS} characters, received {kind}"
            )
    return metadata


def _neutral(name: str, value: Any) -> Any:
    neutral = NEUTRAL[name]
    if value not in neutral:
        raise ValueError(
            f"{name} is not supported by this server (only {' or '.join(map(repr, neutral))}); "
            "remove it from the request"
        )
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the usage and no choices


class SamplingRequest(_Strict):
    """What completions and chat completions share."""

    model: str
    temperature: float | None = Field(None, ge=0, le=2, description="OpenAI's default 1; 0: greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="extension (vLLM's): 0 or -1 turn it off")
    seed: int | None = Field(None, ge=0, description="with temperature > 0, the same text whatever else runs")
    stop: str | list[str] | None = Field(None, validate_default=True, description="at most max_stop_words")
    n: int = Field(1, description="choices per request; only 1")
    stream: bool = False
    stream_options: StreamOptions | None = None
    num_draft_tokens: int | None = Field(None, ge=0, description="extension: draft tokens per step; 0: target only")
    response_format: dict | None = Field(None, description="text, json_object, json_schema (+ regex, grammar)")
    # harmless OpenAI fields, ignored
    user: str | None = None
    # output-changing OpenAI fields, accepted at their neutral value only (NEUTRAL)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, received {n}; send n separate requests instead")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator(*NEUTRAL, check_fields=False)
    @classmethod
    def _unsupported(cls, value, info):
        return _neutral(info.field_name, value)

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, options, info):
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream=true")
        return options

    def asked(self, prompt, chat: bool) -> Asked:
        """This body in the front door's names (runtime/core/request.py), in OpenAI's defaults (temperature 1; top_k 0
        or -1 and top_p 1 off; num_draft_tokens 0 target-only): names mapped, nothing checked."""
        k = self.num_draft_tokens
        fields = dict(
            max_new_tokens=self.max_tokens_value,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k if self.top_k and self.top_k > 0 else None,
            top_p=None if self.top_p in (None, 1) else self.top_p,
            seed=self.seed,
            stop=self.stop,
            k=k or None,
            mode="target" if k == 0 else "speculative",
            response_format=self.constraint_format(),
            logprobs=self.logprobs_count,
        )
        names = {
            "max_new_tokens": self.max_tokens_field,
            "k": "num_draft_tokens",
            "response_format": self.constraint_field,
        }
        fields = {key: value for key, value in fields.items() if value is not None}
        # the body itself: dumped where checked, off the loop; chat logprobs carry each token's bytes
        return Asked([prompt], fields, chat, self, names, token_bytes=chat)

    def constraint_format(self):
        """What constrains the output: a response_format (None: free text)."""
        return self.response_format

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"

    @property
    def logprobs_count(self) -> int | None:
        """None: no log-probabilities; n >= 0: each token's, with the n most likely at each position."""
        return None

    @property
    def constraint_field(self) -> str:
        """The field an error of the output's constraint names (``param``)."""
        return "response_format"

    @property
    def max_tokens_value(self) -> int | None:
        return getattr(self, "max_tokens", None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: Any = Field(description="a string (or a list holding one string)")
    max_tokens: int | None = Field(16, ge=1, description="OpenAI's default: 16")
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5, description="the n most likely tokens at each position (0-5)")
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt) -> str:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(
                "expected a non-empty string; lists of several prompts and token-id arrays are not "
                "supported (send one request per prompt, as text)"
            )
        return prompt

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # ignored: chat templates have no place for it

    def plain(self) -> dict:
        """{"role", "content"} for the chat template; "developer" is OpenAI's newer name for "system"."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema; absent: no arguments
    strict: bool | None = None  # every call is constrained to the schema either way

    def parameters_schema(self) -> dict:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class _ChosenFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _ChosenFunction


@dataclass(frozen=True)
class ToolMode:
    """A forced function call: ``named`` (the output is that tool's arguments) or any of ``tools`` (the output is
    ``{"name": ..., "arguments": {...}}``, one of them)."""

    tools: dict[str, dict]  # name: parameter schema
    named: str | None = None

    def constraint(self) -> dict:
        """The output's constraint as a response_format (compiled at the front door like any other)."""
        if self.named is not None:
            schema = self.tools[self.named]
        else:
            schema = {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": name}, "arguments": schema},
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    }
                    for name, schema in self.tools.items()
                ]
            }
        return {"type": "json_schema", "json_schema": {"schema": schema}}


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name; wins over max_tokens")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: the n most likely (0-20)")
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list | None = None
    function_call: Any = None
    response_format: dict | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    # harmless, ignored
    metadata: dict[str, str] | None = None  # bounded as OpenAI bounds it (bounded_metadata)
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("metadata", mode="before")
    @classmethod
    def _bounded_metadata(cls, metadata):
        return bounded_metadata(metadata)

    @model_validator(mode="after")
    def _tools_and_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        choice = self.tool_choice
        if self.tools and choice in (None, "auto"):
            raise ValueError(
                "tool_choice 'auto' (the default when tools are given) is not supported: this server "
                "renders no tools into the chat template and does not parse free-form tool calls. "
                "Send tool_choice 'required' or {'type': 'function', 'function': {'name': ...}}: the "
                "output is then constrained to the tool's parameters"
            )
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        return self

    @property
    def max_tokens_value(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_mode(self) -> "ToolMode | None":
        """The function call the output must be (None: plain content)."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return None
        tools = {t.function.name: t.function.parameters_schema() for t in self.tools}
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            return ToolMode({name: tools[name]}, named=name)
        return ToolMode(tools)

    def constraint_format(self):
        mode = self.tool_mode
        return self.response_format if mode is None else mode.constraint()

    @property
    def constraint_field(self) -> str:
        return "response_format" if self.tool_mode is None else "tools"

    def plain_messages(self) -> list[dict]:
        return [m.plain() for m in self.messages]
