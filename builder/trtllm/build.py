"""Backend tensorrt_llm: versions and flavors, the fail-fast preflight, and the build's execution.

Two flavors, because TensorRT-LLM changed its workflow during 2026:

* ``engine``: per-architecture ``convert_checkpoint.py`` (builder/trtllm/converters.py) or ModelOpt's
  ``examples/quantization/quantize.py`` (calibrated on a set built from Draftsmith's own prompt files, so no dataset
  is downloaded), then ``trtllm-build`` for the draft and for the target, the target with
  ``--speculative_decoding_mode draft_tokens_external --max_draft_len K``. Released TensorRT-LLM up to 1.3.0rc20
  carries it (the 1.3.0rc20 release notes: "This RC version will be the last one supporting the TensorRT backend").
* ``llmapi``: ModelOpt post-training quantization of the Hugging Face checkpoints, then ``LLM(target,
  speculative_config=DraftTargetDecodingConfig(max_draft_len=K, speculative_model=draft))`` on the PyTorch backend.
  Every release since 1.0 carries it; after 1.3.0rc20 it is the only one.

The plan itself (a pure function of the spec) is builder/trtllm/plan.py; this module runs it.

Bundle layout written by this backend::

    manifest.json            as for onnxruntime; spec.backend "tensorrt_llm", report["trtllm"] holds the plan
    target/engine/           engine flavor: trtllm-build output (config.json + rank{N}.engine)
    draft/engine/
    target/hf/               llmapi flavor: the (ModelOpt-quantized) Hugging Face checkpoint
    draft/hf/
    llm_api.yaml             llmapi flavor: LLM(...) keywords (paths relative to the bundle)
    tokenizer/
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

from runtime.trtllm import paths as trtllm_paths
from builder.trtllm.converters import rope_type_of

# The plan (what each step runs) lives in builder/trtllm/plan.py; this module runs it.
from builder.trtllm.plan import (
    CALIB_FILE,
    LLM_API_FILE,
    MODELOPT_CONFIGS,
    PlanInputs,
    Step,
    calibration_texts,
    check_flavor,
    lengths,
    make_plan,
)
from runtime.bundle import BuildSpec, Manifest, ModelEntry, SpecError

LAST_ENGINE_RELEASE = "1.3.0rc20"  # GitHub release notes of v1.3.0rc20: the last with the TensorRT backend
INSTALL_HINT = "pip install 'draftsmith[tensorrt]'"


class TrtllmError(RuntimeError):
    """The TensorRT-LLM build cannot go on; the message says what is missing and how to get it."""


def write_calibration_set(export_dir: str, root: Path) -> None:
    """``export_dir/train.jsonl``: one {"text": ...} per line, the layout datasets.load_dataset(dir) reads."""
    folder = root / export_dir
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": text}, ensure_ascii=False) for text in calibration_texts()]
    (folder / CALIB_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")


# --- versions, flavors and the preflight ----------------------------------------------------------------------------


def installed_version() -> str | None:
    """tensorrt_llm's version from package metadata (importing it needs CUDA libraries; this does not)."""
    for name in ("tensorrt_llm", "tensorrt-llm"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def carries_engine_path(version: str) -> bool:
    from packaging.version import Version

    return Version(version) <= Version(LAST_ENGINE_RELEASE)


def resolve_flavor(spec: BuildSpec, version: str | None) -> str:
    """The flavor asked for, else the installed version's: engine up to 1.3.0rc20, llmapi after (and when absent)."""
    if spec.trtllm_flavor:
        return spec.trtllm_flavor
    if version is None:
        return "llmapi"
    return "engine" if carries_engine_path(version) else "llmapi"


def gpu_count(run: Callable = subprocess.run) -> int:
    """GPUs listed by `nvidia-smi -L` (0 when there is no driver)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listing = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    if listing.returncode != 0:
        return 0
    return sum(line.startswith("GPU ") for line in (listing.stdout or "").splitlines())


def tool_available(name: str) -> bool:
    """Is a command (on PATH) or a Python package (importable) present, without importing it."""
    import importlib.util

    return shutil.which(name) is not None if name == "trtllm-build" else importlib.util.find_spec(name) is not None


def compute_capability(run: Callable = subprocess.run) -> float | None:
    """The lowest compute capability `nvidia-smi --query-gpu=compute_cap` reports (None when it cannot say)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        listing = run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        values = [float(line) for line in (listing.stdout or "").split() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(values) if listing.returncode == 0 and values else None


def preflight(
    spec: BuildSpec,
    flavor: str,
    version: str | None,
    gpus: int,
    examples_dir: str,
    available: Callable[[str], bool] = tool_available,
    capability: float | None = None,
) -> None:
    """Everything a real build needs, checked before any heavy work; raise TrtllmError naming all that is missing.

    capability: the GPU's compute capability, when known. An FP8 KV cache in an engine needs SM >= 8.9:
    tensorrt_llm/builder.py build() turns FP8 context FMHA, and with it paged context FMHA, off below that
    (tests/fixtures/trtllm/paged_context_fmha.json), and the target then cannot load.
    """
    problems = []
    if flavor == "engine" and spec.kv_cache_dtype == "fp8" and capability is not None and capability < 8.9:
        problems.append(
            f"kv_cache_dtype fp8 needs a GPU of compute capability >= 8.9 (Ada/Hopper) for the engine "
            f"flavor; this one reports {capability}: drop --kv-cache-dtype fp8"
        )
    if version is None:
        problems.append(f"TensorRT-LLM is not installed: {INSTALL_HINT} (on a Linux machine with an NVIDIA GPU)")
    if gpus == 0:
        problems.append(
            "no NVIDIA GPU is visible (`nvidia-smi -L` lists none): TensorRT-LLM builds and runs on GPUs "
            "only; `build-engines --dry-run` prints the plan without one"
        )
    elif spec.tp_size * spec.pp_size > gpus:
        problems.append(f"tp_size x pp_size = {spec.tp_size * spec.pp_size} GPUs per engine, but {gpus} visible")
    if version is not None and flavor == "engine" and not carries_engine_path(version):
        problems.append(
            f"tensorrt_llm {version} has no TensorRT engine backend (removed after {LAST_ENGINE_RELEASE}): "
            "use --trtllm-flavor llmapi, or install tensorrt-llm<1.3 for the engine flavor"
        )
    if flavor == "engine":
        if not available("trtllm-build"):
            problems.append("trtllm-build is not on PATH (it ships with tensorrt-llm <= 1.3.0rc20)")
        if not Path(examples_dir).is_dir():
            looked = ", ".join(trtllm_paths.candidates("examples"))
            problems.append(
                f"TensorRT-LLM examples not found at {examples_dir} (looked in {looked}): set "
                "TRTLLM_EXAMPLES=/path/to/TensorRT-LLM/examples of the release that matches the wheel"
            )
    elif any(q in MODELOPT_CONFIGS for q in (spec.target_quant, spec.draft_quant)):
        if not available("modelopt"):
            problems.append(
                "nvidia-modelopt is not installed (ModelOpt quantization): pip install 'nvidia-modelopt[torch]'"
            )
    if problems:
        raise TrtllmError("cannot build TensorRT-LLM engines here:\n  " + "\n  ".join(problems))


# --- execution -------------------------------------------------------------------------------------------------------

Stage = Callable[[str], None]
Runner = Callable[[Step, Path], None]


def build(
    spec: BuildSpec,
    out: str | Path,
    force: bool = False,
    on_stage: Stage | None = None,
    runner: Runner | None = None,
    examples_dir: str | None = None,
    version: str | None = None,
    gpus: int | None = None,
    available: Callable[[str], bool] = tool_available,
) -> Manifest:
    """Build a tensorrt_llm bundle at ``out``. ``runner``, ``version``, ``gpus`` and ``available`` stand in for the
    GPU machine in tests."""
    from builder import publish

    out = Path(out).absolute()
    stage = on_stage or (lambda name: None)
    examples_dir = examples_dir or trtllm_paths.examples_dir()
    version = installed_version() if version is None else version
    flavor = resolve_flavor(spec, version)
    check_flavor(spec, flavor)
    publish.check_output(out, force, publish.BUNDLE)
    preflight(
        spec,
        flavor,
        version,
        gpu_count() if gpus is None else gpus,
        examples_dir,
        available,
        compute_capability() if gpus is None else None,
    )
    stage("resolve")
    spec = dataclasses.replace(spec, trtllm_flavor=flavor)
    target, draft, pair, target_tok = resolve_pair(spec)
    steps = make_plan(spec, flavor, plan_inputs(target, draft, pair.max_context, examples_dir))
    started = time.perf_counter()
    with publish.staging(out, force, publish.BUNDLE) as tmp:
        for number, step in enumerate(steps, 1):
            stage(f"{number}/{len(steps)} {step.role}: {step.name}")
            (runner or run_step)(step, tmp)
            missing = [o for o in step.outputs if not (tmp / o).exists()]
            if missing:
                raise TrtllmError(f"step {step.role}: {step.name} finished without writing {', '.join(missing)}")
        shutil.rmtree(tmp / "_work", ignore_errors=True)
        stage("tokenizer")
        target_tok.save_pretrained(str(tmp / "tokenizer"))
        manifest = _manifest(spec, flavor, version, steps, target, draft, pair, target_tok, tmp)
        manifest.report["build_seconds"] = round(time.perf_counter() - started, 1)
        return publish.finish_bundle(tmp, manifest, out, stage)


def resolve_pair(spec: BuildSpec):
    """The ONNX path's checkpoint resolution and pair checks: (target, draft, Pairing, target tokenizer)."""
    from builder import checkpoint as ckpt
    from builder import pairing

    target = ckpt.resolve(spec.target, spec.allow_pickle, spec.trust_remote_code)
    draft = target if spec.draft == "self" else ckpt.resolve(spec.draft, spec.allow_pickle, spec.trust_remote_code)
    target_tok = target.load_tokenizer()
    draft_tok = target_tok if draft is target else draft.load_tokenizer()
    pair = pairing.pair(target_tok, draft_tok, target, draft, spec.max_context)
    if pair.cross:  # the draft engine TensorRT-LLM builds shares the target's vocabulary by construction
        raise pairing.PairingError(
            f"{spec.draft} has a tokenizer of its own ({pair.shared_tokens} tokens shared with "
            "the target's): cross-tokenizer drafts need the ONNX Runtime backend (--backend "
            "onnxruntime); TensorRT-LLM drafts share the target's vocabulary"
        )
    return target, draft, pair, target_tok


def plan_inputs(target, draft, max_context: int, examples_dir: str) -> PlanInputs:
    for checkpoint in (target, draft):
        if checkpoint.gguf_file:
            raise SpecError(
                f"target/draft: expected a Hugging Face folder for backend tensorrt_llm (TensorRT-LLM "
                f"converts safetensors checkpoints), received the GGUF file {checkpoint.source!r}"
            )
    pair = {"target": target, "draft": draft}
    return PlanInputs(
        sources={role: str(c.folder) for role, c in pair.items()},
        architectures={role: c.architecture.name for role, c in pair.items()},
        max_context=max_context,
        examples_dir=examples_dir,
        heads={role: getattr(c.config, "num_attention_heads", None) for role, c in pair.items()},
        rope_types={role: rope_type_of(c.config) for role, c in pair.items()},
    )


def dry_run(spec: BuildSpec, examples_dir: str | None = None, version: str | None = None) -> tuple[str, list[Step]]:
    """The plan a real build would run here, after the same pair checks; needs no GPU and no tensorrt_llm."""
    version = installed_version() if version is None else version
    flavor = resolve_flavor(spec, version)
    check_flavor(spec, flavor)
    spec = dataclasses.replace(spec, trtllm_flavor=flavor)
    target, draft, pair, _ = resolve_pair(spec)
    examples_dir = examples_dir or trtllm_paths.examples_dir()
    steps = make_plan(spec, flavor, plan_inputs(target, draft, pair.max_context, examples_dir))
    return flavor, steps


def run_step(step: Step, root: Path) -> None:
    """Run one step inside ``root`` (the bundle being built)."""
    if step.argv:
        for output in step.outputs:
            (root / output).parent.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(list(step.argv), cwd=root)
        if result.returncode != 0:
            raise TrtllmError(
                f"step {step.role}: {step.name} failed (exit {result.returncode}): {shlex.join(step.argv)}"
            )
    elif step.call == "builder.trtllm.build.write_calibration_set":
        write_calibration_set(root=root, **step.kwargs)
    elif step.call == "builder.trtllm.build.copy_checkpoint":
        copy_checkpoint(root=root, **step.kwargs)
    elif step.call == "builder.trtllm.build.modelopt_quantize":
        modelopt_quantize(root=root, **step.kwargs)
    elif step.call == "tensorrt_llm.LLM":
        import yaml

        (root / LLM_API_FILE).write_text(yaml.safe_dump(step.kwargs, sort_keys=False), encoding="utf-8")
    else:
        raise TrtllmError(f"unknown plan call {step.call!r}")


def copy_checkpoint(model_dir: str, export_dir: str, root: Path) -> None:
    """An unquantized Hugging Face checkpoint, copied into the bundle (config, weights, generation config)."""
    destination = root / export_dir
    destination.mkdir(parents=True, exist_ok=True)
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file() and (path.suffix in (".json", ".safetensors") or path.name == "tokenizer.model"):
            shutil.copy2(path, destination / path.name)


def modelopt_quantize(
    model_dir: str, export_dir: str, quant_cfg: str, dtype: str, calib_samples: int, root: Path
) -> None:
    """ModelOpt post-training quantization on the GPU, calibrated on calibration_texts(), exported for the LLM API.

    APIs: modelopt.torch.quantization.quantize(model, config, forward_loop) and
    modelopt.torch.export.export_hf_checkpoint(model, dtype=None, export_dir=...) (ModelOpt's unified HF export).
    """
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("\n\n".join(calibration_texts()), return_tensors="pt")["input_ids"][0]
    window = 256
    chunks = [ids[i : i + window] for i in range(0, max(len(ids) - window, 1), window)][:calib_samples]

    def forward_loop(m):
        with torch.no_grad():
            for chunk in chunks:
                m(chunk[None].cuda())

    mtq.quantize(model, getattr(mtq, quant_cfg), forward_loop=forward_loop)
    with torch.inference_mode():
        export_hf_checkpoint(model, dtype=torch_dtype, export_dir=str(root / export_dir))
    tokenizer.save_pretrained(str(root / export_dir))


def _manifest(spec, flavor, version, steps, target, draft, pair, target_tok, tmp: Path) -> Manifest:
    from builder.manifest import eos_ids, tool_versions

    entries = {}
    for role, checkpoint, quant in (("target", target, spec.target_quant), ("draft", draft, spec.draft_quant)):
        config = checkpoint.config
        heads = config.num_attention_heads
        engine = f"{role}/engine" if flavor == "engine" else f"{role}/hf"
        size = sum(p.stat().st_size for p in (tmp / engine).rglob("*") if p.is_file())
        entries[role] = ModelEntry(
            role=role,
            source=spec.target if role == "target" else spec.draft,
            source_sha256=checkpoint.sha256(),
            architecture=checkpoint.architecture.name,
            quant=quant,
            engine=engine,
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", heads) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            max_context=pair.max_context,
            size_bytes=size,
        )
    _, max_seq_len = lengths(spec, pair.max_context)
    report = {
        "trtllm": {
            "flavor": flavor,
            "version": version,
            "plan": [s.to_dict() for s in steps],
            "max_seq_len": max_seq_len,
        },
        "pair_notes": list(pair.notes),
    }
    tools = tool_versions()
    if version:
        tools["tensorrt_llm"] = version
    return Manifest(
        spec=spec,
        target=entries["target"],
        draft=entries["draft"],
        files={},
        default_k=spec.k,
        max_context=max_seq_len,
        eos_token_ids=eos_ids(target, target_tok),
        tools=tools,
        report=report,
    )
