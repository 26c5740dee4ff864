"""The OpenAI API's response bodies (completions, chat completions, their streamed chunks, log-probabilities, tool
calls and errors) as pydantic models, and ``ResponseShape``, which turns a runtime Generation into them. The request
bodies and the server's bounds are in runtime/serving/openai_protocol.py."""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field, model_serializer

from runtime.serving.openai_protocol import FINISH_REASONS, SamplingRequest, ToolMode


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists over the choice's tokens."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(tokenizer, tokens: list[int], logprobs: list[float], tops: list[list]) -> ChatLogprobs:
    """OpenAI's chat ``logprobs`` object for tokens and their (target's) log-probabilities."""

    def entry(token: int, logprob: float) -> dict:
        return {"token": token_text(tokenizer, token), "logprob": logprob, "bytes": list(tokenizer.token_bytes(token))}

    return ChatLogprobs(
        content=[
            TokenLogprob(**entry(t, lp), top_logprobs=[TopLogprob(**entry(u, v)) for u, v in top])
            for t, lp, top in zip(tokens, logprobs, tops)
        ]
    )


def completion_logprobs(
    tokenizer, tokens: list[int], logprobs: list[float], tops: list[list], top: int, offset: int = 0
) -> CompletionLogprobs:
    """OpenAI's completions ``logprobs`` object; ``offset``: the text length before these tokens."""
    texts = [token_text(tokenizer, t) for t in tokens]
    offsets = list(offset + np.cumsum([0] + [len(t) for t in texts[:-1]])) if texts else []
    return CompletionLogprobs(
        tokens=texts,
        token_logprobs=list(logprobs),
        text_offset=[int(o) for o in offsets],
        top_logprobs=[{token_text(tokenizer, u): v for u, v in row} for row in tops] if top else None,
    )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Response):
    """A completion, or one chunk of a streamed one (the same object; a chunk's usage is null or absent)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCall):
    index: int = 0


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _present(self, handler) -> dict:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _present(self, handler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
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


@dataclass
class ResponseShape:
    """What a request's choices carry besides text: log-probabilities (``logprobs``: None or the top count) and a
    forced tool call (``tool``: the content is then the call's JSON, returned as ``tool_calls``)."""

    chat: bool
    tokenizer: Any
    logprobs: int | None = None
    tool: ToolMode | None = None
    call_id: str = ""
    text_sent: int = 0  # completions' text_offset: characters already streamed

    @classmethod
    def of(cls, body: SamplingRequest, chat: bool, tokenizer) -> "ResponseShape":
        return cls(chat, tokenizer, body.logprobs_count, getattr(body, "tool_mode", None), new_id("call"))

    def reason(self, g) -> str:
        reason = FINISH_REASONS.get(g.finish_reason, "stop")
        return "tool_calls" if self.tool is not None and reason == "stop" else reason

    def choice(self, g) -> "ChatChoice | CompletionChoice":
        """The whole answer's choice, from a runtime.core.handles.Generation."""
        logprobs = self._logprobs(g.token_ids, g.logprobs, g.top_logprobs, 0)
        if not self.chat:
            return CompletionChoice(text=g.text, finish_reason=self.reason(g), logprobs=logprobs)
        calls = tool_calls(self.tool, g.text, self.call_id) if self.tool is not None else None
        message = (
            AssistantMessage(content=None, tool_calls=calls) if calls is not None else AssistantMessage(content=g.text)
        )
        return ChatChoice(message=message, finish_reason=self.reason(g), logprobs=logprobs)

    def chunk(
        self, text: str, token_ids: list[int], logprobs, tops, reason: str | None = None, final=None
    ) -> "ChunkChoice | CompletionChoice | None":
        """A streamed chunk's choice (None: nothing to send). A tool call's arguments are sent whole, with the
        final chunk (``final``: the Generation)."""
        lp = self._logprobs(token_ids, logprobs, tops, self.text_sent)
        self.text_sent += len(text)
        if not self.chat:
            return CompletionChoice(text=text, finish_reason=reason, logprobs=lp)
        if self.tool is None:
            return ChunkChoice(delta=Delta(content=text or None), finish_reason=reason, logprobs=lp)
        if final is None:
            return ChunkChoice(delta=Delta(), logprobs=lp) if lp is not None and lp.content else None
        calls = tool_calls(self.tool, final.text, self.call_id)
        delta = (
            Delta(tool_calls=[ToolCallDelta(**call.model_dump()) for call in calls])
            if calls
            else Delta(content=final.text or None)
        )
        return ChunkChoice(delta=delta, finish_reason=reason, logprobs=lp)

    def _logprobs(self, tokens, logprobs, tops, offset: int):
        if self.logprobs is None or logprobs is None:
            return None
        tokens = list(tokens)[: len(logprobs)]
        if self.chat:
            return chat_logprobs(self.tokenizer, tokens, logprobs, tops)
        return completion_logprobs(self.tokenizer, tokens, logprobs, tops, self.logprobs, offset)


def tool_calls(tool: ToolMode, text: str, call_id: str) -> list["ToolCall"] | None:
    """The tool call in a constrained answer; None when the answer is incomplete (cut by max_tokens).

    The answer is JSON the grammar allowed, which may nest deeper than Python's json can parse or write (a schema
    of ``{"type": "object"}`` allows any depth, and a model can emit a thousand ``{"a": ``): then the arguments are
    the answer's own text (``raw_tool_call``), never a RecursionError."""
    try:
        value = json.loads(text)
    except RecursionError:
        return raw_tool_call(tool, text, call_id)
    except ValueError:
        return None
    if tool.named is not None:
        name, arguments = tool.named, value
    elif isinstance(value, dict) and set(value) == {"name", "arguments"}:
        name, arguments = value["name"], value["arguments"]
    else:
        return None
    try:
        arguments = json.dumps(arguments, ensure_ascii=False, separators=(", ", ": "))
    except RecursionError:
        return raw_tool_call(tool, text, call_id)
    return [ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))]


_WRAPPED_CALL = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": (.*)\}', re.DOTALL)


def raw_tool_call(tool: ToolMode, text: str, call_id: str) -> list["ToolCall"] | None:
    """The tool call of an answer too deep to parse, read from its text: the grammar writes it in one layout
    (``ToolMode.constraint``: ``{"name": ..., "arguments": ...}`` in that order, JSON_OPTIONS' separators), so the
    arguments are the text itself (a named tool) or what follows ``"arguments": `` up to the closing brace. None when
    the text is not complete JSON (its brackets unbalanced: cut by max_tokens)."""
    text = text.strip()
    if not balanced_json(text):
        return None
    if tool.named is not None:
        return [ToolCall(id=call_id, function=FunctionCall(name=tool.named, arguments=text))]
    match = _WRAPPED_CALL.fullmatch(text)
    if match is None:
        return None
    name = json.loads(match.group(1))
    if name not in tool.tools:
        return None
    return [ToolCall(id=call_id, function=FunctionCall(name=name, arguments=match.group(2)))]


def balanced_json(text: str) -> bool:
    """Whether every bracket of a JSON text outside its strings is closed, and nothing is closed twice (a loop, not
    a parser: any depth)."""
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
            continue
        if char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0 and not in_string
