"""A bundle opened for decoding: its engines, tokenizers and defaults, the drafters it makes, the call costs measured
on this machine, its grammar compiler and its metrics (``LoadedBundle``).

What the scheduler runs on (runtime/core/scheduler.py), what the front door admits requests for
(runtime/core/request.py), and what the Python API (runtime/api.py), the OpenAI server and the Triton model each open
once; it decodes nothing itself. Its tokenizers are made from the bytes the manifest vouches for.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from runtime.bundle import BundleError, Manifest, load_manifest, read_verified
from runtime.decoding.config import DecodeConfig
from runtime.decoding.grammar import GrammarCompiler, parse_response_format
from runtime.decoding.step_costs import CostModel
from runtime.decoding.drafter import Drafter
from runtime.drafters.registry import DraftSources, drafter_kind, make_drafter
from runtime.engines.base import Engine
from runtime.engines.loading import open_engines
from runtime.errors import RequestError
from runtime.metrics import MetricsRegistry
from runtime.text.tokenizer import BytesUnavailable, Tokenizer, UnsafeTokenizer
from runtime.text.vocab_bridge import VocabBridge


class LoadedBundle:
    """One bundle's engines and what requests on it share. Thread-compatible: one scheduler drives its engines."""

    def __init__(
        self,
        manifest: Manifest | None,
        target: Engine,
        draft: Engine | None,
        tokenizer: Tokenizer | None,
        eos_ids: tuple[int, ...] = (),
        max_k: int | None = None,
        bridge: VocabBridge | None = None,
    ):
        """``manifest`` None: a bundle made in memory (tests' scripted engines), with the defaults below;
        ``tokenizer`` None: token ids only (no text)."""
        self.manifest, self.target, self.draft, self.tokenizer = manifest, target, draft, tokenizer
        self.bridge = bridge  # the vocabularies' bridge where the draft has a tokenizer of its own
        self.eos_ids = tuple(eos_ids)
        self.default_k = manifest.default_k if manifest else 4
        self.default_drafter = manifest.spec.drafter if manifest else "model"
        self.default_confidence = manifest.spec.draft_confidence if manifest else 0.0
        self.max_k = max_k or (manifest.spec.max_k if manifest else 16)
        self.max_context = target.max_context
        self.metrics = MetricsRegistry()
        self._grammars: GrammarCompiler | None = None  # made on the first constrained request
        self._no_grammars = ""  # why it cannot be made, once found
        self._costs: CostModel | None = None  # measured call costs (``step_costs``), made on first need
        self._costs_rows = 0

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        threads: int = 0,
        providers: list | None = None,
        verify: bool = True,
        draft_threads: int | None = None,
        device: str | None = None,
        device_id: int = 0,
    ) -> "LoadedBundle":
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

    def compile_constraint(self, response_format):
        """The compiled grammar of a response_format (None: unconstrained); RequestError when it cannot compile."""
        constraint = parse_response_format(response_format)
        if constraint is None:
            return None
        return self.grammar_compiler().compile(constraint)

    def grammar_compiler(self) -> GrammarCompiler:
        """The grammar compiler over this bundle's tokenizer, made once (llguidance reads the vocabulary: ~3 s for
        SmolLM2's 49,152 tokens; a server makes it at start so no request waits for it). RequestError saying why
        where llguidance is missing or cannot read the tokenizer: tried once, the bundle decodes unconstrained."""
        if self._grammars is None and not self._no_grammars:
            try:
                self._grammars = GrammarCompiler(self.tokenizer.fast.to_str(), self.target.vocab_size, self.eos_ids)
            except BytesUnavailable as err:
                self._no_grammars = f"structured output is unavailable for this bundle: {err}"
        if self._grammars is None:
            raise RequestError(self._no_grammars)  # a new one each time: a kept one's traceback would grow
        return self._grammars

    def step_costs(self, rows: int) -> CostModel:
        """This machine's measured call costs for batches of up to ``rows`` rows (a lone row's alone, else at least
        8), which plan every step's draft lengths (runtime/decoding/step_costs.py): measured once, on first need
        (seconds; again for a larger batch). Uncalibrated for a target that returns tokens: the cost model prices
        a target call by its width and a draft token by its own call, while such an engine's draft decodes k tokens
        in one request and its speculation may run inside it."""
        if self.target.returns_tokens:  # its steps are not priced per token (a draft's k tokens are one request)
            return CostModel()  # uncalibrated: every row drafts its limit
        wanted = 1 if rows == 1 else max(8, rows)
        largest = max(self._costs_rows, wanted)
        if self._costs is None or wanted > self._costs_rows:
            costs = CostModel()
            costs.calibrate(self.target, self.draft, largest, min(self.max_k, 8) + 1)
            self._costs, self._costs_rows = costs, largest
        return self._costs

    def drafter_name(self, kind: str | None) -> str:
        """The drafter kind a request runs with (its own, or the bundle's default): the label of its metrics."""
        return kind or self.default_drafter

    def new_drafter(self, mode: str, kind: str | None, confidence: float | None) -> Drafter | None:
        """A new drafter for one request (a DecodeRequest's mode, drafter and draft_confidence; None: the bundle's
        defaults); None in mode "target", or when the kind needs the draft engine and there is none."""
        if self.target.returns_tokens and self.target.speculation != "verifies":
            return self._takes_no_drafts(mode, kind)
        kind = kind or self.default_drafter
        confidence = self.default_confidence if confidence is None else confidence
        drafter_kind(kind)  # an unknown kind fails in any mode
        if mode == "target":
            return None
        return make_drafter(
            kind, DraftSources(self.target.vocab_size, self.draft, self.target.has_hidden, confidence, self.bridge)
        )

    def _takes_no_drafts(self, mode: str, kind: str | None) -> None:
        """No drafter for a target that returns tokens but verifies none given to it: its runtime drafts and
        verifies inside its calls (TensorRT-LLM's executor with a speculative config), or it was opened without
        one (the baseline). A request cannot pick a drafter, nor turn the executor's off (open the bundle so)."""
        if mode == "target" or kind is not None:
            raise RequestError(
                "this bundle's target decodes inside TensorRT-LLM's executor, which drafts there when the bundle "
                "is opened with its speculative config: a request cannot choose a drafter or decode target-only "
                "(open the bundle with speculative=False for the baseline)",
                "mode" if mode == "target" else "drafter",
            )

    def check_config(self, config: DecodeConfig) -> None:
        """RequestError where the target cannot decode a request as asked: an engine that returns tokens
        (``Engine.returns_tokens``: TensorRT-LLM's executor) gives no logits to mask or score, so it decodes
        unconstrained and without log-probabilities, and greedily unless its runtime samples each row itself
        (``Engine.samples``: the LLM-API flavor)."""
        if not self.target.returns_tokens:
            return
        asked = [
            name
            for name, given in (
                ("temperature", not config.params.greedy and not self.target.samples),
                ("response_format", config.grammar is not None),
                ("logprobs", config.logprobs is not None),
            )
            if given
        ]
        if asked:
            raise RequestError(
                f"{asked[0]}: this bundle's TensorRT-LLM engines return tokens, not logits, so in-process they "
                f"decode {'with sampling but ' if self.target.samples else 'greedily, '}without constraints or "
                f"log-probabilities; not supported here: {asked}. Serve the bundle with Triton for these",
                asked[0],
            )


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
