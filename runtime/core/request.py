"""The front door: a request admitted once, the same way for every entry point (the Python API, the CLI, the OpenAI
server, the Triton model), as vLLM's ``Processor.process_inputs`` does for its offline ``LLM`` and its server alike.

``DecodeRequest`` holds the decoding settings one request may carry, validated once (a pydantic model: strict
types, frozen, unknown keys refused), so every caller gets the same rules and the same messages, naming the field,
what was expected and what was received. ``Limits`` are a server's bounds, checked before any work. ``FrontDoor``
does the rest on a bundle in one call (``admit``), in an order it owns: the bounds, the room in a server's queue, the
response format compiled, the prompt's text checked and tokenized (or its token ids checked), the bundle's bounds (k
up to its ``max_k``, the context), the drafter made, into one ``Admitted`` that the scheduler runs. A protocol
(runtime/serving/openai_protocol.py, the Triton model) only maps its own names to an ``Asked`` and chooses where the
call runs (tests/test_front_door.py checks that no caller calls its parts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Sequence, Union

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
    """A request as a caller hands it to the front door, in the door's names: nothing checked yet.

    ``prompts``: texts, raw UTF-8 bytes (a tensor's) or with ``chat`` lists of {"role", "content"} messages (a
    server's request: one); ``fields``: the DecodeRequest's fields the request set (``stop`` may hold raw bytes; a
    server's door fills a missing ``max_new_tokens`` with its ``max_tokens_limit``), on top of ``base`` where the
    caller has a DecodeRequest already (the Python API's); ``tokens``: the prompts' token ids where the caller has
    them (the bench's, Triton's ``preprocessing``'s): checked as ids, the texts not tokenized again; ``sent``:
    everything the client sent, as JSON-like data, every string of which must be valid text (None: the prompt and
    stops only; a pydantic model: the body it was parsed into, dumped only where checked); ``token_bytes``: the
    answer carries each token's bytes with its logprobs (OpenAI's chat completions), so a tokenizer whose bytes
    cannot be read refuses such a request before it decodes; ``names`` and ``form``: the protocol's words for the
    door's fields (the refusals' messages)."""

    prompts: list
    fields: dict
    chat: bool = False
    sent: Any = None
    names: dict = field(default_factory=dict)
    form: str = "{}"
    base: DecodeRequest | None = None
    tokens: list[list[int]] | None = None
    token_bytes: bool = False

    @classmethod
    def tokenized(cls, token_lists: list[list[int]], request: DecodeRequest) -> "Asked":
        """Prompts already tokenized, with their DecodeRequest (the bench's, a teacher's continuations)."""
        return cls([], {}, base=request, tokens=[list(ids) for ids in token_lists])

    @property
    def prompt_field(self) -> str:
        return "messages" if self.chat else "prompt"


class FrontDoor:
    """Admits requests to one bundle in one call (``admit``), the same way for the Python API, the OpenAI server,
    the Triton model and the bench: the door owns the order of the checks, so a caller chooses only where the call
    runs (its thread, a pool), never which check comes first."""

    def __init__(self, bundle: LoadedBundle, limits: Limits | None = None, room: Callable[[], None] | None = None):
        """``limits``: a server's bounds (None: none, the Python API's caller is trusted with its own process); a
        server's door (one with limits) counts its refusals in the bundle's metrics (``draftsmith_request_errors``),
        the Python API's raises them to its caller only. ``room``: asked after the request's cheap checks and before
        any work (a server's ``Scheduler.check_room``: a full queue refuses before a grammar compile or tokenizing);
        its errors (Overloaded, Unavailable) pass as they are."""
        self.bundle, self.limits, self.room = bundle, limits, room

    def admit(self, asked: Asked) -> Admitted:
        """``asked`` as the scheduler runs it, or a RequestError whose message and ``field`` are in ``asked``'s
        protocol's names: its bounds and sent text (cheap: sizes and a scan, before any work), the room, its response
        format compiled, its prompts' text checked and tokenized (or its token ids checked), the bundle's bounds, its
        drafter. Its cost is the body's size and a compile: a server runs it off its event loop."""
        request = self._refusing(asked, self._checked, asked)
        if self.room is not None:
            self.room()
        return self._refusing(asked, self._admitted, asked, request)

    def _refusing(self, asked: Asked, work: Callable, *args):
        """``work(*args)``; its RequestError in ``asked``'s names (every caller answers the door's refusals alike),
        counted where this is a server's door."""
        try:
            return work(*args)
        except RequestError as err:
            if self.limits is not None:
                self.bundle.metrics.count_refusal()
            field_name = asked.names.get(err.field, err.field)
            raise RequestError(renamed(str(err), asked.names, asked.form), field_name) from None

    def _checked(self, asked: Asked) -> DecodeRequest:
        """The request's DecodeRequest (uncompiled), after a server's bounds on its sizes and the check that every
        string it sent is valid text."""
        fields = dict(asked.fields)
        if self.limits is not None:
            fields = self._bounded(asked, fields)
        if asked.sent is not None:
            check_sent_text(asked.sent)
        return merged_request(asked.base, fields)

    def _bounded(self, asked: Asked, fields: dict) -> dict:
        """``fields`` within this server's limits (sizes only: nothing decoded or tokenized yet), its stops as text
        and its max_new_tokens defaulted to the limit."""
        stops = fields.get("stop") or []
        stops = [stops] if isinstance(stops, (str, bytes)) else list(stops)
        prompt_bytes = sum(text_bytes(prompt) for prompt in asked.prompts)
        sizes = [text_bytes(s) for s in stops]
        self.limits.check(prompt_bytes, fields.get("max_new_tokens"), sizes, asked.prompt_field)
        if stops:
            fields["stop"] = [as_text(s, "stop") for s in stops]
        fields.setdefault("max_new_tokens", self.limits.max_tokens_limit)
        return fields

    def _admitted(self, asked: Asked, request: DecodeRequest) -> Admitted:
        """A checked request's format compiled, what its answer needs of the tokenizer there, then its prompts'
        tokens within the bundle's bounds (its vocabulary, its context, its k), the drafter made once, the stop
        strings' automaton built (cached for the scheduler)."""
        request = self._compiled(request)
        if asked.token_bytes:
            self._check_bytes(request)
        if asked.tokens is None:
            bundle = self.bundle
            token_lists = [prompt_tokens(bundle.tokenizer, p, asked.chat, bundle.max_context) for p in asked.prompts]
        else:
            token_lists = asked.tokens
        for ids in token_lists:
            self._check_tokens(ids)
        config = self._config(request)
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

    def _compiled(self, request: DecodeRequest) -> DecodeRequest:
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

    def _check_bytes(self, request: DecodeRequest) -> None:
        """RequestError naming logprobs where they are asked for and the tokens' bytes cannot be read (OpenAI's chat
        logprobs carry each token's bytes): refused before decoding, not mid-response."""
        tokenizer = self.bundle.tokenizer
        why = tokenizer.bytes_problem() if request.logprobs is not None and tokenizer is not None else ""
        if why:
            raise RequestError(f"logprobs: unavailable for this bundle's chat completions: {why}", "logprobs")

    def _check_tokens(self, ids: list[int]) -> None:
        """A prompt's token ids: at least one, every one in the vocabulary, and room left in the context."""
        vocab = self.bundle.target.vocab_size
        if any(not 0 <= int(t) < vocab for t in ids):
            raise RequestError(f"prompt: token ids must be in [0, {vocab}) for this bundle", "prompt")
        context_room(ids, "prompt", self.bundle.max_context)

    def _config(self, request: DecodeRequest) -> DecodeConfig:
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


def prompt_tokens(tokenizer, prompt, chat: bool, max_context: int) -> list[int]:
    """Token ids of a prompt (a string, its UTF-8 bytes, or with ``chat`` a list of {"role", "content"} messages):
    valid text, a template that renders, and room left in the context to generate. The door's own tokenizing, which
    Triton's ``preprocessing`` model (a tokenizer without the engines) runs too: one path, the same refusals."""
    field = "messages" if chat else "prompt"
    if chat and isinstance(prompt, list):
        if not prompt or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        ):
            raise RequestError("messages: a non-empty list of {'role': str, 'content': str}", field)
    elif not isinstance(prompt, (str, bytes, bytearray)) or not prompt:
        raise RequestError("prompt: a non-empty string", "prompt")
    prompt = as_text(prompt, field)
    check_text(prompt, field)
    try:
        ids = tokenizer.encode_chat(prompt) if chat else tokenizer.encode(prompt)
    except ValueError as err:  # no template, or one that fails or breaks the sandbox
        raise RequestError(str(err), field) from None
    context_room(ids, field, max_context)
    return ids


def context_room(ids: list[int], field: str, max_context: int) -> None:
    """RequestError naming ``field`` where a prompt's ids are none, or leave no room in the context to generate."""
    if not len(ids):
        raise RequestError(f"{field}: encodes to no tokens", field)
    if len(ids) >= max_context:
        raise RequestError(
            f"{field}: {len(ids)} tokens; this bundle's context is {max_context}, leaving no room to generate. "
            "Shorten the prompt",
            field,
        )
