"""Backend tensorrt_llm: the build plan as data, its checks, the fail-fast preflight, and its execution.

Two flavors, because TensorRT-LLM changed its workflow during 2026:

* ``engine``: per-architecture ``convert_checkpoint.py`` (or ModelOpt's ``examples/quantization/quantize.py``,
  calibrated on a set built from Draftsmith's own prompt files, so no dataset is downloaded), then ``trtllm-build``
  for the draft and for the target, the target with ``--speculative_decoding_mode draft_tokens_external
  --max_draft_len K`` and no logits-gathering flag: ``trtllm-build`` refuses ``--gather_context_logits`` with a
  draft length > 0 (tests/fixtures/trtllm/trtllm_build.json), so the target verifies the draft's tokens itself
  (executor ``ExternalDraftTokensConfig``, as Triton's ``tensorrt_llm_bls`` does) instead of returning logits.
  Released TensorRT-LLM up to 1.3.0rc20 carries it (the 1.3.0rc20 release notes: "This RC version will be the last
  one supporting the TensorRT backend"; stable 1.2.x carries it).
* ``llmapi``: ModelOpt post-training quantization of the Hugging Face checkpoints (``mtq.quantize`` +
  ``export_hf_checkpoint``), then ``LLM(target, speculative_config=DraftTargetDecodingConfig(max_draft_len=K,
  speculative_model=draft))`` on the PyTorch backend. Every release since 1.0 carries it; after 1.3.0rc20 it is the
  only one (docs/source/legacy/tensorrt-backend-removal.md).

The plan is a list of Steps (commands with every argument, or Python calls with every keyword), made by a pure
function (``make_plan``) so that ``build-engines --dry-run`` prints exactly what a build runs and the tests compare
it with golden files. Sources for every flag are cited where it is emitted; docs/tensorrt_llm.md has the links.

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
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from runtime.bundle import BuildSpec, Manifest, ModelEntry, SpecError
from runtime.trtllm_engine import DECODING_TYPE

FLAVORS = ("engine", "llmapi")
LAST_ENGINE_RELEASE = "1.3.0rc20"  # GitHub release notes of v1.3.0rc20: the last with the TensorRT backend
# The NGC release container keeps the examples there (tensorrtllm_backend docs and NVIDIA's container layout);
# override with TRTLLM_EXAMPLES=/path/to/TensorRT-LLM/examples.
DEFAULT_EXAMPLES = "/app/tensorrt_llm/examples"
INSTALL_HINT = "pip install 'draftsmith[tensorrt]'"

# Which formats each flavor builds.
# engine: convert_checkpoint.py --use_weight_only --weight_only_precision {int8,int4} (examples/models/core/llama/
#   convert_checkpoint.py argparse choices), quantize.py --qformat {fp8,int8_sq,int4_awq,w4a8_awq,...}
#   (examples/quantization/quantize.py argparse choices).
# llmapi: the PyTorch backend runs ModelOpt checkpoints in FP8, FP4, W4A16 AWQ, W4A8 AWQ, W4A16/W4A8 GPTQ
#   (docs/source/features/quantization.md, "Quantization in TensorRT LLM"); INT8 SmoothQuant and INT8/INT4
#   weight-only are not in that list, so they are refused rather than built into a checkpoint that does not load.
FLAVOR_QUANTS = {
    "engine": ("fp16", "bf16", "int8", "int4", "int4_awq", "int8_sq", "w4a8_awq", "fp8"),
    "llmapi": ("fp16", "bf16", "int4_awq", "w4a8_awq", "fp8"),
}
WEIGHT_ONLY = ("int8", "int4")  # convert_checkpoint.py --weight_only_precision
QFORMATS = ("int4_awq", "int8_sq", "w4a8_awq", "fp8")  # quantize.py --qformat
# ModelOpt configs (modelopt.torch.quantization), as TensorRT-LLM's own tensorrt_llm/quantization/
# quantize_by_modelopt.py maps them: quant_cfg_choices() {"fp8": FP8_DEFAULT_CFG, "int4_awq": INT4_AWQ_CFG,
# "w4a8_awq": W4A8_AWQ_BETA_CFG, ...}.
MODELOPT_CONFIGS = {"fp8": "FP8_DEFAULT_CFG", "int4_awq": "INT4_AWQ_CFG", "w4a8_awq": "W4A8_AWQ_BETA_CFG"}
DTYPES = {"bf16": "bfloat16"}  # everything else runs its unquantized part in float16
# convert_checkpoint.py per architecture (TensorRT-LLM examples/models/core/<family>/; Mistral uses the Llama one).
CONVERT_SCRIPTS = {
    "LlamaForCausalLM": "models/core/llama/convert_checkpoint.py",
    "MistralForCausalLM": "models/core/llama/convert_checkpoint.py",
    "Qwen2ForCausalLM": "models/core/qwen/convert_checkpoint.py",
}
# Calibration: quantize.py's --calib_dataset defaults to the hub dataset cnn_dailymail; a local directory is loaded
# with datasets.load_dataset(dir, split="train") and its "text" column is used (tensorrt_llm/quantization/
# quantize_by_modelopt.py get_calib_dataloader; tests/fixtures/trtllm/quantize.json). The plan writes such a folder
# from the shipped prompt files first, so fp8 / int8_sq / AWQ builds work offline.
CALIB_DIR = "_work/calibration"
CALIB_FILE = "train.jsonl"
MODELOPT_CALIB_SAMPLES = 64  # llmapi flavor: calibration passes over the same texts
LLM_API_FILE = "llm_api.yaml"



class TrtllmError(RuntimeError):
    """The TensorRT-LLM build cannot go on; the message says what is missing and how to get it."""


# --- the plan --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """One unit of work: a command (argv) or a Python call (call + kwargs), run inside the bundle directory."""

    role: str  # "target", "draft" or "bundle"
    name: str  # convert | quantize | build | copy | modelopt | llm_api
    argv: tuple[str, ...] = ()
    call: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()  # paths (relative to the bundle) the step creates

    def to_dict(self) -> dict[str, Any]:
        data = {"role": self.role, "name": self.name, "outputs": list(self.outputs)}
        if self.argv:
            data["argv"] = list(self.argv)
        else:
            data["call"], data["kwargs"] = self.call, self.kwargs
        return data

    def render(self) -> str:
        if self.argv:
            return " \\\n    ".join(_argv_lines(self.argv))
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.call}({args})"


def _argv_lines(argv: tuple[str, ...]) -> list[str]:
    """Group '--flag value' pairs on one line each, for a readable dry run."""
    lines, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            lines.append(f"{shlex.quote(token)} {shlex.quote(argv[i + 1])}")
            i += 2
        else:
            lines.append(shlex.quote(token))
            i += 1
    head = lines[0]
    while len(lines) > 1 and not lines[1].startswith("--"):  # the program and its script stay on line one
        head += " " + lines.pop(1)
    return [head] + lines[1:]


@dataclass(frozen=True)
class PlanInputs:
    """What make_plan needs beyond the spec; resolved from the checkpoints, or given by a test."""

    sources: dict[str, str]  # role -> checkpoint folder
    architectures: dict[str, str]  # role -> config.json architecture
    max_context: int  # the pair's usable context
    examples_dir: str = DEFAULT_EXAMPLES


def lengths(spec: BuildSpec, max_context: int) -> tuple[int, int]:
    """(max_input_len, max_seq_len) of the engines; raise SpecError when they do not fit the pair."""
    usable = min(spec.max_context or max_context, max_context)
    seq = spec.max_seq_len or usable
    if seq > usable:
        raise SpecError(f"max_seq_len: expected <= the pair's usable context ({usable}), received {seq}")
    prompt = spec.max_input_len or seq - 1
    if not 1 <= prompt < seq:
        raise SpecError(f"max_input_len: expected 1 .. max_seq_len - 1 ({seq - 1}), received {prompt}")
    return prompt, seq


def check_flavor(spec: BuildSpec, flavor: str) -> None:
    """Raise SpecError for what this flavor cannot build (collects both roles)."""
    if flavor not in FLAVORS:
        raise SpecError(f"trtllm_flavor: expected one of {FLAVORS}, received {flavor!r}")
    problems = [f"{name}: expected one of {FLAVOR_QUANTS[flavor]} for TensorRT-LLM flavor {flavor!r}, "
                f"received {getattr(spec, name)!r}"
                for name in ("target_quant", "draft_quant") if getattr(spec, name) not in FLAVOR_QUANTS[flavor]]
    if spec.draft.startswith("self:"):
        problems.append(f"draft: expected a checkpoint path or 'self' for backend tensorrt_llm (a truncated "
                        f"self-draft is an ONNX-only option), received {spec.draft!r}")
    if problems:
        raise SpecError("; ".join(problems))


def make_plan(spec: BuildSpec, flavor: str, inputs: PlanInputs) -> list[Step]:
    """Every step of a TensorRT-LLM build, in order. Pure: no file, no GPU, no tensorrt_llm needed."""
    check_flavor(spec, flavor)
    max_input_len, max_seq_len = lengths(spec, inputs.max_context)
    quants = {"target": spec.target_quant, "draft": spec.draft_quant}
    steps: list[Step] = []
    if flavor == "engine":
        if any(q in QFORMATS for q in quants.values()):
            steps.append(_calibration_step())
        for role in ("draft", "target"):
            steps += _engine_steps(spec, role, quants[role], inputs, max_input_len, max_seq_len)
    else:
        for role in ("draft", "target"):
            steps.append(_hf_step(role, quants[role], inputs.sources[role]))
        steps.append(_llm_api_step(spec, max_seq_len))
    return steps


def _engine_steps(spec: BuildSpec, role: str, quant: str, inputs: PlanInputs, max_input_len: int,
                  max_seq_len: int) -> list[Step]:
    checkpoint = f"_work/{role}.ckpt"
    dtype = DTYPES.get(quant, "float16")
    parallel = ("--tp_size", str(spec.tp_size), "--pp_size", str(spec.pp_size))
    if quant in QFORMATS:
        # examples/quantization/quantize.py: --model_dir --output_dir --dtype --qformat --calib_dataset --calib_size
        # --tp_size --pp_size (argparse; tests/fixtures/trtllm/quantize.json).
        convert = Step(role, "quantize", argv=(
            "python3", f"{inputs.examples_dir}/quantization/quantize.py", "--model_dir", inputs.sources[role],
            "--output_dir", checkpoint, "--dtype", dtype, "--qformat", quant, "--calib_dataset", CALIB_DIR,
            "--calib_size", str(len(calibration_texts())), *parallel), outputs=(checkpoint,))
    else:
        architecture = inputs.architectures[role]
        if architecture not in CONVERT_SCRIPTS:
            raise SpecError(f"{role}: expected an architecture with a TensorRT-LLM convert_checkpoint.py "
                            f"({', '.join(sorted(CONVERT_SCRIPTS))}), received {architecture!r}")
        # examples/models/core/llama/convert_checkpoint.py: --model_dir --output_dir --dtype --tp_size --pp_size
        # --use_weight_only --weight_only_precision {int8,int4} (draft_target_model/README.md uses the first five).
        weight_only = ("--use_weight_only", "--weight_only_precision", quant) if quant in WEIGHT_ONLY else ()
        convert = Step(role, "convert", argv=(
            "python3", f"{inputs.examples_dir}/{CONVERT_SCRIPTS[architecture]}", "--model_dir", inputs.sources[role],
            "--output_dir", checkpoint, "--dtype", dtype, *parallel, *weight_only), outputs=(checkpoint,))
    engine = f"{role}/engine"
    # trtllm-build flags, from examples/draft_target_model/README.md ("Build draft and target engines"):
    # --use_paged_context_fmha=enable on both (KV-cache reuse between draft and verify calls), --max_batch_size,
    # --max_input_len, --max_seq_len, --gemm_plugin=float16 for unquantized fp16 weights; the target gets
    # --speculative_decoding_mode=draft_tokens_external and --max_draft_len.
    # No logits flag: build.py raises "Gather context logits is not support with draft len > 0" for
    # --gather_context_logits (or --gather_all_token_logits) with --max_draft_len > 0, and later builds deprecate
    # --gather_generation_logits ("Use --output_generation_logits at runtime instead"); the target verifies
    # draft tokens itself (tests/fixtures/trtllm/trtllm_build.json).
    gemm = ("--gemm_plugin", dtype) if quant in ("fp16", "bf16", "int8", "int4") else ()
    speculative = (("--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(spec.max_k))
                   if role == "target" else ())
    build = Step(role, "build", argv=(
        "trtllm-build", "--checkpoint_dir", checkpoint, "--output_dir", engine, *gemm,
        "--use_paged_context_fmha", "enable", "--max_batch_size", str(spec.max_batch_size),
        "--max_input_len", str(max_input_len), "--max_seq_len", str(max_seq_len), *speculative), outputs=(engine,))
    return [convert, build]


def _calibration_step() -> Step:
    return Step("bundle", "calibration", call="builder.trtllm.write_calibration_set",
                kwargs={"export_dir": CALIB_DIR}, outputs=(f"{CALIB_DIR}/{CALIB_FILE}",))


def calibration_texts() -> list[str]:
    """Calibration texts from the shipped prompt files (builder/data/distill_prompts.txt and eval.txt).

    Why: quantize.py's default calibration set is a hub download; these need no network and are of the kind of
    text Draftsmith's users run.
    """
    from builder import evaluate
    from builder.distill.corpus import load_prompts
    paragraphs = [p.strip() for p in evaluate.eval_text().split("\n\n") if p.strip()]
    return [prompt.text.strip() for prompt in load_prompts()] + paragraphs


def write_calibration_set(export_dir: str, root: Path) -> None:
    """``export_dir/train.jsonl``: one {"text": ...} per line, the layout datasets.load_dataset(dir) reads."""
    folder = root / export_dir
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": text}, ensure_ascii=False) for text in calibration_texts()]
    (folder / CALIB_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")


def _hf_step(role: str, quant: str, source: str) -> Step:
    export = f"{role}/hf"
    if quant not in MODELOPT_CONFIGS:
        return Step(role, "copy", call="builder.trtllm.copy_checkpoint",
                    kwargs={"model_dir": source, "export_dir": export}, outputs=(export,))
    # ModelOpt: modelopt.torch.quantization.quantize(model, config, forward_loop=...) then
    # modelopt.torch.export.export_hf_checkpoint(model, dtype=..., export_dir=...) (modelopt/torch/export/
    # unified_export_hf.py), the "unified HF checkpoint" the PyTorch backend loads.
    return Step(role, "modelopt", call="builder.trtllm.modelopt_quantize",
                kwargs={"model_dir": source, "export_dir": export, "quant_cfg": MODELOPT_CONFIGS[quant],
                        "dtype": "float16", "calib_samples": MODELOPT_CALIB_SAMPLES}, outputs=(export,))


def llm_api_kwargs(spec: BuildSpec, max_seq_len: int) -> dict[str, Any]:
    """LLM(...) keywords of an llmapi bundle, paths relative to the bundle (runtime/trtllm_engine.py resolves them).

    Names: tensorrt_llm/llmapi/llm_args.py (BaseLlmArgs: model, tokenizer, dtype, tensor_parallel_size,
    pipeline_parallel_size, max_batch_size, max_seq_len; TorchLlmArgs: disable_overlap_scheduler).
    speculative_config is written as from_dict reads it: decoding_type "DraftTarget" (the table key in 1.0-1.2; main
    accepts it too), max_draft_len, and the draft path (runtime/trtllm_engine.py and the Triton model.yaml pick the
    field name the release uses). Only current main validates max_draft_len > 0 and a set speculative_model
    (validate_draft_target_config); 1.0-1.2 have no such validator, so make_plan's own checks (max_k >= k >= 1)
    stand in for it. disable_overlap_scheduler=True: the draft/target quick start in docs/source/features/
    speculative-decoding.md passes it (tests/fixtures/trtllm/decoding_types.json).
    """
    return {
        "model": "target/hf",
        "tokenizer": "tokenizer",
        "dtype": "bfloat16" if spec.target_quant == "bf16" else "float16",
        "tensor_parallel_size": spec.tp_size,
        "pipeline_parallel_size": spec.pp_size,
        "max_batch_size": spec.max_batch_size,
        "max_seq_len": max_seq_len,
        "disable_overlap_scheduler": True,
        "speculative_config": {"decoding_type": DECODING_TYPE, "max_draft_len": spec.max_k,
                               "speculative_model": "draft/hf"},
    }


def _llm_api_step(spec: BuildSpec, max_seq_len: int) -> Step:
    return Step("bundle", "llm_api", call="tensorrt_llm.LLM", kwargs=llm_api_kwargs(spec, max_seq_len),
                outputs=(LLM_API_FILE,))


def render_plan(steps: list[Step], flavor: str) -> str:
    """The dry-run text: every step, numbered, runnable from the bundle directory."""
    lines = [f"# TensorRT-LLM {flavor} flavor: {len(steps)} steps, run from the bundle directory"]
    for number, step in enumerate(steps, 1):
        lines.append(f"# {number}. {step.role}: {step.name}")
        lines.append(step.render())
    return "\n".join(lines) + "\n"


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


def preflight(spec: BuildSpec, flavor: str, version: str | None, gpus: int, examples_dir: str,
              available: Callable[[str], bool] = tool_available) -> None:
    """Everything a real build needs, checked before any heavy work; raise TrtllmError naming all that is missing."""
    problems = []
    if version is None:
        problems.append(f"TensorRT-LLM is not installed: {INSTALL_HINT} (on a Linux machine with an NVIDIA GPU)")
    if gpus == 0:
        problems.append("no NVIDIA GPU is visible (`nvidia-smi -L` lists none): TensorRT-LLM builds and runs on GPUs "
                        "only; `build-engines --dry-run` prints the plan without one")
    elif spec.tp_size * spec.pp_size > gpus:
        problems.append(f"tp_size x pp_size = {spec.tp_size * spec.pp_size} GPUs per engine, but {gpus} visible")
    if version is not None and flavor == "engine" and not carries_engine_path(version):
        problems.append(f"tensorrt_llm {version} has no TensorRT engine backend (removed after {LAST_ENGINE_RELEASE}): "
                        "use --trtllm-flavor llmapi, or install tensorrt-llm<1.3 for the engine flavor")
    if flavor == "engine":
        if not available("trtllm-build"):
            problems.append("trtllm-build is not on PATH (it ships with tensorrt-llm <= 1.3.0rc20)")
        if not Path(examples_dir).is_dir():
            problems.append(f"TensorRT-LLM examples not found at {examples_dir}: clone the TensorRT-LLM release that "
                            "matches the installed wheel and set TRTLLM_EXAMPLES=/path/to/TensorRT-LLM/examples")
    elif any(q in MODELOPT_CONFIGS for q in (spec.target_quant, spec.draft_quant)):
        if not available("modelopt"):
            problems.append("nvidia-modelopt is not installed (ModelOpt quantization): "
                            "pip install 'nvidia-modelopt[torch]'")
    if problems:
        raise TrtllmError("cannot build TensorRT-LLM engines here:\n  " + "\n  ".join(problems))


# --- execution -------------------------------------------------------------------------------------------------------

Stage = Callable[[str], None]
Runner = Callable[[Step, Path], None]


def build(spec: BuildSpec, out: str | Path, force: bool = False, on_stage: Stage | None = None,
          runner: Runner | None = None, examples_dir: str | None = None, version: str | None = None,
          gpus: int | None = None, available: Callable[[str], bool] = tool_available) -> Manifest:
    """Build a tensorrt_llm bundle at ``out``. ``runner``, ``version``, ``gpus`` and ``available`` stand in for the
    GPU machine in tests."""
    from builder import build as onnx_build
    out = Path(out).absolute()
    stage = on_stage or (lambda name: None)
    examples_dir = examples_dir or os.environ.get("TRTLLM_EXAMPLES", DEFAULT_EXAMPLES)
    version = installed_version() if version is None else version
    flavor = resolve_flavor(spec, version)
    check_flavor(spec, flavor)
    onnx_build.check_output(out, force)
    preflight(spec, flavor, version, gpu_count() if gpus is None else gpus, examples_dir, available)
    stage("resolve")
    spec = dataclasses.replace(spec, trtllm_flavor=flavor)
    target, draft, pair, target_tok = resolve_pair(spec)
    steps = make_plan(spec, flavor, plan_inputs(target, draft, pair.max_context, examples_dir))
    started = time.perf_counter()
    with onnx_build.staging(out, force) as tmp:
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
        return onnx_build._finish(tmp, manifest, out, stage)


def resolve_pair(spec: BuildSpec):
    """The ONNX path's checkpoint resolution and pair checks: (target, draft, Pairing, target tokenizer)."""
    from builder import checkpoint as ckpt
    from builder import pairing
    target = ckpt.resolve(spec.target, spec.allow_pickle, spec.trust_remote_code)
    draft = target if spec.draft == "self" else ckpt.resolve(spec.draft, spec.allow_pickle, spec.trust_remote_code)
    target_tok = target.load_tokenizer()
    draft_tok = target_tok if draft is target else draft.load_tokenizer()
    pair = pairing.pair(target_tok, draft_tok, target, draft, spec.max_context)
    return target, draft, pair, target_tok


def plan_inputs(target, draft, max_context: int, examples_dir: str) -> PlanInputs:
    for checkpoint in (target, draft):
        if checkpoint.gguf_file:
            raise SpecError(f"target/draft: expected a Hugging Face folder for backend tensorrt_llm (TensorRT-LLM "
                            f"converts safetensors checkpoints), received the GGUF file {checkpoint.source!r}")
    return PlanInputs(sources={"target": str(target.folder), "draft": str(draft.folder)},
                      architectures={"target": target.architecture.name, "draft": draft.architecture.name},
                      max_context=max_context, examples_dir=examples_dir)


def dry_run(spec: BuildSpec, examples_dir: str | None = None, version: str | None = None) -> tuple[str, list[Step]]:
    """The plan a real build would run here, after the same pair checks; needs no GPU and no tensorrt_llm."""
    version = installed_version() if version is None else version
    flavor = resolve_flavor(spec, version)
    check_flavor(spec, flavor)
    spec = dataclasses.replace(spec, trtllm_flavor=flavor)
    target, draft, pair, _ = resolve_pair(spec)
    examples_dir = examples_dir or os.environ.get("TRTLLM_EXAMPLES", DEFAULT_EXAMPLES)
    steps = make_plan(spec, flavor, plan_inputs(target, draft, pair.max_context, examples_dir))
    return flavor, steps


def run_step(step: Step, root: Path) -> None:
    """Run one step inside ``root`` (the bundle being built)."""
    if step.argv:
        for output in step.outputs:
            (root / output).parent.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(list(step.argv), cwd=root)
        if result.returncode != 0:
            raise TrtllmError(f"step {step.role}: {step.name} failed (exit {result.returncode}): "
                              f"{shlex.join(step.argv)}")
    elif step.call == "builder.trtllm.write_calibration_set":
        write_calibration_set(root=root, **step.kwargs)
    elif step.call == "builder.trtllm.copy_checkpoint":
        copy_checkpoint(root=root, **step.kwargs)
    elif step.call == "builder.trtllm.modelopt_quantize":
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


def modelopt_quantize(model_dir: str, export_dir: str, quant_cfg: str, dtype: str, calib_samples: int,
                      root: Path) -> None:
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
    chunks = [ids[i:i + window] for i in range(0, max(len(ids) - window, 1), window)][:calib_samples]

    def forward_loop(m):
        with torch.no_grad():
            for chunk in chunks:
                m(chunk[None].cuda())

    mtq.quantize(model, getattr(mtq, quant_cfg), forward_loop=forward_loop)
    with torch.inference_mode():
        export_hf_checkpoint(model, dtype=torch_dtype, export_dir=str(root / export_dir))
    tokenizer.save_pretrained(str(root / export_dir))


def _manifest(spec, flavor, version, steps, target, draft, pair, target_tok, tmp: Path) -> Manifest:
    from builder.build import _eos_ids, _tool_versions
    entries = {}
    for role, checkpoint, quant in (("target", target, spec.target_quant), ("draft", draft, spec.draft_quant)):
        config = checkpoint.config
        heads = config.num_attention_heads
        engine = f"{role}/engine" if flavor == "engine" else f"{role}/hf"
        size = sum(p.stat().st_size for p in (tmp / engine).rglob("*") if p.is_file())
        entries[role] = ModelEntry(
            role=role, source=spec.target if role == "target" else spec.draft, source_sha256=checkpoint.sha256(),
            architecture=checkpoint.architecture.name, quant=quant, engine=engine,
            num_layers=config.num_hidden_layers, num_kv_heads=getattr(config, "num_key_value_heads", heads) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, vocab_size=config.vocab_size,
            max_context=pair.max_context, size_bytes=size)
    _, max_seq_len = lengths(spec, pair.max_context)
    report = {"trtllm": {"flavor": flavor, "version": version, "plan": [s.to_dict() for s in steps],
                         "max_seq_len": max_seq_len},
              "pair_notes": list(pair.notes)}
    tools = _tool_versions()
    if version:
        tools["tensorrt_llm"] = version
    return Manifest(spec=spec, target=entries["target"], draft=entries["draft"], files={}, default_k=spec.k,
                    max_context=max_seq_len, eos_token_ids=_eos_ids(target, target_tok), tools=tools, report=report)


def plan_json(steps: list[Step], flavor: str) -> str:
    return json.dumps({"flavor": flavor, "steps": [s.to_dict() for s in steps]}, indent=2)
