"""The Python API: load a bundle, generate (batched, sampled or greedy), stream, or decode target-only."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator


from runtime.bundle import BundleError, Manifest, load_manifest, read_verified
from runtime.decoding.config import AdaptiveK, DecodeConfig, Fallback
from runtime.decoding.loop import SpeculativeLoop
from runtime.decoding.step_costs import CostModel
from runtime.drafters.base import Drafter
from runtime.drafters.registry import DraftSources, drafter_kind, make_drafter
from runtime.drafters.suffix import SuffixCorpus
from runtime.engines.loading import open_engines
from runtime.engines.base import Engine
from runtime.errors import RequestError
from runtime.decoding.grammar import CompiledGrammar, GrammarCompiler, parse_response_format
from runtime.metrics import MetricsRegistry, RequestStats
from runtime.request import DecodeRequest, check_text, decode_request
from runtime.decoding.sampling import SamplingParams
from runtime.text.tokenizer import IncrementalDecoder, StopText, Tokenizer, UnsafeTokenizer
from runtime.text.vocab_bridge import VocabBridge


@dataclass
class Generation:
    """One prompt's result."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_new_tokens), "context" or "cancelled"
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[float] | None = None  # with logprobs: the target's log-probability of each token of token_ids
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, the n most likely (token, logprob)


class SpeculativeGenerator:
    """Draft-then-verify generation over one bundle. Thread-compatible: one request at a time per instance."""

    def __init__(
        self,
        manifest: Manifest,
        target: Engine,
        draft: Engine | None,
        tokenizer: Tokenizer,
        eos_ids: tuple[int, ...] = (),
        max_k: int | None = None,
        bridge: VocabBridge | None = None,
    ):
        self.manifest, self.target, self.draft, self.tokenizer = manifest, target, draft, tokenizer
        self.bridge = bridge  # the vocabularies' bridge where the draft has a tokenizer of its own
        self.eos_ids = tuple(eos_ids)
        self.default_k = manifest.default_k if manifest else 4
        self.default_drafter = manifest.spec.drafter if manifest else "model"
        self.default_confidence = manifest.spec.draft_confidence if manifest else 0.0
        self.max_k = max_k or (manifest.spec.max_k if manifest else 16)
        self.max_context = target.max_context
        self.metrics = MetricsRegistry()
        self.suffix_corpus: SuffixCorpus | None = None  # earlier responses for suffix drafters (a server sets one)
        self._grammars: GrammarCompiler | None = None  # made on the first constrained request
        self._costs: CostModel | None = None  # measured call costs (``step_costs``), made on first need
        self._costs_rows = 0

    @classmethod
    def from_bundle(
        cls,
        path: str | os.PathLike,
        threads: int = 0,
        providers: list | None = None,
        verify: bool = True,
        draft_threads: int | None = None,
        device: str | None = None,
        device_id: int = 0,
    ) -> "SpeculativeGenerator":
        """Load and verify a bundle (every file against its sha256) and open both engines.

        threads: ONNX Runtime intra-op threads (0: one per core); draft_threads: the draft's, if different (a small
        draft's many tiny ops can run faster on fewer threads). device: "cpu", "cuda" or "tensorrt" (default: the
        device the bundle was built for) and device_id (which GPU); providers: explicit ONNX Runtime execution
        providers instead.
        """
        root = Path(path)
        manifest = load_manifest(root, verify=verify)
        tokenizer = load_tokenizer(root, manifest, verify)
        engines = open_engines(
            root,
            manifest,
            tokenizer.vocab_size,
            ("target", "draft"),
            threads,
            draft_threads,
            providers,
            device,
            device_id,
            verify=verify,
        )
        bridge = None
        if manifest.draft.tokenizer:  # a draft of another family: its tokenizer, bridged to the target's
            draft_tokenizer = load_tokenizer(root, manifest, verify, folder=manifest.draft.tokenizer)
            bridge = VocabBridge.between(
                tokenizer.fast, draft_tokenizer.fast, engines["target"].vocab_size, engines["draft"].vocab_size
            )
        return cls(manifest, engines["target"], engines["draft"], tokenizer, manifest.eos_token_ids, bridge=bridge)

    # --- requests -------------------------------------------------------------------------------------------------

    def generate(
        self, prompts: str | list[str], request: DecodeRequest | None = None, *, chat: bool = False, **options
    ) -> Generation | list[Generation]:
        """Generate for one prompt (returns a Generation) or a list (returns a list, in order), with ``chat``
        through the bundle's chat template.

        What to generate and how is a ``runtime.request.DecodeRequest`` (``request``) or its fields as keywords
        (``options``), validated once: max_new_tokens, temperature, top_k, top_p, seed, k, stop, mode, drafter,
        draft_confidence, response_format, logprobs, adaptive, fallback, forced_drafts.

        mode "target" decodes target-only (the baseline); drafter "prompt_lookup" drafts by n-gram lookup in the
        prompt and the text so far instead of running the draft engine, "hybrid" by lookup where the context has a
        2-gram match and with the draft engine elsewhere; None: the bundle's default (its spec's drafter). seed: one
        for the batch (each prompt draws its own stream of it) or a list, one per prompt (each prompt samples as it
        would alone with its seed).

        response_format constrains the output: OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema",
        "json_schema": {"schema": ...}}``, or ``{"type": "regex", "regex": ...}``, ``{"type": "grammar", "grammar":
        LARK}``, or a runtime.decoding.grammar.Constraint. It masks the target at every verified position and the
        draft the same way, so the output is exactly what constrained target-only decoding gives (greedy) or samples
        from (sampled); forced_drafts proposes the tokens the grammar forces without a draft call. logprobs (0-20):
        each token's log-probability under the target (Generation.logprobs) and the n most likely at each.
        """
        single = isinstance(prompts, str)
        results: dict[int, Generation] = {}
        for index, _, generation in self._events([prompts] if single else list(prompts), request, chat, None, options):
            if generation is not None:
                results[index] = generation
        ordered = [results[i] for i in sorted(results)]
        return ordered[0] if single else ordered

    def stream(
        self, prompt: str, request: DecodeRequest | None = None, *, chat: bool = False, **options
    ) -> Iterator[str]:
        """Yield text as tokens are accepted; the pieces concatenate to generate(prompt, ...).text."""
        self.last_stream: Generation | None = None
        for _, piece, generation in self._events([prompt], request, chat, None, options):
            if piece:
                yield piece
            if generation is not None:
                self.last_stream = generation

    def stream_batch(
        self, prompts: list[str], request: DecodeRequest | None = None, *, chat: bool = False, cancelled=None, **options
    ) -> Iterator[tuple[int, str, Generation | None]]:
        """Yield (prompt index, text piece, final Generation or None) as each sequence advances.

        ``cancelled(index) -> bool`` is asked after every step for each running sequence: a true answer finishes it
        at once (finish reason "cancelled"; its cache row is freed before the next step). ``seed`` may be a list,
        one seed per prompt: each sequence then samples as it would alone with that seed.
        """
        yield from self._events(list(prompts), request, chat, cancelled, options)

    # --- the work -------------------------------------------------------------------------------------------------

    def _events(self, prompts: list[str], request: DecodeRequest | None, chat: bool, cancelled, options: dict):
        request = merged_request(request, options)
        config, stops = self.decode_config(request)
        token_lists = [self.encode_prompt(p, chat) for p in prompts]
        drafter = self.new_drafter(request.mode, request.drafter, request.draft_confidence)
        planned = drafter is not None and config.plan
        costs = self.step_costs(len(token_lists)) if planned else None
        loop = SpeculativeLoop(self.target, drafter, token_lists, config, costs)
        loop.on_fallback = lambda state: setattr(self.metrics, "fallback_active", state)
        decoders = [IncrementalDecoder(self.tokenizer) for _ in prompts]
        texts = [StopText(stops) for _ in prompts]
        for step in loop.run():
            for row, new in step:
                if cancelled is not None and not row.finished and cancelled(row.index):
                    loop.finish(row.index, "cancelled")  # the loop drops the row (and its cache) after this step
                piece = decoders[row.index].push(new) if new else ""
                if row.finished:
                    piece += decoders[row.index].flush()
                piece, stopped = texts[row.index].push(piece)
                if stopped:
                    row.finished = "stop"  # the loop drops finished rows after this step
                elif row.finished:
                    piece += texts[row.index].flush()
                done = None
                if row.finished:
                    row.stats.finish_reason = row.finished
                    row.stats.prompt_tokens = len(row.prompt)
                    self.metrics.add(row.stats, self.drafter_name(request) if drafter is not None else "")
                    done = Generation(
                        texts[row.index].text,
                        list(row.generated),
                        len(row.prompt),
                        row.finished,
                        row.stats,
                        row.logprobs,
                        row.top_logprobs,
                    )
                if piece or done is not None:
                    yield row.index, piece, done

    def decode_config(self, request: DecodeRequest) -> tuple[DecodeConfig, tuple[str, ...]]:
        """A validated request as this bundle decodes it (its default k, k within its max_k, the response format
        compiled over its tokenizer), and its stop strings."""
        k = self.default_k if request.k is None else request.k
        if k > self.max_k:
            raise RequestError(f"k: expected an integer in [1, {self.max_k}] for this bundle, received {k!r}")
        params = SamplingParams(request.temperature, request.top_k, request.top_p)
        adaptive = AdaptiveK(min_k=1, max_k=self.max_k) if request.adaptive is True else request.adaptive
        fallback = Fallback() if request.fallback is True else request.fallback
        fmt = request.response_format  # compiled already (the server compiles on a pool of its own), or not
        grammar = fmt if isinstance(fmt, CompiledGrammar) else self.compile_constraint(fmt)
        return DecodeConfig(
            request.max_new_tokens,
            k,
            params,
            self.eos_ids,
            adaptive or None,
            fallback or None,
            request.seed,
            grammar=grammar,
            forced_drafts=request.forced_drafts and request.mode == "speculative",
            logprobs=request.logprobs,
            plan=request.plan,
            exact=request.policy == "exact",
        ), request.stops

    def compile_constraint(self, response_format):
        """The compiled grammar of a response_format (None: unconstrained); RequestError when it cannot compile."""
        constraint = parse_response_format(response_format)
        if constraint is None:
            return None
        return self.grammar_compiler().compile(constraint)

    def grammar_compiler(self) -> GrammarCompiler:
        """The grammar compiler over this bundle's tokenizer, made once (llguidance reads the vocabulary: ~3 s for
        SmolLM2's 49,152 tokens; a server makes it at start so no request waits for it)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.fast.to_str(), self.target.vocab_size, self.eos_ids)
        return self._grammars

    def step_costs(self, rows: int) -> CostModel:
        """This machine's measured call costs for batches of up to ``rows`` rows (a lone row's alone, else at least
        8), which plan every step's draft lengths (runtime/decoding/step_costs.py): measured once, on first need
        (seconds; again for a larger batch)."""
        wanted = 1 if rows == 1 else max(8, rows)
        largest = max(self._costs_rows, wanted)
        if self._costs is None or wanted > self._costs_rows:
            costs = CostModel()
            costs.calibrate(self.target, self.draft, largest, min(self.max_k, 8) + 1)
            self._costs, self._costs_rows = costs, largest
        return self._costs

    def encode_prompt(self, prompt: str | list[dict], chat: bool) -> list[int]:
        """Token ids of a prompt string, or with ``chat`` of a list of {"role", "content"} messages (a server's)."""
        if chat and isinstance(prompt, list):
            if not prompt or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt
            ):
                raise RequestError("chat messages must be a non-empty list of {'role': str, 'content': str}")
        elif not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string")
        check_text(prompt, "messages" if chat else "prompt")
        try:
            ids = self.tokenizer.encode_chat(prompt) if chat else self.tokenizer.encode(prompt)
        except ValueError as err:  # no template, or one that fails or breaks the sandbox
            raise RequestError(str(err)) from None
        if not ids:
            raise RequestError("prompt encodes to no tokens")
        if len(ids) >= self.max_context:
            raise RequestError(
                f"prompt has {len(ids)} tokens; this bundle's context is {self.max_context}, "
                "leaving no room to generate. Shorten the prompt."
            )
        return ids

    def drafter_name(self, request: DecodeRequest) -> str:
        """The drafter kind a request runs with (its own, or the bundle's default): the label of its metrics."""
        return request.drafter or self.default_drafter

    def new_drafter(self, mode: str, kind: str | None, confidence: float | None) -> Drafter | None:
        """A new drafter for one request (a DecodeRequest's mode, drafter and draft_confidence; None: the bundle's
        defaults); None in mode "target", or when the kind needs the draft engine and there is none."""
        kind = kind or self.default_drafter
        confidence = self.default_confidence if confidence is None else confidence
        drafter_kind(kind)  # an unknown kind fails in any mode
        if mode == "target":
            return None
        return make_drafter(
            kind,
            DraftSources(
                self.target.vocab_size,
                self.draft,
                self.target.has_hidden,
                self.suffix_corpus,
                confidence,
                self.bridge,
            ),
        )


def merged_request(request: DecodeRequest | None, options: dict) -> DecodeRequest:
    """``request`` with ``options`` on top, validated (RequestError naming every wrong field); options alone when
    there is no request."""
    if request is None:
        return decode_request(**options)
    if not isinstance(request, DecodeRequest):
        raise RequestError(f"request: expected a runtime.request.DecodeRequest, received {type(request).__name__}")
    given = {name: getattr(request, name) for name in request.model_fields_set}
    return decode_request(**{**given, **options}) if options else request


def bundle_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer in a bundle's ``tokenizer/`` folder (a Triton model's parameter), from the bytes its manifest's
    sha256 vouch for (load_tokenizer), never from whatever the folder holds when it is read."""
    root = Path(folder).resolve().parent
    return load_tokenizer(root, load_manifest(root, verify=False))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")  # what Tokenizer reads
MAX_TOKENIZER_FILE_BYTES = 64 << 20  # the largest tokenizer.json known is ~33 MB (Gemma 3's 262k vocabulary)


def load_tokenizer(root: Path, manifest: Manifest, verify: bool = True, folder: str = "tokenizer") -> Tokenizer:
    """The bundle's tokenizer (``folder``: another one it holds, a draft's own), made from its files' verified bytes.

    Only the files Tokenizer reads (TOKENIZER_FILES, directly in the folder) are read, each at most
    MAX_TOKENIZER_FILE_BYTES: a manifest naming an engine's folder as a tokenizer's (``"draft"``) must not read a
    model into memory. Each is read once and checked (``read_verified``), then written to a private temporary folder
    for Tokenizer to read, so a file swapped in the bundle after verification cannot reach it.
    """
    prefix = folder.rstrip("/") + "/"
    files = {
        name: read_verified(root, manifest, prefix + name, verify, max_bytes=MAX_TOKENIZER_FILE_BYTES)
        for name in TOKENIZER_FILES
        if prefix + name in manifest.files
    }
    if "tokenizer.json" not in files:
        raise BundleError(f"{root}: the manifest lists no {prefix}tokenizer.json; rebuild the bundle")
    with tempfile.TemporaryDirectory(prefix="draftsmith-tokenizer-") as private:
        for rel, data in files.items():
            path = Path(private, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        try:
            return Tokenizer(Path(private), name=f"{root}/{prefix}tokenizer.json")
        except UnsafeTokenizer as err:
            raise BundleError(str(err)) from None
