"""The engine bundle: its schema, its manifest and its verified loader.

Longer than most modules: the schema and the rules for what a bundle may name and hold are one contract, read and
written here only.

A bundle is one directory::

    manifest.json          schema version, the frozen BuildSpec, one ModelEntry per engine, sha256 of every file
    target/model.onnx      (+ model.onnx.data) the target engine
    draft/model.onnx       the draft engine
    tokenizer/             tokenizer.json (+ config files)
    draft/tokenizer/       the draft's own tokenizer, where it differs from the target's

This module is the light side (no torch): the builder imports it to write a bundle, the runtime, the bench and the
Triton generator import it to read one. ``manifest.json`` is written last and the directory is renamed into place
afterwards, so a directory without a valid manifest is never a bundle.

The manifest's classes are pydantic dataclasses: strict (no coercion: "4" is not 4, a list is not a tuple in code),
frozen, unknown keys refused, validated at construction (``dataclasses.replace`` included) and when read; every
failure is collected and named by field, expected and received (``describe``).

A bundle is hostile data until checked: every path it names must be a plain relative path that stays inside it
(symbolic links included), it holds exactly the files its manifest lists, and what the runtime loads is read once and
hashed as read (``read_verified``, ``read_onnx``), so a file swapped after verification is never the one that runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
import typing
from dataclasses import field
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from runtime.drafter_names import DRAFTERS

SCHEMA_VERSION = 1
GGUF_KERNELS = ("auto", "native", "matmulnbits")
# a GGUF draft's blocks (builder/gguf/draft_form.py): the file's own, re-quantized into the kernel's Q4_0, or chosen
# by measurement at build time among those and head sizes (builder/draft_choice.py; the manifest keeps the choice)
DRAFT_BLOCKS = ("file", "q4_0", "auto")
MANIFEST = "manifest.json"
# a build's staging folder (builder/publish.py: ".NAME.partial-*"): complete-looking between its manifest and the
# rename that publishes it, and never a bundle to load
STAGING_NAME = re.compile(r"^\..+\.partial-[^/]+$")
MAX_MANIFEST_CHARS = 1 << 24  # a manifest is kilobytes; a larger file is not one this tool wrote
ONNX_QUANTS = ("fp32", "fp16", "int8", "int4", "gguf")  # builder/quantize.py; gguf: the GGUF file's own blocks
# The ONNX graph an engine is: "fused" (builder/graph.py: ONNX Runtime's fused CPU operators, GroupQueryAttention over
# a cache written in place; the CPU default) or "export" (builder/export.py: torch's decoder op by op; any device).
GRAPHS = ("fused", "export")
GRAPH_CHOICES = ("",) + GRAPHS  # "": fused on cpu, export on cuda
# ONNX Runtime engines per device: a CPU engine is exported in fp32 (fp16 would run through inserted casts, slower);
# a CUDA engine in fp16 (the GPU's native width; fp32 would double the weight traffic), and quantized from that.
ONNX_DEVICE_QUANTS = {"cpu": ("fp32", "int8", "int4", "gguf"), "cuda": ("fp16", "int8", "int4")}
# TensorRT-LLM formats: bf16/fp16 (no quantization), int8/int4 weight-only (convert_checkpoint.py --use_weight_only),
# ModelOpt post-training quantization (examples/quantization/quantize.py --qformat). Which flavor takes which is
# decided in builder/trtllm/build.py (FLAVOR_QUANTS); the spec checks the union here.
TRTLLM_QUANTS = ("fp16", "bf16", "int8", "int4", "int4_awq", "int8_sq", "w4a8_awq", "fp8")
QUANTS = ONNX_QUANTS + tuple(q for q in TRTLLM_QUANTS if q not in ONNX_QUANTS)
BACKENDS = ("onnxruntime", "tensorrt_llm")
# Who proposes draft tokens at run time: DRAFTERS (runtime/drafter_names.py, the names as data; what each makes is
# runtime/drafters/registry.py's). The bundle records its default; requests may override it.
TRTLLM_FLAVORS = ("", "engine", "llmapi")  # "": chosen from the installed tensorrt_llm version at build time


class BundleError(Exception):
    """A bundle is missing, partial, tampered with or of an unknown schema."""


class SpecError(ValueError):
    """A build spec field is out of range; the message names the field, what was expected and what was received."""


def _check(ok: bool, name: str, expected: str, received: Any) -> None:
    if not ok:
        raise SpecError(f"{name}: expected {expected}, received {received!r}")


STRICT = ConfigDict(strict=True, extra="forbid")


def raising(error: type[Exception]):
    """Construction raises ``error`` (its message from ``describe``) instead of pydantic's ValidationError."""

    def wrap(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            try:
                init(self, *args, **kwargs)
            except ValidationError as err:
                raise error(describe(err, cls)) from None

        cls.__init__ = __init__
        return cls

    return wrap


@raising(SpecError)
@dataclass(frozen=True, config=STRICT)
class BuildSpec:
    """Everything that decides a build. Written verbatim into the manifest; the runtime reads it back from there."""

    target: str  # target checkpoint: HF folder, .gguf file, or pkg:<python package>/<file>
    draft: str = "self"  # draft checkpoint, or "self" (the target re-quantized), or "self:layers=N"
    target_quant: str = "fp32"  # one of QUANTS
    draft_quant: str = "int4"  # one of QUANTS
    k: int = 4  # default number of draft tokens per verify step
    max_k: int = 16  # the largest k the runtime accepts for this bundle
    drafter: str = "model"  # the runtime's default drafter (DRAFTERS); a request may pick another
    # the default draft confidence: after its first token a draft row stops where the draft's top probability falls
    # under this (0: never), so k > 1 drafts further only where the draft is sure (a request may pick another)
    draft_confidence: float = 0.0
    block_size: int = 32  # MatMulNBits quantization block size
    symmetric: bool = False  # symmetric (no zero point) weight quantization
    accuracy_level: int = 4  # MatMulNBits compute accuracy: 0 (fp32 activations) .. 4 (int8 activations, fastest)
    # quant gguf: which kernel multiplies by the file's blocks. "native": Draftsmith's GgufMatMul (the file's bytes
    # as they are; runtime.engines.gguf_ops, built by setup.sh); "matmulnbits": ONNX Runtime's MatMulNBits (~1.5x
    # the bytes); "auto": native where the kernel library is built on the building machine
    gguf_kernel: str = "auto"
    # quant gguf drafts (builder/gguf/draft_form.py): "q4_0" re-quantizes the draft file's blocks into the kernel's
    # 4-bit ones ("file": as they are), and a draft_head of N > 0 keeps the head rows of the N most frequent target
    # tokens only. A draft's precision and head move its acceptance, never the output: the target verifies. With
    # draft_quant int4 beside a gguf target, "q4_0" says a feature draft or self-draft is GgufMatMul over Q4_0
    # blocks (the build sets it where the kernel is built; "file": ONNX Runtime's MatMulNBits).
    draft_blocks: str = "file"
    draft_head: int = 0
    # a draft whose one-token call costs as much as the target's (or more) is refused at build time with the
    # measured ratio (builder.draft_choice.refuse_slow_draft); True builds it anyway
    allow_slow_draft: bool = False
    opset: int = 18
    max_context: int = 0  # 0: the usable maximum of the pair
    eval_tokens: int = 0  # tokens of the evaluation set the build report scores (0: all, ~25,000)
    graph: str = ""  # GRAPHS: the fused CPU graph or the torch export; "": fused on cpu, export on cuda
    backend: str = "onnxruntime"
    device: str = "cpu"
    allow_pickle: bool = False  # accept .bin/.pt weights (pickle: can run code) only when the user asks
    trust_remote_code: bool = False  # run a checkpoint's own modelling code only when the user asks
    # --- backend tensorrt_llm only (builder/trtllm/build.py); max_k is the engines' max_draft_len ---
    trtllm_flavor: str = ""  # "engine" (trtllm-build), "llmapi" (LLM API, PyTorch backend) or "" (from the version)
    tp_size: int = 1  # tensor parallel GPUs per engine
    pp_size: int = 1  # pipeline parallel GPUs per engine
    max_batch_size: int = 8  # sequences decoded together
    max_input_len: int = 0  # longest prompt; 0: max_seq_len - 1
    max_seq_len: int = 0  # prompt + generated tokens; 0: the pair's usable context (or max_context)
    kv_cache_dtype: str = ""  # "": the engines' own dtype; "fp8": FP8 KV cache (TensorRT-LLM only)

    def __post_init__(self) -> None:
        """Every field checked at construction, so a bad preset or manifest fails by name before any work."""
        self._check_pair_and_decoding()
        self._check_graph_and_device()
        self._check_sizes()
        self._check_backend_formats()

    def _check_pair_and_decoding(self) -> None:
        _check(bool(self.target), "target", "a checkpoint path", self.target)
        _check(bool(self.draft), "draft", "a checkpoint path or 'self'", self.draft)
        _check(self.target_quant in QUANTS, "target_quant", f"one of {QUANTS}", self.target_quant)
        _check(self.draft_quant in QUANTS, "draft_quant", f"one of {QUANTS}", self.draft_quant)
        _check(isinstance(self.k, int) and self.k >= 1, "k", "an integer >= 1", self.k)
        _check(isinstance(self.max_k, int) and self.max_k >= self.k, "max_k", f"an integer >= k ({self.k})", self.max_k)
        _check(self.drafter in DRAFTERS, "drafter", f"one of {DRAFTERS}", self.drafter)
        _check(
            isinstance(self.draft_confidence, (int, float)) and 0 <= self.draft_confidence < 1,
            "draft_confidence",
            "a number in [0, 1)",
            self.draft_confidence,
        )
        _check(self.block_size in (16, 32, 64, 128, 256), "block_size", "16, 32, 64, 128 or 256", self.block_size)
        _check(self.accuracy_level in (0, 1, 2, 3, 4), "accuracy_level", "0..4", self.accuracy_level)
        _check(self.gguf_kernel in GGUF_KERNELS, "gguf_kernel", f"one of {GGUF_KERNELS}", self.gguf_kernel)
        self._check_draft_form()
        _check(self.opset >= 17, "opset", ">= 17", self.opset)
        _check(
            isinstance(self.max_context, int) and self.max_context >= 0,
            "max_context",
            "an integer >= 0",
            self.max_context,
        )
        _check(
            isinstance(self.eval_tokens, int) and self.eval_tokens >= 0,
            "eval_tokens",
            "an integer >= 0",
            self.eval_tokens,
        )

    def _check_draft_form(self) -> None:
        _check(self.draft_blocks in DRAFT_BLOCKS, "draft_blocks", f"one of {DRAFT_BLOCKS}", self.draft_blocks)
        _check(
            isinstance(self.draft_head, int) and (self.draft_head == 0 or self.draft_head >= 256),
            "draft_head",
            "0 (every row) or a number of head rows >= 256",
            self.draft_head,
        )
        # int4 in the kernel's Q4_0 blocks: a feature draft or a self-draft beside a GGUF target on Draftsmith's
        # kernel (builder.model_surgery.kernel_draft resolves it; the manifest then says the form the engine is)
        kernel_int4 = self.draft_quant == "int4" and self.target_quant == "gguf" and self.draft_blocks == "q4_0"
        if (self.draft_blocks != "file" or self.draft_head) and not (kernel_int4 and not self.draft_head):
            _check(
                self.draft_quant == "gguf",
                "draft_quant",
                "'gguf' with draft_blocks / draft_head (they reshape a GGUF draft file's own blocks; int4 takes "
                "draft_blocks q4_0 beside a gguf target only)",
                self.draft_quant,
            )

    def _check_graph_and_device(self) -> None:
        _check(self.backend in BACKENDS, "backend", f"one of {BACKENDS}", self.backend)
        _check(self.graph in GRAPH_CHOICES, "graph", f"one of {GRAPH_CHOICES}", self.graph)
        if self.graph == "fused":
            _check(
                self.device == "cpu",
                "graph",
                "'export' for device cuda (the fused graph is ONNX Runtime's CPU kernels; pass --graph export)",
                self.graph,
            )
        if "gguf" in (self.target_quant, self.draft_quant):
            _check(
                self.engine_graph == "fused",
                "graph",
                "'fused' for quant gguf (the GGUF blocks are written into the fused graph)",
                self.graph,
            )
        _check(self.device in ("cpu", "cuda"), "device", "'cpu' or 'cuda'", self.device)
        _check(
            self.trtllm_flavor in TRTLLM_FLAVORS, "trtllm_flavor", "'engine', 'llmapi' or '' (auto)", self.trtllm_flavor
        )

    def _check_sizes(self) -> None:
        """The TensorRT-LLM sizes: GPUs, batch, input and sequence lengths."""
        for name in ("tp_size", "pp_size", "max_batch_size"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1, name, "an integer >= 1", value)
        _check(
            self.kv_cache_dtype in ("", "fp8"),
            "kv_cache_dtype",
            "'' (the engines' dtype) or 'fp8'",
            self.kv_cache_dtype,
        )
        for name in ("max_input_len", "max_seq_len"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 0, name, "an integer >= 0 (0: automatic)", value)
        if self.max_input_len and self.max_seq_len:
            _check(
                self.max_input_len < self.max_seq_len,
                "max_input_len",
                f"< max_seq_len ({self.max_seq_len})",
                self.max_input_len,
            )

    def _check_backend_formats(self) -> None:
        """Weight formats the backend and device run, and TensorRT-LLM-only options left at their defaults elsewhere."""
        if self.backend == "onnxruntime":
            allowed = ONNX_DEVICE_QUANTS[self.device]
            for name in ("target_quant", "draft_quant"):
                _check(
                    getattr(self, name) in allowed,
                    name,
                    f"one of {allowed} for backend onnxruntime on device {self.device} (fp16 is the CUDA "
                    "format, fp32 the CPU one; the other formats need tensorrt_llm)",
                    getattr(self, name),
                )
            defaults = {"trtllm_flavor": "", "tp_size": 1, "pp_size": 1, "kv_cache_dtype": ""}
            for name, default in defaults.items():
                _check(
                    getattr(self, name) == default,
                    name,
                    f"{default!r}: it applies to backend tensorrt_llm only (multi-GPU / TensorRT-LLM option)",
                    getattr(self, name),
                )
        else:
            for name in ("target_quant", "draft_quant"):
                _check(
                    getattr(self, name) in TRTLLM_QUANTS,
                    name,
                    f"one of {TRTLLM_QUANTS} for backend tensorrt_llm",
                    getattr(self, name),
                )
            _check(
                self.device == "cuda",
                "device",
                "'cuda' for backend tensorrt_llm (TensorRT-LLM runs on NVIDIA GPUs only)",
                self.device,
            )

    @property
    def engine_graph(self) -> str:
        """The graph the build writes: the spec's, or the device's default."""
        return self.graph or ("fused" if self.device == "cpu" else "export")


@raising(ValueError)
@dataclass(frozen=True, config=STRICT)
class ModelEntry:
    """One compiled engine of the bundle and what the runtime must know to drive it."""

    role: str  # "target" or "draft"
    source: str  # the checkpoint as the user named it
    source_sha256: str  # of the source weights (all weight files, in name order)
    architecture: str
    quant: str
    engine: str  # path of the engine file, relative to the bundle
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # rows of the output head (may exceed the tokenizer's vocabulary: padding)
    max_context: int
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    size_bytes: int = 0
    graph: str = "export"  # GRAPHS: which engine contract the file follows (bundles before the fused graph: export)
    # fused graph only: pad shorter calls to this many tokens (2 for a target with int8-activation MatMulNBits, whose
    # one-row kernel rounds differently: runtime.engines.fused.FusedEngine), so verify and target-only agree bit for bit
    min_call_tokens: int = 1
    # A reduced-vocabulary draft head: a JSON file in the bundle ({"kept_ids": [...]}) naming the token of each of the
    # engine's vocab_size logits; the runtime maps them back to the full vocabulary
    # (runtime.engines.mapped.MappedVocabEngine).
    vocab_map: str = ""
    # The source checkpoint's absolute path when the bundle was built (``source`` may be relative to that folder):
    # lets the bench's peers reload it from any working directory. "": bundles built before this field.
    source_resolved: str = ""
    # A draft with a tokenizer of its own (another model family; runtime/text/vocab_bridge.py): the bundle folder
    # holding its tokenizer.json, e.g. "draft/tokenizer". "": the target's tokenizer (the same vocabulary).
    tokenizer: str = ""

    def __post_init__(self) -> None:
        _check_relative(self.engine, f"{self.role}.engine")
        if self.vocab_map:
            _check_relative(self.vocab_map, f"{self.role}.vocab_map")
        if self.tokenizer:
            _check_relative(self.tokenizer, f"{self.role}.tokenizer")
            if self.role != "draft":
                raise ValueError(
                    f"{self.role}.tokenizer: only a draft may have a tokenizer of its own, received {self.tokenizer!r}"
                )


@raising(ValueError)
@dataclass(frozen=True, config=STRICT)
class Manifest:
    """The bundle's manifest.json."""

    spec: BuildSpec
    target: ModelEntry
    draft: ModelEntry
    files: dict[str, str]  # relative path -> sha256, every file of the bundle but the manifest
    default_k: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    tools: dict[str, str] = field(default_factory=dict)  # tool -> version used to build
    report: dict[str, Any] = field(default_factory=dict)  # build report: agreement, perplexity, timings
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        for rel, digest in self.files.items():
            _check_relative(rel, "files key")
            if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
                raise ValueError(f"files[{rel!r}]: expected a sha256 hex digest, received {digest!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        if len(text) > MAX_MANIFEST_CHARS:
            raise BundleError(
                f"{MANIFEST} is {len(text)} characters long; a manifest is a few kilobytes (the limit is "
                f"{MAX_MANIFEST_CHARS}): not a bundle this tool wrote"
            )
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as err:
            raise BundleError(
                f"{MANIFEST} is not valid JSON, or nests too deeply ({type(err).__name__}); rebuild the bundle"
            ) from None
        if not isinstance(data, dict):
            raise BundleError(f"{MANIFEST} must hold a JSON object, found {type(data).__name__}")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise BundleError(
                f"{MANIFEST} has schema_version {version!r}; this Draftsmith reads {SCHEMA_VERSION}. "
                "Rebuild the bundle with this version of build-engines."
            )
        try:
            return _adapter(cls).validate_json(text)
        except RecursionError:
            raise BundleError(f"{MANIFEST} nests too deeply: not a bundle this tool wrote") from None
        except ValidationError as err:
            raise BundleError(f"{MANIFEST} is malformed: {describe(err, cls)}") from None


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


def from_dict(cls: type, data: Any) -> Any:
    """Validate plain data (a preset with its flags) into ``cls``, as its constructor does; SpecError naming every
    bad field (``describe``)."""
    if not isinstance(data, dict) or not all(isinstance(key, str) for key in data):
        raise SpecError(f"{cls.__name__}: expected a mapping of field names, received {data!r}")
    try:
        return cls(**data)
    except ValueError as err:  # BuildSpec raises SpecError itself
        raise SpecError(str(err)) from None


def describe(err: ValidationError, cls: type) -> str:
    """Every failure of a validation, one per line: where (the field's path), what was expected, what was received.
    Our own checks (``__post_init__``) already say all three; unknown keys are listed with the known ones."""
    lines, unknown = [], {}
    for e in err.errors(include_url=False):
        loc = tuple(str(part) for part in e["loc"])
        where = ".".join(loc) or cls.__name__
        if e["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            unknown.setdefault(loc[:-1], []).append(loc[-1])
        elif e["type"] == "value_error":
            lines.append(f"{where}: {e['ctx']['error']}" if loc else str(e["ctx"]["error"]))
        elif e["type"] in ("missing", "missing_argument", "missing_keyword_argument"):
            lines.append(f"{where}: missing (a required key)")
        else:
            expected = e["msg"].removeprefix("Input should be ")
            received = repr(e["input"])
            received = received if len(received) <= 80 else received[:77] + "..."  # hostile data can be large
            lines.append(f"{where}: expected {expected}, received {type(e['input']).__name__} {received}")
    for loc, names in unknown.items():
        lines.append(f"{'.'.join(loc) or cls.__name__}: unknown keys {sorted(names)}; known: {_known(cls, loc)}")
    return "; ".join(lines)


def _known(cls: type, loc: tuple[str, ...]) -> list[str]:
    """The field names of the dataclass at ``loc`` inside ``cls`` (``spec`` of a Manifest: BuildSpec's)."""
    for name in loc:
        cls = typing.get_type_hints(cls).get(name)
    return sorted(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else []


_SHA256 = re.compile(r"[0-9a-f]{64}")


def path_problem(rel: Any) -> str | None:
    """Why ``rel`` is not a plain relative POSIX path inside a folder (None when it is)."""
    if not isinstance(rel, str) or not rel:
        return "expected a non-empty relative path"
    if rel.startswith("/") or "\\" in rel or "\0" in rel or re.match(r"[A-Za-z]:", rel):
        return "an absolute path, a drive or a backslash (a bundle names its files relative to itself)"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "'..', '.' or an empty component (a bundle names its files by plain relative paths)"
    return None


def _check_relative(rel: Any, name: str) -> None:
    problem = path_problem(rel)
    if problem:
        raise ValueError(f"{name} {rel!r}: {problem}")


def bundle_path(root: Path, rel: str) -> Path:
    """The real path of bundle file ``rel``; BundleError unless it is a plain relative path that stays inside
    ``root`` once every symbolic link is resolved."""
    problem = path_problem(rel)
    if problem:
        raise BundleError(f"{rel!r}: {problem}")
    real_root, real = Path(root).resolve(), (Path(root) / rel).resolve()
    if not real.is_relative_to(real_root):
        raise BundleError(f"{rel}: resolves to {real}, outside the bundle (a symbolic link leads out of it)")
    return real


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def tree_entries(root: Path) -> list[str]:
    """Every entry below ``root`` that is not a real folder (files, links, devices), as POSIX relative paths, but the
    manifest. Symbolic links are listed, never followed: what a bundle holds is what is in its own folder."""
    entries = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        here = Path(folder)
        links = [d for d in dirs if (here / d).is_symlink()]
        for name in files + links:
            rel = (here / name).relative_to(root).as_posix()
            if rel != MANIFEST:
                entries.append(rel)
    return sorted(entries)


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every file below ``root`` but the manifest, keyed by POSIX relative path."""
    return {rel: sha256_file(root / rel) for rel in tree_entries(root)}


def verify_files(root: Path, manifest: Manifest) -> None:
    """Raise BundleError naming every missing, altered, escaping or unlisted file: a bundle is exactly its list."""
    problems = [] if manifest.files else ["the manifest lists no files (an empty list would vouch for anything)"]
    for rel, want in sorted(manifest.files.items()):
        try:
            path = bundle_path(root, rel)
        except BundleError as err:
            problems.append(str(err))
            continue
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif sha256_file(path) != want:
            problems.append(f"{rel}: sha256 differs from the manifest (altered or truncated)")
    problems += [
        f"{rel}: not listed in the manifest (an unlisted file is never trusted; delete it)"
        for rel in tree_entries(Path(root))
        if rel not in manifest.files
    ]
    if problems:
        raise BundleError(
            f"bundle {root} failed verification; rebuild it or copy it again:\n  " + "\n  ".join(problems)
        )


def load_manifest(root: str | os.PathLike, verify: bool = True, staging: bool = False) -> Manifest:
    """Read a bundle's manifest and (by default) check every file against its sha256. A build's staging folder is
    refused unless ``staging`` (the build checking its own before publishing it)."""
    root = Path(root)
    if not root.is_dir():
        set_aside = [
            p / root.name
            for p in root.parent.glob(".*.old-*")
            if p.name.startswith(f".{root.name}.old-") and (p / root.name).is_dir()
        ]
        if set_aside:
            raise BundleError(
                f"no bundle at {root}, but a replace that was interrupted set the previous one aside in "
                f"{set_aside[0]}: run build-engines on {root} again (it puts it back first), or move it "
                "back yourself."
            )
        raise BundleError(f"no bundle at {root}: not a directory. Build one with `build-engines --out {root}`.")
    if STAGING_NAME.match(root.name) and not staging:
        raise BundleError(
            f"{root} is a build's staging folder, not a bundle: the build that wrote it was interrupted "
            f"or is still running. Load the bundle it was publishing, or rebuild it."
        )
    path = root / MANIFEST
    if not path.is_file():
        raise BundleError(f"{root} has no {MANIFEST}: not a bundle, or a build that did not finish. Rebuild it.")
    if path.stat().st_size > 4 * MAX_MANIFEST_CHARS:
        raise BundleError(f"{path} is {path.stat().st_size} bytes: not a manifest this tool wrote")
    manifest = Manifest.from_json(bundle_path(root, MANIFEST).read_text(encoding="utf-8"))
    if verify:
        verify_files(root, manifest)
    return manifest


def read_verified(root: Path, manifest: Manifest, rel: str, verify: bool = True, max_bytes: int | None = None) -> bytes:
    """The bytes of bundle file ``rel``, read once and (with ``verify``) checked against the manifest's sha256;
    ``max_bytes``: BundleError past that many, of which no more than one byte more is read.

    Load from these bytes, never by reopening the path: an in-place copy or a concurrent rebuild could change the
    file between the check and the load.
    """
    if rel not in manifest.files:
        raise BundleError(f"{rel}: not listed in the manifest's files, so it is not part of the bundle; rebuild it")
    path = bundle_path(root, rel)
    try:
        with open(path, "rb") as handle:
            data = handle.read(-1 if max_bytes is None else max_bytes + 1)
    except OSError as err:
        raise BundleError(
            f"{rel}: cannot be read ({err.strerror or err}); rebuild the bundle or copy it again"
        ) from None
    if max_bytes is not None and len(data) > max_bytes:
        raise BundleError(f"{rel}: over the {max_bytes} bytes such a file may have; not a file this tool wrote")
    if verify and hashlib.sha256(data).hexdigest() != manifest.files[rel]:
        raise BundleError(
            f"{rel}: sha256 differs from the manifest: it changed after verification (copied over or "
            "rebuilt while loading?). Load again once the copy is complete."
        )
    return data


def write_manifest_atomic(root: Path, manifest: Manifest) -> None:
    """Replace ``root/manifest.json`` atomically (write a temporary file, fsync, rename)."""
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".manifest-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(manifest.to_json())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, root / MANIFEST)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
