"""The OpenAI API's request and response bodies as pydantic models, and this server's bounds on them.

Requests are strict: an unknown field is a 400 (OpenAI's own behaviour), so a client never believes a setting took
effect when it did not. OpenAI fields we do not implement come in two kinds: harmless ones (``user``, ``metadata``,
``store``, ...) are accepted and ignored; ones that would change the output (``logprobs``, ``logit_bias``, penalties,
``tools``, ``echo``, ``best_of`` ...) are accepted only at their neutral value, otherwise a 400 names them.
Extensions: ``top_k`` (0 or -1: off) and ``num_draft_tokens`` (draft tokens per step, 0: target only).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

# The scheduler's finish reasons in OpenAI's terms. A timeout (the server's request deadline) truncates the text as a
# token budget does: "length". "cancelled" is reached only when the client went away, so nobody should see it; if a
# response ever carries it, it says "abort" as vLLM does.
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length", "timeout": "length", "cancelled": "abort"}

PROMPT_BYTES_PER_TOKEN = 32  # as the Triton repository: a longer prompt cannot fit the context, refused untokenized


@dataclass(frozen=True)
class Limits:
    """Per-request bounds, checked before any tokenizing (0: derived from the bundle's context by ``for_context``)."""

    max_tokens_limit: int  # largest max_tokens; also the default for chat, where OpenAI's is "up to the context"
    max_prompt_bytes: int  # a prompt (all message contents together) in UTF-8 bytes
    max_stop_words: int = 16  # stop strings per request: each one is searched at every step
    max_stop_word_bytes: int = 256
    max_body_bytes: int = 0  # an HTTP request body

    @classmethod
    def for_context(cls, max_context: int, **given: int) -> "Limits":
        chosen = {name: value for name, value in given.items() if value}
        prompt_bytes = chosen.get("max_prompt_bytes", PROMPT_BYTES_PER_TOKEN * max_context)
        limits = cls(**{"max_tokens_limit": max_context - 1, "max_prompt_bytes": prompt_bytes,
                        "max_body_bytes": 4 * prompt_bytes + 65536, **chosen})
        if not 1 <= limits.max_tokens_limit < max_context:
            raise ValueError(f"max_tokens_limit: expected an integer in [1, {max_context - 1}] (the bundle's context "
                             f"is {max_context}), received {limits.max_tokens_limit}")
        return limits


# OpenAI fields that would change the output, which this server does not implement: the values that change nothing,
# the only ones accepted (anything else is a 400 naming the field).
NEUTRAL: dict[str, tuple] = {
    "best_of": (None, 1), "echo": (None, False), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "logit_bias": (None, {}), "logprobs": (None, False), "top_logprobs": (None, 0), "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]), "audio": (None,),
    "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
}


def _neutral(name: str, value: Any) -> Any:
    neutral = NEUTRAL[name]
    if value not in neutral:
        raise ValueError(f"{name} is not supported by this server (only {' or '.join(map(repr, neutral))}); "
                         "remove it from the request")
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

    def options(self, default_max_tokens: int) -> dict:
        """Keyword arguments for Scheduler.submit (limits are checked by ``check``)."""
        k = self.num_draft_tokens
        return dict(max_new_tokens=self.max_tokens_value or default_max_tokens,
                    temperature=1.0 if self.temperature is None else self.temperature,
                    top_k=self.top_k if self.top_k and self.top_k > 0 else None,
                    top_p=None if self.top_p in (None, 1) else self.top_p, seed=self.seed, stop=self.stop,
                    k=k or None, mode="target" if k == 0 else "speculative")

    @property
    def max_tokens_value(self) -> int | None:
        return getattr(self, "max_tokens", None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check(self, limits: Limits, prompt_bytes: int) -> list[tuple[str, str]]:
        """(param, message) for every bound this request exceeds."""
        problems = []
        if prompt_bytes > limits.max_prompt_bytes:
            problems.append((self.prompt_field, f"the prompt is {prompt_bytes} bytes; this server's limit is "
                                                f"{limits.max_prompt_bytes}. Shorten it"))
        max_tokens = self.max_tokens_value
        if max_tokens is not None and max_tokens > limits.max_tokens_limit:
            name = "max_completion_tokens" if getattr(self, "max_completion_tokens", None) else "max_tokens"
            problems.append((name, f"{name} is {max_tokens}; this server allows at most {limits.max_tokens_limit} "
                                   "(prompt and completion share the model's context)"))
        if len(self.stop) > limits.max_stop_words:
            problems.append(("stop", f"{len(self.stop)} stop strings; this server's limit is "
                                     f"{limits.max_stop_words}"))
        longest = max((len(s.encode()) for s in self.stop), default=0)
        if longest > limits.max_stop_word_bytes:
            problems.append(("stop", f"a stop string of {longest} bytes; this server's limit is "
                                     f"{limits.max_stop_word_bytes}"))
        if self.stream_options is not None and not self.stream:
            problems.append(("stream_options", "stream_options is only allowed with stream=true"))
        return problems


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: Any = Field(description="a string (or a list holding one string)")
    max_tokens: int | None = Field(16, ge=1, description="OpenAI's default: 16")
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None

    prompt_field: ClassVar[str] = "prompt"

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt) -> str:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("expected a non-empty string; lists of several prompts and token-id arrays are not "
                             "supported (send one request per prompt, as text)")
        return prompt

    def prompt_bytes(self) -> int:
        return len(self.prompt.encode())


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


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name; wins over max_tokens")
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    response_format: dict | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    # harmless, ignored
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    prompt_field: ClassVar[str] = "messages"

    @property
    def max_tokens_value(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def plain_messages(self) -> list[dict]:
        return [m.plain() for m in self.messages]

    def prompt_bytes(self) -> int:
        return sum(len(m["content"].encode()) for m in self.plain_messages())


# --- responses ---------------------------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(_Response):
    """A completion, or one chunk of a streamed one (the same object; a chunk's usage is null or absent)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """OpenAI sends only what a chunk adds: {"role", "content"} first, then {"content"}, and {} with the finish."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _present(self, handler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
