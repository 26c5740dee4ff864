"""Constrained decoding: a grammar masks the target's distribution at every verified position, and the draft's.

The grammar engine is llguidance (guidance-ai/llguidance, PyPI ``llguidance`` 1.9.1: ``LLTokenizer``,
``LLMatcher`` with ``compute_logit_bias``, ``consume_tokens``, ``rollback``, ``compute_ff_tokens``, ``deep_copy``;
see its ``python/llguidance/_lib.pyi``). It has no Python dependencies, so the runtime's light side stays free of
torch.

Why the output stays exact under speculation: at each position the target's logits outside the grammar's mask are
set to -inf before ``sampling.verify``, so p_i is the constrained target's law; the draft draws from its own
logits masked the same way, so q_i is a law over allowed tokens. Rejection sampling against the constrained p_i is
then exactly the constrained target's distribution (greedy: its argmax), whatever the draft. A model-free drafter's
point-mass proposal is cut at its first token the grammar refuses: that token would be rejected for sure
(p = 0) and the residual max(0, p - onehot) is p itself, the law of the bonus token that replaces it.

Per step a sequence's matcher consumes its draft tokens tentatively (the masks the draft drew under are the masks
the target is verified under), then rolls back past the rejected ones and consumes the recovered or bonus token:
the matcher moves with the KV caches.

Grammar-forced drafts: where the grammar admits one continuation only (a key, punctuation, a schema's fixed
structure), ``forced`` gives its tokens; the loop proposes them as a point-mass draft without a draft call, and the
target still verifies them (another tokenization of the same bytes may be what it prefers).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.decoding.grammar_bounds import lark_size, refuse_expansion, regex_size, schema_size
from runtime.errors import RequestError
from runtime.text.tokenizer import read_bytes

KINDS = ("json_object", "json_schema", "regex", "lark")

# Bounds on a client's schema or grammar, checked before any work on it (a schema is client input).
MAX_SOURCE_BYTES = 32 * 1024  # the schema (as compact JSON), regex or grammar text
MAX_DEPTH = 64  # nesting of the schema document (each level of an object schema is ~2: properties, then a name)
# Compiled grammars kept for reuse (an agent sends the same schema again and again), each 0.6-1.1 MB at most under
# grammar_bounds.MAX_EXPANDED (measured: a{10000}; a 27 KB schema of 600 patterns; a{250000} held 72 MB).
MAX_COMPILED = 64
# A row whose grammar work (masks, consumes, rollbacks) passes GRAMMAR_SECONDS plus GRAMMAR_SECONDS_PER_TOKEN for each
# token it emitted fails with a RequestError, alone: the scheduler thread runs every row's grammar, so one costly
# grammar would slow every stream. Real constraints cost 0.1-5 ms a mask, a few masks a step.
GRAMMAR_SECONDS = 1.0
GRAMMAR_SECONDS_PER_TOKEN = 0.02
# llguidance's own limits bound the compile and every mask step (its defaults, tightened where a client could
# make the compile slow): https://github.com/guidance-ai/llguidance, python/llguidance/_lib.pyi LLParserLimits.
PARSER_LIMITS = dict(
    max_grammar_size=200_000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=100_000,
    verbose_errors=False,
)
# JSON output without free whitespace: one layout per value, so a junk model cannot emit whitespace forever, and
# more of the structure is forced (grammar-forced drafts).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What the output must match: kind is one of KINDS; source the JSON Schema (JSON text), the regex, or the
    grammar ("lark": Lark, or llama.cpp's GBNF, told apart by llguidance)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"constraint kind must be one of {KINDS}, received {self.kind!r}")
        try:
            size = len(self.source.encode())
        except UnicodeEncodeError as err:  # a lone surrogate ("\ud800", which JSON can carry)
            raise RequestError(
                f"the {self.kind} is not valid Unicode text ({err.reason} at character {err.start}); send UTF-8 "
                "without lone surrogates"
            ) from None
        if size > MAX_SOURCE_BYTES:
            raise RequestError(f"the {self.kind} is {size} bytes; the limit is {MAX_SOURCE_BYTES}. Simplify it")


def json_schema(schema: Any) -> Constraint:
    """A JSON Schema constraint from a schema object (a dict or a bool), bounded in size and nesting."""
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"a JSON schema must be an object, received {type(schema).__name__}")
    depth = _depth(schema)
    if depth > MAX_DEPTH:
        raise RequestError(f"the JSON schema nests {depth} levels deep; the limit is {MAX_DEPTH}")
    return Constraint("json_schema", json.dumps(schema, separators=(",", ":")))


def _depth(value: Any, limit: int = MAX_DEPTH + 1) -> int:
    """Nesting depth of a JSON document, counted no further than ``limit`` (no recursion: hostile input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            if level >= limit:
                return level
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_response_format(value: Any) -> Constraint | None:
    """A Constraint from OpenAI's ``response_format`` (or one given as is); None for plain text.

    Accepted: ``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name",
    "schema", "strict", "description"}}`` and two extensions, ``{"type": "regex", "regex": ...}`` and
    ``{"type": "grammar", "grammar": LARK}``. ``strict`` changes nothing here: every schema is enforced, and a
    keyword the engine cannot enforce is an error, never silently ignored.
    """
    if value is None or isinstance(value, Constraint):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise RequestError(
            "response_format: expected an object with a 'type' (text, json_object, json_schema, "
            f"regex or grammar), received {value!r:.200}"
        )
    kind, fields = value["type"], {k: v for k, v in value.items() if k != "type"}
    expected = {
        "text": set(),
        "json_object": set(),
        "json_schema": {"json_schema"},
        "regex": {"regex"},
        "grammar": {"grammar"},
    }
    if kind not in expected:
        raise RequestError(f"response_format.type must be one of {sorted(expected)}, received {kind!r}")
    if set(fields) != expected[kind]:
        raise RequestError(
            f"response_format of type {kind!r} takes the fields {sorted(expected[kind])}, received {sorted(fields)}"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = fields["json_schema"]
        allowed = {"name", "schema", "strict", "description"}
        if not isinstance(spec, dict) or "schema" not in spec or set(spec) - allowed:
            got = sorted(spec) if isinstance(spec, dict) else spec
            raise RequestError(
                "response_format.json_schema: expected an object with 'schema' (and optionally "
                f"'name', 'strict', 'description'), received {got!r:.200}"
            )
        return json_schema(spec["schema"])
    text = fields[kind]
    if not isinstance(text, str) or not text:
        raise RequestError(f"response_format.{kind}: expected a non-empty string")
    return Constraint("regex" if kind == "regex" else "lark", text)


class GrammarCompiler:
    """Compiles constraints against one tokenizer; keeps the last MAX_COMPILED compiled grammars. Thread-safe."""

    def __init__(self, tokenizer_json: str, width: int, eos_ids: tuple[int, ...] = ()):
        """tokenizer_json: the bundle's tokenizer.json text; width: logits columns the loop reads; eos_ids: the
        tokens that end a sequence (the grammar allows them where the output is complete)."""
        probe = read_bytes(tokenizer_json)  # BytesUnavailable: llguidance is missing or cannot read it
        import llguidance

        self.llg = llguidance
        self.tokenizer = read_bytes(
            tokenizer_json, n_vocab=max(width, probe.vocab_size), eos_token=list(eos_ids) or None
        )
        self.width = width
        self.eos_ids = tuple(eos_ids) or tuple(self.tokenizer.eos_tokens)
        self.limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self._compiled: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self._flights: dict[Constraint, Future] = {}  # constraints compiling now: their result, once there
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> "CompiledGrammar":
        """The compiled grammar of a constraint, or RequestError naming why it cannot compile. Single-flight: a
        constraint already compiling is waited for, not compiled again (many clients of one agent send the same
        schema at once)."""
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
            flight = self._flights.get(constraint)
            leader = flight is None
            if leader:
                flight = self._flights[constraint] = Future()
        if not leader:
            return flight.result()  # the leader's grammar, or its error raised here too
        try:
            compiled = self._compile(constraint)
            flight.set_result(compiled)
            return compiled
        except BaseException as err:
            flight.set_exception(err)
            raise
        finally:
            with self._lock:
                del self._flights[constraint]

    def _compile(self, constraint: Constraint) -> "CompiledGrammar":
        """The compiled grammar and its first mask, both computed here, on the caller's thread (a server's grammar
        pool): llguidance builds its lexer lazily, so the first mask is where a costly constraint shows, and it
        must not be the scheduler's."""
        start = time.perf_counter()
        matcher = self.llg.LLMatcher(self.tokenizer, self._grammar(constraint), log_level=0, limits=self.limits)
        if matcher.is_error():
            raise RequestError(f"the {constraint.kind} cannot be compiled: {matcher.get_error()[:500]}")
        first = GrammarRow(matcher, self.width, self.eos_ids).initial_mask()
        compiled = CompiledGrammar(matcher, self.width, self.eos_ids, time.perf_counter() - start, first)
        with self._lock:
            self._compiled[constraint] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def _grammar(self, constraint: Constraint) -> str:
        """llguidance's grammar text of a constraint, refused (RequestError) when its regexes expand past
        MAX_EXPANDED (runtime/decoding/grammar_bounds.py)."""
        kind, matcher = constraint.kind, self.llg.LLMatcher
        if kind == "json_schema":
            try:
                schema = json.loads(constraint.source)
            except (ValueError, RecursionError) as err:
                raise RequestError(f"the JSON schema cannot be compiled: {str(err)[:200]}") from None
            size, largest = schema_size(schema)
            refuse_expansion(size, "the JSON schema's patterns expand", f"the largest: {largest}")
        try:
            if kind == "json_object":
                return matcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
            if kind == "json_schema":
                return matcher.grammar_from_json_schema(constraint.source, overrides=JSON_OPTIONS)
        except (ValueError, RecursionError) as err:
            raise RequestError(f"the JSON schema cannot be compiled: {err}") from None
        if kind == "regex":
            refuse_expansion(regex_size(constraint.source), "the regex expands", f"{constraint.source!r:.80}")
            return matcher.grammar_from_regex(constraint.source)
        try:  # Lark, or GBNF/EBNF (llama.cpp's; converted to Lark by llguidance's gbnf_to_lark)
            lark = self.llg.grammar_from("grammar", constraint.source)
        except (ValueError, RecursionError) as err:
            raise RequestError(f"the grammar cannot be compiled: {str(err)[:500]}") from None
        size, name = lark_size(lark)
        refuse_expansion(size, "the grammar expands", f"in its definition {name!r:.60}")
        return lark


class CompiledGrammar:
    """A compiled grammar and its first mask (computed where it was compiled); ``start`` gives each sequence its own
    matcher (a copy, cheap), its first mask already there."""

    def __init__(self, matcher, width: int, eos_ids: tuple[int, ...], compile_seconds: float, first_mask: np.ndarray):
        self.template, self.width, self.eos_ids, self.compile_seconds = matcher, width, eos_ids, compile_seconds
        self.first_mask = first_mask

    def start(self) -> "GrammarRow":
        return GrammarRow(self.template.deep_copy(), self.width, self.eos_ids, self.first_mask)


class GrammarRow:
    """One sequence's matcher: it has consumed every emitted token, plus this step's draft tokens tentatively.

    ``masks[i]`` is the allowed-token mask [width] (bool) after i tentative tokens; the draft's draw at draft
    position i+1 and the target's verify row i both read it.
    """

    def __init__(self, matcher, width: int, eos_ids: tuple[int, ...] = (), first_mask: np.ndarray | None = None):
        self.matcher, self.width, self.eos_ids = matcher, width, frozenset(eos_ids)
        self.tentative: list[int] = []
        self.masks: list[np.ndarray] = [] if first_mask is None else [first_mask]
        self.seconds = 0.0  # time spent in the grammar engine (masks, consumes, rollbacks)
        self.mask_count = 0
        self.emitted = 0  # tokens committed: what the time budget grows with

    def initial_mask(self) -> np.ndarray:
        """The mask before any token (read-only: every row started from the compiled grammar shares it), outside
        any row's budget: it is computed once, where the grammar compiles."""
        mask = self._read_mask()
        mask.flags.writeable = False
        return mask

    def mask_after(self, drafted: list[int]) -> np.ndarray | None:
        """The mask after this step's draft tokens ``drafted``, consumed tentatively one at a time (each position's
        mask is computed on the way: the target's verify rows need them all); None when one of them is refused
        (then nothing follows it)."""
        common = min(len(drafted), len(self.tentative))
        if drafted[:common] != self.tentative[:common]:
            raise RuntimeError("draft tokens changed during a step")
        if len(drafted) < len(self.tentative):
            return self.masks[len(drafted)]
        while True:
            if len(self.masks) == len(self.tentative):
                self.masks.append(self._compute_mask())
            if len(self.tentative) == len(drafted):
                return self.masks[len(drafted)]
            token = drafted[len(self.tentative)]
            if not (0 <= token < self.width and self.masks[-1][token]):
                return None
            start = time.perf_counter()
            self.matcher.consume_token(token)
            self._spend(time.perf_counter() - start)
            self.tentative.append(token)

    def valid_prefix(self, drafted: list[int]) -> int:
        """How many leading tokens of a proposal the grammar allows (the rest is cut, see the module docstring);
        consumes them tentatively (a masked model draft already was: then this only reads the masks)."""
        for i in range(len(drafted)):
            if self.mask_after(drafted[: i + 1]) is None:
                return i
        return len(drafted)

    def verify_masks(self, drafted: list[int]) -> np.ndarray:
        """Masks [len(drafted) + 1, width] for the target's verify rows of this step (``drafted`` all allowed)."""
        if self.mask_after(drafted) is None:
            raise RuntimeError("a draft token the grammar refuses reached verification")
        return np.stack(self.masks[: len(drafted) + 1])

    def commit(self, accepted: int, extra: int) -> int:
        """After verification: keep ``accepted`` tentative tokens, then consume the recovered or bonus token.
        Returns how many of the step's emitted tokens (accepted + 1) to keep: those up to where the output became
        complete (what follows can only be EOS; target-only decoding ends there too)."""
        start = time.perf_counter()
        keep = accepted + 1
        for i in range(1, accepted + 1):
            if self._complete(self.masks[i]):
                keep = i
                break
        surplus = len(self.tentative) - min(accepted, keep)
        if surplus > 0:
            self.matcher.rollback(surplus)
        self.tentative, self.masks = [], []
        if keep == accepted + 1 and extra not in self.eos_ids and not self.matcher.is_stopped():
            self.matcher.consume_token(extra)  # after EOS the sequence ends
        self.emitted += keep
        self._spend(time.perf_counter() - start)
        return keep

    def _complete(self, mask: np.ndarray) -> bool:
        """Whether a mask allows nothing but EOS."""
        allowed = np.flatnonzero(mask[: self.width]) if mask.sum() <= len(self.eos_ids) else None
        return allowed is not None and all(int(t) in self.eos_ids for t in allowed)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (empty where it admits more than one continuation)."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        start = time.perf_counter()
        tokens = self.matcher.compute_ff_tokens()[:limit]
        self._spend(time.perf_counter() - start)
        return tokens

    @property
    def stopped(self) -> bool:
        """Nothing but EOS may follow (the output is complete)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def _compute_mask(self) -> np.ndarray:
        start = time.perf_counter()
        mask = self._read_mask()
        self.mask_count += 1
        self._spend(time.perf_counter() - start)
        return mask

    def _read_mask(self) -> np.ndarray:
        bias = np.frombuffer(self.matcher.compute_logit_bias(), dtype=np.uint8)
        if self.matcher.is_error():  # a limit hit (the lexer's fuel), or a bug: never go on unconstrained
            raise RequestError(f"the grammar engine stopped this request: {self.matcher.get_error()[:300]}")
        mask = np.zeros(self.width, dtype=bool)
        size = min(self.width, len(bias))
        mask[:size] = bias[:size] != 0
        return mask

    def _spend(self, seconds: float) -> None:
        """Count grammar time; past the row's budget (GRAMMAR_SECONDS + GRAMMAR_SECONDS_PER_TOKEN per emitted
        token) the request ends with a RequestError naming it, and only this row leaves (the scheduler isolates
        each row's work)."""
        self.seconds += seconds
        budget = GRAMMAR_SECONDS + GRAMMAR_SECONDS_PER_TOKEN * self.emitted
        if self.seconds > budget:
            raise RequestError(
                f"the grammar engine spent {self.seconds:.2f} s on this request's constraint over "
                f"{self.emitted} tokens (the budget is {GRAMMAR_SECONDS:g} s plus "
                f"{GRAMMAR_SECONDS_PER_TOKEN * 1000:g} ms a token); it was stopped. Simplify the constraint"
            )


def constrain(logits: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """Logits [..., V] with the tokens a mask [..., V] refuses set to -inf (a new array). A row whose mask allows
    nothing (after the grammar's end) is left as it is: its token is never emitted, and an all -inf row has no law."""
    masks = masks[..., : logits.shape[-1]]
    empty = ~masks.any(axis=-1, keepdims=True)
    keep = masks | empty if empty.any() else masks
    if np.count_nonzero(keep) * 8 < keep.size:  # few allowed (JSON structure): write only those
        out = np.full_like(logits, -np.inf)
        out[keep] = logits[keep]
        return out
    return np.where(keep, logits, logits.dtype.type(-np.inf))


def forced_proposals(grammars: list, limits: list[int]) -> list[list[int]]:
    """Per row, the grammar-forced tokens to propose this step (at most its limit); [] for rows without a grammar
    or with more than one continuation."""
    return [g.forced(limit) if g is not None else [] for g, limit in zip(grammars, limits)]


# tensorrtllm_backend's guided-decoding inputs (triton-inference-server/tensorrtllm_backend,
# all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt and 1/model.py get_guided_decoding_params_from_request):
# ``guided_decoding_guide_type`` one of these, ``guided_decoding_guide`` the schema, regex or grammar text.
TRTLLM_GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")


def trtllm_guide(guide_type: str | None, guide: str | None) -> Constraint | None:
    """The Constraint of TensorRT-LLM's (guide_type, guide) pair; None when no guide type is given."""
    if guide_type is None:
        if guide is not None:
            raise RequestError("input 'guided_decoding_guide' needs 'guided_decoding_guide_type'")
        return None
    if guide_type not in TRTLLM_GUIDE_TYPES:
        raise RequestError(
            f"input 'guided_decoding_guide_type' must be one of {TRTLLM_GUIDE_TYPES}, received {guide_type!r:.100}"
        )
    if guide_type == "json":
        return Constraint("json_object")
    if not guide:
        raise RequestError(f"input 'guided_decoding_guide' is required with guided_decoding_guide_type {guide_type!r}")
    if guide_type == "json_schema":
        if len(guide.encode()) > MAX_SOURCE_BYTES:
            raise RequestError(f"the JSON schema is {len(guide.encode())} bytes; the limit is {MAX_SOURCE_BYTES}")
        try:
            schema = json.loads(guide)
        except (ValueError, RecursionError) as err:
            raise RequestError(f"input 'guided_decoding_guide': not a JSON schema ({str(err)[:200]})") from None
        return json_schema(schema)
    return Constraint("regex" if guide_type == "regex" else "lark", guide)
