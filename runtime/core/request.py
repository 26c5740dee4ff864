"""The front door: a request admitted once, the same way for every entry point (the Python API, the CLI, the OpenAI
server, the Triton model), as vLLM's ``Processor.process_inputs`` does for its offline ``LLM`` and its server alike.

``DecodeRequest`` holds the decoding settings one request may carry, validated once (a pydantic model: strict
types, frozen, unknown keys refused), so every caller gets the same rules and the same messages, naming the field,
what was expected and what was received. ``Limits`` are a server's bounds, checked before any work. ``FrontDoor``
does the rest on a bundle: the response format compiled, the prompt's text checked and tokenized, the bundle's
bounds (k up to its ``max_k``, the context), the drafter made, into one ``Admitted`` that the scheduler runs. A
protocol (runtime/serving/openai_protocol.py, the Triton model) only maps its own names to these and back
(``renamed``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from runtime.bundle import describe
from runtime.decoding.config import AdaptiveK, DecodeConfig, Fallback
from runtime.decoding.grammar import CompiledGrammar
from runtime.decoding.sampling import SamplingParams
from runtime.decoding.drafter import Drafter
from runtime.drafter_names import DRAFTERS
from runtime.errors import RequestError
from runtime.core.loaded import LoadedBundle
from runtime.text.sent_text import check_sent_text, check_text
from runtime.text.stop_matcher import stop_automaton

Seed = Optional[Union[int, list[Optional[int]]]]  # one for the batch, or one per prompt
MIN_TEMPERATURE = 1e-5  # smaller positive temperatures decode greedily (as vLLM's sampling epsilon)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


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
        where = err.errors()[0]["loc"]
        raise RequestError(describe(err, DecodeRequest), str(where[0]) if where else None) from None


def merged_request(request: DecodeRequest | None, options: dict) -> DecodeRequest:
    """``request`` with ``options`` on top, validated (RequestError naming every wrong field); options alone when
    there is no request."""
    if request is None:
        return decode_request(**options)
    if not isinstance(request, DecodeRequest):
        raise RequestError(f"request: expected a runtime.core.request.DecodeRequest, received {type(request).__name__}")
    given = {name: getattr(request, name) for name in request.model_fields_set}
    return decode_request(**{**given, **options}) if options else request


def renamed(message: str, names: dict[str, str], form: str = "{}") -> str:
    """A front-door message (``field: why; field: why``) in a protocol's own names: ``names`` maps DecodeRequest's
    (max_new_tokens, k, stop, prompt, ...) to the protocol's, ``form`` writes one (the Triton model's "input '{}'")."""

    def one(match: re.Match) -> str:
        return f"{match.group(1)}{form.format(names.get(match.group(2), match.group(2)))}:"

    return re.sub(r"(^|; )(\w+):", one, message)


# --- bounds: what a server lets a request ask for, checked before any work ------------------------------------------

PROMPT_BYTES_PER_TOKEN = 32  # a prompt longer than this many bytes per context token cannot fit: refused untokenized
MESSAGE_BYTES = 16  # what one chat message counts for beyond its content (its role and the template's markers)
MAX_BODY_BYTES = 16 << 20  # whatever the context: an HTTP body is read whole before it is parsed


@dataclass(frozen=True)
class Limits:
    """A server's per-request bounds, every one checked before any decoding, template rendering or tokenizing
    (``check``); both servers take theirs from ``for_context`` (0: derived from the bundle's context)."""

    max_tokens_limit: int  # largest max_new_tokens; also the default where a protocol's is "up to the context"
    max_prompt_bytes: int  # a prompt (all message contents together) in UTF-8 bytes
    max_stop_words: int = 16  # stop strings per request: each one is searched at every step
    max_stop_word_bytes: int = 256
    max_body_bytes: int = 0  # an HTTP request body (the OpenAI server's)

    @classmethod
    def for_context(cls, max_context: int, **given: int) -> "Limits":
        chosen = {name: value for name, value in given.items() if value}
        prompt_bytes = chosen.get("max_prompt_bytes", PROMPT_BYTES_PER_TOKEN * max_context)
        limits = cls(
            **{
                "max_tokens_limit": max_context - 1,
                "max_prompt_bytes": prompt_bytes,
                "max_body_bytes": min(4 * prompt_bytes + 65536, MAX_BODY_BYTES),
                **chosen,
            }
        )
        if not 1 <= limits.max_tokens_limit < max_context:
            raise ValueError(
                f"max_tokens_limit: expected an integer in [1, {max_context - 1}] (the bundle's context "
                f"is {max_context}), received {limits.max_tokens_limit}"
            )
        return limits

    def check(
        self, prompt_bytes: int, max_new_tokens: int | None, stop_sizes: Sequence[int], prompt_field: str = "prompt"
    ) -> None:
        """RequestError naming every bound the request passes (sizes only: nothing is decoded or tokenized yet);
        its ``field`` is the first of them."""
        problems = []
        if prompt_bytes > self.max_prompt_bytes:
            problems.append(
                (
                    prompt_field,
                    f"{prompt_bytes} bytes; this server's limit is max_prompt_bytes={self.max_prompt_bytes}; "
                    "shorten it",
                )
            )
        if max_new_tokens is not None and not 1 <= max_new_tokens <= self.max_tokens_limit:
            problems.append(
                (
                    "max_new_tokens",
                    f"expected an integer in [1, {self.max_tokens_limit}] (this server's max_tokens_limit: prompt "
                    f"and completion share the model's context), received {max_new_tokens}",
                )
            )
        if len(stop_sizes) > self.max_stop_words:
            problems.append(
                ("stop", f"{len(stop_sizes)} stop strings; the limit is max_stop_words={self.max_stop_words}")
            )
        longest = max(stop_sizes, default=0)
        if longest > self.max_stop_word_bytes:
            problems.append(
                ("stop", f"one of {longest} bytes; the limit is max_stop_word_bytes={self.max_stop_word_bytes}")
            )
        if problems:
            raise RequestError("; ".join(f"{field}: {why}" for field, why in problems), problems[0][0])


def as_text(value, field: str) -> str:
    """Text from a string or raw UTF-8 bytes (a tensor's), RequestError naming ``field`` when they are not UTF-8;
    chat messages as they are."""
    if not isinstance(value, (bytes, bytearray)):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestError(f"{field}: not valid UTF-8 ({err.reason} at byte {err.start})", field) from None


def text_bytes(value) -> int:
    """A prompt's size in UTF-8 bytes, without decoding raw bytes: a string, bytes, or chat messages (their contents,
    plus MESSAGE_BYTES each: ten thousand empty messages are not an empty prompt, each costs the template a turn)."""
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, str):
        return len(value.encode(errors="replace"))  # a lone surrogate is refused later, with its own message
    return sum(text_bytes(m.get("content", "")) + MESSAGE_BYTES for m in value if isinstance(m, dict))


# --- the door --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Admitted:
    """A request through the front door: what the scheduler runs (runtime/core/scheduler.py)."""

    prompts: list[list[int]]  # token ids, one list per sequence (a server's request: one)
    config: DecodeConfig
    stops: tuple[str, ...]
    drafter: Drafter | None  # the drafter of all its sequences (one call drafts them all), made here once
    drafter_name: str  # its kind ("" without one): the label of its acceptance metrics


@dataclass(frozen=True)
class Asked:
    """A request as a protocol hands it to the front door, in the door's names: nothing checked yet.

    ``prompt``: text, raw UTF-8 bytes (a tensor's) or with ``chat`` {"role", "content"} messages; ``fields``: the
    DecodeRequest's fields the request set (``stop`` may hold raw bytes; no ``max_new_tokens``: the server's
    ``max_tokens_limit``); ``sent``: everything the client sent, as JSON-like data, every string of which must be
    valid text (None: the prompt and stops only; a pydantic model: the body it was parsed into, dumped only where
    checked); ``names`` and ``form``: the protocol's words for the door's fields
    (``FrontDoor.refusal``)."""

    prompt: Any
    fields: dict
    chat: bool = False
    sent: Any = None
    names: dict = field(default_factory=dict)
    form: str = "{}"

    @property
    def prompt_field(self) -> str:
        return "messages" if self.chat else "prompt"


class FrontDoor:
    """Admits requests to one bundle, the same way for the Python API, the OpenAI server and the Triton model: a
    protocol maps its own names to a DecodeRequest and calls, in order, ``limits.check`` (servers: bounds before
    work), ``compile`` (a response format; a server runs it on a pool of its own) and ``admit`` (the prompt's text,
    its tokens, the bundle's bounds, the drafter)."""

    def __init__(self, bundle: LoadedBundle, limits: Limits | None = None):
        """``limits`` None: no server bounds (the Python API's caller is trusted with its own process)."""
        self.bundle, self.limits = bundle, limits

    def checked(self, asked: Asked) -> DecodeRequest:
        """A server's request through its checks, before any work: the prompt's and stops' sizes within
        ``limits`` (cheap: sizes only), every string it sent valid text, then its DecodeRequest (uncompiled:
        ``compile`` next, then ``admit``, which checks the prompt's text as it tokenizes it: once). Its cost is the
        body's size: a server runs it off its event loop.
        RequestError naming the field at fault (``refusal`` words it in the protocol's names)."""
        fields = dict(asked.fields)
        stops = fields.get("stop") or []
        stops = [stops] if isinstance(stops, (str, bytes)) else list(stops)
        limits = self.limits or Limits.for_context(self.bundle.max_context)
        limits.check(
            text_bytes(asked.prompt), fields.get("max_new_tokens"), [text_bytes(s) for s in stops], asked.prompt_field
        )
        if asked.sent is not None:
            check_sent_text(asked.sent)
        if stops:
            fields["stop"] = [as_text(s, "stop") for s in stops]
        fields.setdefault("max_new_tokens", limits.max_tokens_limit)
        return decode_request(**fields)

    def refusal(self, asked: Asked, err: RequestError) -> tuple[str, str | None]:
        """(message, field) of a request this door refused, in ``asked``'s protocol's names, counted in the bundle's
        metrics (``draftsmith_request_errors``): every server answers the door's RequestErrors through here alike."""
        self.bundle.metrics.count_refusal()
        return renamed(str(err), asked.names, asked.form), asked.names.get(err.field, err.field)

    def compile(self, request: DecodeRequest) -> DecodeRequest:
        """``request`` with its response format compiled over the bundle's tokenizer (RequestError naming
        response_format when it cannot compile); as it is when there is none or it is compiled already."""
        fmt = request.response_format
        if fmt is None or isinstance(fmt, CompiledGrammar):
            return request
        try:
            grammar = self.bundle.compile_constraint(fmt)
        except RequestError as err:
            raise RequestError(str(err), "response_format") from None
        return request.model_copy(update={"response_format": grammar})

    def admit(self, prompts: list, request: DecodeRequest, chat: bool = False) -> Admitted:
        """The request as the scheduler runs it: each prompt (a string, or with ``chat`` a list of {"role",
        "content"} messages) checked as text and tokenized, then ``admit_tokens``. RequestError naming the field at
        fault."""
        return self.admit_tokens([self.tokenize(prompt, chat) for prompt in prompts], request)

    def admit_tokens(self, token_lists: list[list[int]], request: DecodeRequest) -> Admitted:
        """Prompts already tokenized (the bench's, a Triton preprocessing step's) as the scheduler runs them: within
        the bundle's bounds (its vocabulary, its context, its k), the response format compiled (unless it is
        already), the drafter made once, the stop strings' automaton built (cached for the scheduler)."""
        for ids in token_lists:
            self.check_tokens(ids)
        request = self.compile(request)
        config = self.decode_config(request)
        self.bundle.check_config(config)
        if isinstance(request.seed, list) and len(request.seed) != len(token_lists):
            raise RequestError(
                f"seed: expected one seed per prompt ({len(token_lists)}), received {len(request.seed)}", "seed"
            )
        drafter = self.bundle.new_drafter(request.mode, request.drafter, request.draft_confidence)
        name = self.bundle.drafter_name(request.drafter) if drafter is not None else ""
        if request.stops:  # built here (a server's admission runs off its loop), not on the scheduler's thread
            stop_automaton(request.stops)
        return Admitted([list(ids) for ids in token_lists], config, request.stops, drafter, name)

    def check_tokens(self, ids: list[int], field: str = "prompt") -> None:
        """A prompt's token ids: at least one, every one in the vocabulary, and room left in the context."""
        if not len(ids):
            raise RequestError(f"{field}: encodes to no tokens", field)
        vocab = self.bundle.target.vocab_size
        if any(not 0 <= int(t) < vocab for t in ids):
            raise RequestError(f"{field}: token ids must be in [0, {vocab}) for this bundle", field)
        if len(ids) >= self.bundle.max_context:
            raise RequestError(
                f"{field}: {len(ids)} tokens; this bundle's context is {self.bundle.max_context}, leaving no room to "
                "generate. Shorten the prompt",
                field,
            )

    def decode_config(self, request: DecodeRequest) -> DecodeConfig:
        """A validated request as this bundle decodes it (its default k, k within its max_k, its EOS)."""
        bundle = self.bundle
        k = bundle.default_k if request.k is None else request.k
        if k > bundle.max_k:
            raise RequestError(f"k: expected an integer in [1, {bundle.max_k}] for this bundle, received {k!r}", "k")
        adaptive = AdaptiveK(min_k=1, max_k=bundle.max_k) if request.adaptive is True else request.adaptive
        fallback = Fallback() if request.fallback is True else request.fallback
        return DecodeConfig(
            request.max_new_tokens,
            k,
            SamplingParams(request.temperature, request.top_k, request.top_p),
            bundle.eos_ids,
            adaptive or None,
            fallback or None,
            request.seed,
            grammar=request.response_format,
            forced_drafts=request.forced_drafts and request.mode == "speculative",
            logprobs=request.logprobs,
            plan=request.plan,
            exact=request.policy == "exact",
        )

    def tokenize(self, prompt, chat: bool) -> list[int]:
        """Token ids of a prompt (a string, its UTF-8 bytes, or with ``chat`` a list of {"role", "content"}
        messages): valid text, a template that renders, and room left in the context to generate."""
        field = "messages" if chat else "prompt"
        if chat and isinstance(prompt, list):
            if not prompt or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt
            ):
                raise RequestError("messages: a non-empty list of {'role': str, 'content': str}", field)
        elif not isinstance(prompt, (str, bytes, bytearray)) or not prompt:
            raise RequestError("prompt: a non-empty string", "prompt")
        prompt = as_text(prompt, field)
        check_text(prompt, field)
        tokenizer = self.bundle.tokenizer
        try:
            ids = tokenizer.encode_chat(prompt) if chat else tokenizer.encode(prompt)
        except ValueError as err:  # no template, or one that fails or breaks the sandbox
            raise RequestError(str(err), field) from None
        self.check_tokens(ids, field)
        return ids
