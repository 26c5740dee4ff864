"""Write a Triton model repository for an ONNX Runtime bundle.

The repository a client sees::

    OUT/
      ensemble/        config.pbtxt, 1/           what clients call: text in, text out (tensorrtllm_backend names)
      preprocessing/   config.pbtxt, 1/model.py   validate the request, tokenize the prompt
      speculative/     config.pbtxt, 1/model.py   decoupled: draft-then-verify over the bundle, streams text
                       bundle/                    the bundle (hard links or a copy), unless it is mounted elsewhere
      postprocessing/  config.pbtxt, 1/model.py   detokenize token ids (for clients that call ``speculative``'s
                                                  token path themselves; not a step of the ensemble, see below)

Why the ensemble has two steps, not three. An ensemble streams through a decoupled step (Triton forwards each of its
responses to the next step), but the next step sees every response on its own: a stateless ``postprocessing`` model
cannot hold back half of a UTF-8 character split across two steps, nor cut the text at a stop string that spans
steps. Both need per-sequence text state, so ``speculative`` runs the runtime's own text path
(``SpeculativeGenerator.stream_batch``: tokenize, decode, detokenize incrementally, stop strings), which also makes
its text identical to the Python API's. The ensemble is ``preprocessing -> speculative``: ``preprocessing`` checks the
request (prompt size in bytes before anything else, UTF-8, ``max_tokens`` range) and tokenizes the prompt to refuse
one that leaves no room in the context, before it takes a batch slot, with the front door's own tokenizing and words
(runtime/core/request.py ``prompt_tokens``); ``speculative`` takes ``text_input``, the
checked ``request_output_len`` and the prompt's ``input_ids`` (tokenized once), and admits the request at the
runtime's front door (runtime/core/request.py) with the same bounds as the OpenAI server.
``postprocessing`` is still written, a plain token-ids-to-text model for tools that expect one.

Why an ensemble and not a BLS model: an ensemble needs no Python of its own, streams, and lets Triton's dynamic
batcher group concurrent requests in front of ``speculative``, whose ``execute`` then decodes them together (one
target verify call per step for the whole batch).

HTTP: Triton's ``/infer`` refuses decoupled models; ``/generate`` and ``/generate_stream`` serve them. A repository
written with ``streaming=False`` is not decoupled and serves ``/infer`` (and refuses ``stream=true``).

Names and dtypes of the ensemble's inputs and outputs follow tensorrtllm_backend's
``all_models/inflight_batcher_llm/ensemble/config.pbtxt`` (``text_input`` STRING [1], ``max_tokens`` INT32 [1],
``stop_words`` STRING [-1], ``end_id``/``top_k``/``num_draft_tokens`` INT32 [1], ``temperature``/``top_p`` FP32 [1],
``seed`` UINT64 [1] (older releases: ``random_seed``; both accepted), ``stream`` BOOL [1], and the guided-decoding
inputs of its ``tensorrt_llm/config.pbtxt``, ``guided_decoding_guide_type`` (json, json_schema, regex or ebnf_grammar)
and ``guided_decoding_guide`` STRING [1] (runtime/decoding/grammar.py); outputs ``text_output``
STRING [-1], ``acceptance_rate`` FP32 [1], ``total_accepted_draft_tokens``/``total_draft_tokens`` INT32 [1]).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from runtime.bundle import BundleError, Manifest, load_manifest
from runtime.core.request import Limits
from runtime.core.scheduler import POLICIES
from triton_repo import pbtxt

ENSEMBLE, PREPROCESSING, SPECULATIVE, POSTPROCESSING = "ensemble", "preprocessing", "speculative", "postprocessing"
MODELS_DIR = Path(__file__).parent / "models"  # the Python models, shipped as package data
BUNDLE_DIR = "bundle"  # inside the speculative model's folder; Triton ignores non-numeric sub-folders
MARKER = ".draftsmith-repository"  # written into every repository we generate: what --overwrite may replace
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class RepositoryError(ValueError):
    """The repository cannot be written as asked (a bad name, a bundle this generator does not serve, ...)."""


@dataclass(frozen=True)
class RepoOptions:
    """How the repository is laid out and sized (``write_repository``'s options; ``draftsmith triton-repo``'s flags
    build one). Every field is validated in ``__post_init__``.

    ``copy_bundle``: put the bundle inside ``speculative/bundle`` (hard links when on the same file system, else a
    copy); with ``False`` and no ``bundle_mount``, a relative symbolic link is written (not relocatable on its own).
    ``streaming``: make ``speculative`` (and so the ensemble) decoupled, which streams (gRPC streams,
    ``generate_stream``) but which Triton's HTTP ``/infer`` refuses; ``False`` serves plain request/response clients
    (HTTP ``/infer``, gRPC unary infer, perf_analyzer without streaming) and rejects ``stream=true``.
    """

    instances: int = 1  # instances of the speculative model (each one process holding both engines)
    threads: int = 0  # ONNX Runtime intra-op threads per instance (0: all cores)
    max_batch_size: int = 16  # requests one execute call may decode together
    max_queue_delay_us: int = 2000  # how long the dynamic batcher waits to fill a batch
    preprocessing_instances: int = 1
    max_tokens_limit: int = 0  # largest max_tokens a request may ask for (0: the bundle's context less one)
    max_prompt_bytes: int = 0  # largest prompt in UTF-8 bytes, checked before tokenizing (0: 32 per context token)
    max_stop_words: int = Limits.max_stop_words  # most stop strings one request may send (the front door's)
    max_stop_word_bytes: int = Limits.max_stop_word_bytes  # longest stop string, in UTF-8 bytes
    bundle_mount: str | None = None  # absolute path of the bundle where the server sees it (e.g. /bundles/x)
    copy_bundle: bool = True  # put the bundle inside the repository (hard links when possible, else a copy)
    policy: str = "exact"  # the scheduler's: "exact" (answers as alone) or "throughput" (runtime/core/scheduler.py)
    max_queue: int = 256  # requests waiting for a row before new ones are refused as overloaded
    # each step's draft lengths planned from measured call costs (runtime/decoding/step_costs.py); False: k always
    plan: bool = True
    streaming: bool = True  # decoupled speculative model: streams, but Triton's HTTP /infer refuses decoupled models

    def __post_init__(self) -> None:
        problems = []
        if self.policy not in POLICIES:
            problems.append(f"policy: expected one of {POLICIES}, received {self.policy!r}")
        for name in ("instances", "preprocessing_instances", "max_batch_size", "max_stop_word_bytes", "max_queue"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name}: expected an integer >= 1, received {value!r}")
        for name in ("threads", "max_queue_delay_us", "max_tokens_limit", "max_prompt_bytes", "max_stop_words"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                problems.append(f"{name}: expected an integer >= 0, received {value!r}")
        if self.bundle_mount is not None:
            if not self.bundle_mount.startswith("/") or ".." in Path(self.bundle_mount).parts:
                problems.append(f"bundle_mount: expected an absolute path without '..', received {self.bundle_mount!r}")
            if self.copy_bundle:
                problems.append("bundle_mount: a mounted bundle is not copied; pass copy_bundle=False")
        if problems:
            raise RepositoryError("; ".join(problems))


def check_name(name: str) -> str:
    """A model name (one path component of the repository): letters, digits, '_', '.', '-'; no '..', no '/'."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", "..") or ".." in name:
        raise RepositoryError(
            f"model name {name!r}: expected 1-64 characters of [A-Za-z0-9_.-] starting with a letter or digit, no '..'"
        )
    return name


def _inside(root: Path, rel: str) -> Path:
    """``root / rel`` after checking that it stays inside ``root``."""
    if os.path.isabs(rel) or ".." in Path(rel).parts:
        raise RepositoryError(f"path {rel!r} escapes the repository")
    path = root / rel
    if not path.resolve().is_relative_to(root.resolve()):
        raise RepositoryError(f"path {rel!r} escapes the repository")
    return path


# --- the configs, as data ---------------------------------------------------------------------------------------


def _tensor(name: str, dtype: str, dims: list[int], optional: bool = False, ragged: bool = False) -> dict:
    """One input or output. ``ragged``: requests whose tensors differ in shape still share a batch (Triton's dynamic
    batcher otherwise closes a batch at the first request whose shape differs; the Python models read each request's
    tensors on their own, so any shapes mix)."""
    out = {"name": name, "data_type": dtype, "dims": dims}
    if optional:
        out["optional"] = True
    if ragged:
        out["allow_ragged_batch"] = True
    return out


# (name, dtype, dims): the optional request parameters, passed from the ensemble straight to ``speculative``
OPTIONAL_INPUTS = (
    ("temperature", "TYPE_FP32", [1]),
    ("top_k", "TYPE_INT32", [1]),
    ("top_p", "TYPE_FP32", [1]),
    ("seed", "TYPE_UINT64", [1]),
    ("random_seed", "TYPE_UINT64", [1]),
    ("stop_words", "TYPE_STRING", [-1]),
    ("end_id", "TYPE_INT32", [1]),
    ("stream", "TYPE_BOOL", [1]),
    ("num_draft_tokens", "TYPE_INT32", [1]),
    ("guided_decoding_guide_type", "TYPE_STRING", [1]),
    ("guided_decoding_guide", "TYPE_STRING", [1]),
)
OUTPUTS = (
    ("text_output", "TYPE_STRING", [-1]),
    ("acceptance_rate", "TYPE_FP32", [1]),
    ("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    ("total_draft_tokens", "TYPE_INT32", [1]),
)


def _params(values: dict[str, object]) -> dict:
    return {key: {"string_value": str(value)} for key, value in values.items()}


def _batching(options: RepoOptions) -> dict:
    return {"max_queue_delay_microseconds": options.max_queue_delay_us}


def request_limits(options: RepoOptions, manifest: Manifest) -> dict[str, int]:
    """The bounds every request is checked against before the server works on it (model config parameters): the
    front door's ``Limits`` (runtime/core/request.py), the OpenAI server's defaults too."""
    limits = Limits.for_context(
        manifest.max_context,
        max_tokens_limit=min(options.max_tokens_limit, manifest.max_context - 1),
        max_prompt_bytes=options.max_prompt_bytes,
        max_stop_words=options.max_stop_words,
        max_stop_word_bytes=options.max_stop_word_bytes,
    )
    names = ("max_tokens_limit", "max_prompt_bytes", "max_stop_words", "max_stop_word_bytes")
    return {name: getattr(limits, name) for name in names}


def python_model(
    name: str, options: RepoOptions, inputs: list, outputs: list, instances: dict, parameters: dict, **more
) -> dict:
    """A Python-backend model's config.pbtxt as data: what every model of the repository declares alike."""
    return {
        "name": name,
        "backend": "python",
        "max_batch_size": options.max_batch_size,
        "dynamic_batching": _batching(options),
        "input": inputs,
        "output": outputs,
        "instance_group": [instances],
        "parameters": _params(parameters),
        **more,
    }


def preprocessing_config(options: RepoOptions, manifest: Manifest, tokenizer_rel: str) -> dict:
    limits = request_limits(options, manifest)
    return python_model(
        PREPROCESSING,
        options,
        [_tensor("text_input", "TYPE_STRING", [1]), _tensor("max_tokens", "TYPE_INT32", [1])],
        [
            _tensor("input_ids", "TYPE_INT32", [-1]),
            _tensor("input_lengths", "TYPE_INT32", [1]),
            _tensor("request_output_len", "TYPE_INT32", [1]),
        ],
        {"count": options.preprocessing_instances, "kind": "KIND_CPU"},
        {
            "tokenizer": tokenizer_rel,
            "max_context": manifest.max_context,
            **{k: v for k, v in limits.items() if k in ("max_tokens_limit", "max_prompt_bytes")},
        },
    )


def speculative_config(options: RepoOptions, manifest: Manifest, bundle_ref: str) -> dict:
    return python_model(
        SPECULATIVE,
        options,
        [_tensor("text_input", "TYPE_STRING", [1]), _tensor("request_output_len", "TYPE_INT32", [1])]
        + [_tensor(n, t, d, optional=True, ragged=-1 in d) for n, t, d in OPTIONAL_INPUTS]
        # preprocessing's tokens (the ensemble's): the prompt is tokenized once; called directly, it tokenizes
        + [_tensor("input_ids", "TYPE_INT32", [-1], optional=True, ragged=True)],
        [_tensor(n, t, d) for n, t, d in OUTPUTS],
        # a CUDA bundle: Triton places each instance on a GPU and passes its id (model_instance_device_id)
        {"count": options.instances, "kind": "KIND_GPU" if manifest.spec.device == "cuda" else "KIND_CPU"},
        {
            "bundle": bundle_ref,
            "threads": options.threads,
            **request_limits(options, manifest),
            "policy": options.policy,
            "max_batch": options.max_batch_size,
            "max_queue": options.max_queue,
            "plan": str(options.plan).lower(),
        },
        model_transaction_policy={"decoupled": options.streaming},
    )


def postprocessing_config(options: RepoOptions, manifest: Manifest, tokenizer_rel: str) -> dict:
    return python_model(
        POSTPROCESSING,
        options,
        [_tensor("output_ids", "TYPE_INT32", [-1], ragged=True)],
        [_tensor("text_output", "TYPE_STRING", [-1])],
        {"count": 1, "kind": "KIND_CPU"},
        {"tokenizer": tokenizer_rel, "max_output_ids": manifest.max_context},
    )


def ensemble_config(options: RepoOptions) -> dict:
    optional = [n for n, _, _ in OPTIONAL_INPUTS]
    return {
        "name": ENSEMBLE,
        "platform": "ensemble",
        "max_batch_size": options.max_batch_size,
        "input": [_tensor("text_input", "TYPE_STRING", [1]), _tensor("max_tokens", "TYPE_INT32", [1])]
        + [_tensor(n, t, d, optional=True) for n, t, d in OPTIONAL_INPUTS],
        "output": [_tensor(n, t, d) for n, t, d in OUTPUTS],
        "ensemble_scheduling": {
            "step": [
                {
                    "model_name": PREPROCESSING,
                    "model_version": -1,
                    "input_map": {"text_input": "text_input", "max_tokens": "max_tokens"},
                    "output_map": {"request_output_len": "_request_output_len", "input_ids": "_input_ids"},
                },
                {
                    "model_name": SPECULATIVE,
                    "model_version": -1,
                    "input_map": {
                        "text_input": "text_input",
                        "request_output_len": "_request_output_len",
                        "input_ids": "_input_ids",
                        **{n: n for n in optional},
                    },
                    "output_map": {n: n for n, _, _ in OUTPUTS},
                },
            ]
        },
    }


# --- writing ----------------------------------------------------------------------------------------------------


def write_repository(
    bundle: str | os.PathLike, out: str | os.PathLike, options: RepoOptions | None = None, *, overwrite: bool = False
) -> Path:
    """Write the repository for ``bundle`` (an ONNX Runtime bundle folder, verified against its manifest first) into
    ``out`` (created; must be empty unless ``overwrite``, which replaces only a repository this generator wrote), laid
    out and sized by ``options`` (default: ``RepoOptions()``). Returns the repository path."""
    options = options or RepoOptions()
    bundle = Path(bundle)
    manifest = load_manifest(bundle)
    if manifest.spec.backend != "onnxruntime":
        raise RepositoryError(
            f"bundle backend {manifest.spec.backend!r}: this generator writes Python-backend "
            "repositories for 'onnxruntime' bundles; TensorRT-LLM bundles use trtllm_layouts"
        )
    out = Path(out)
    _check_output(out, overwrite)
    if options.max_tokens_limit > manifest.max_context:
        raise RepositoryError(
            f"max_tokens_limit: expected <= the bundle's max_context {manifest.max_context}, "
            f"received {options.max_tokens_limit}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside OUT and swapped in whole: a failure (an option, a bundle copy that does not verify, a full
    # disk) leaves the old repository as it was. A sibling, so relative links into the bundle stay right.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; tritonserver may run as another user
        _write_models(bundle, manifest, tmp, options)
        _check_output(out, overwrite)  # again: anything may have appeared at OUT meanwhile
        _swap(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_models(bundle: Path, manifest, out: Path, options: RepoOptions) -> None:
    """The four models' folders and the marker, into the (empty) folder ``out``."""
    (out / MARKER).write_text(
        "written by draftsmith triton-repo; --overwrite replaces only such folders\n", encoding="utf-8"
    )
    bundle_ref, tokenizer_ref = _bundle_refs(bundle, out, options)
    models = {
        PREPROCESSING: (preprocessing_config(options, manifest, tokenizer_ref), "preprocessing.py"),
        SPECULATIVE: (speculative_config(options, manifest, bundle_ref), "speculative.py"),
        POSTPROCESSING: (postprocessing_config(options, manifest, tokenizer_ref), "postprocessing.py"),
        ENSEMBLE: (ensemble_config(options), None),
    }
    for name, (config, source) in models.items():
        check_name(name)
        folder = _inside(out, name)
        _inside(out, f"{name}/1").mkdir(parents=True, exist_ok=True)
        (folder / "config.pbtxt").write_text(pbtxt.render(config), encoding="utf-8")
        if source:
            code = MODELS_DIR.joinpath(source).read_text(encoding="utf-8")
            (folder / "1" / "model.py").write_text(code, encoding="utf-8")


def _swap(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` is set aside first and deleted after, or put back
    if the rename fails."""
    old = None
    if out.exists() or out.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / out.name)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old / out.name, out)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _bundle_refs(bundle: Path, out: Path, options: RepoOptions) -> tuple[str, str]:
    """(the bundle as the speculative model finds it, the tokenizer as the pre/postprocessing models do): under
    ``bundle_mount``, else placed inside the repository (copied, hard-linked or linked) and named relative to the
    models' folders."""
    if options.bundle_mount:
        return options.bundle_mount, f"{options.bundle_mount}/tokenizer"
    _place_bundle(bundle, _inside(out, f"{SPECULATIVE}/{BUNDLE_DIR}"), options.copy_bundle)
    # relative to the speculative model's folder, and to the preprocessing model's
    return BUNDLE_DIR, f"../{SPECULATIVE}/{BUNDLE_DIR}/tokenizer"


def _check_output(out: Path, overwrite: bool) -> None:
    """Refuse an existing non-empty ``out`` unless ``overwrite``, and even then unless it is a repository this
    generator wrote (``generated_problem``); nothing is deleted here (``_swap`` replaces it once the new one is
    complete)."""
    if not (out.exists() or out.is_symlink()) or (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):
        return
    if not overwrite:
        raise RepositoryError(f"{out} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    problem = generated_problem(out)
    if problem:
        raise RepositoryError(
            f"{out} is not a repository written by draftsmith triton-repo ({problem}); --overwrite "
            "replaces only those, so nothing was touched. Choose another folder, or move it away "
            "yourself."
        )


def generated_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a repository this generator wrote (None: it is). Ours carry ``MARKER``; one written
    before the marker existed is recognised by holding only our four model folders, each with a config.pbtxt."""
    if folder.is_symlink() or not folder.is_dir():
        return "not a folder, or a symbolic link"
    marker = folder / MARKER
    if marker.is_file() and not marker.is_symlink():
        return None
    names = {p.name for p in folder.iterdir()}
    ours = {PREPROCESSING, SPECULATIVE, POSTPROCESSING, ENSEMBLE}
    if names == ours and all((folder / n / "config.pbtxt").is_file() for n in ours):
        return None
    return f"no {MARKER} marker"


def _place_bundle(bundle: Path, dest: Path, copy: bool) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not copy:
        dest.symlink_to(os.path.relpath(bundle.resolve(), dest.parent.resolve()), target_is_directory=True)
        return

    def link_or_copy(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(bundle, dest, copy_function=link_or_copy)
    try:
        load_manifest(dest)
    except BundleError as err:  # a copy that does not verify must not be served
        raise RepositoryError(f"the bundle copied into {dest} does not verify: {err}") from None
