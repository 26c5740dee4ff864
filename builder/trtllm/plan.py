"""The TensorRT-LLM build plan as data: a pure function from the spec to every command a build runs.

``make_plan`` returns Steps (commands with every argument, or Python calls with every keyword), so that
``build-engines --dry-run`` prints exactly what a build runs and tests compare it with golden files and with the
upstream interface recorded in tests/fixtures/trtllm/. Sources are cited where each flag is emitted.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from builder.trtllm.converters import check_parallelism, check_rope_scaling, converter_for
from runtime.trtllm.paths import LAYOUTS
from runtime.bundle import BuildSpec, SpecError
from runtime.trtllm.common import DECODING_TYPE

FLAVORS = ("engine", "llmapi")
# The release image keeps the examples there; the Triton image at /app/examples (runtime/trtllm/paths.py).
DEFAULT_EXAMPLES = LAYOUTS["tensorrt_llm release"]["examples"]

# Which formats each flavor builds.
# engine: convert_checkpoint.py --use_weight_only --weight_only_precision {int8,int4} (examples/models/core/<family>/
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
# FP8 KV cache in an engine: quantize.py --kv_cache_dtype {int8,fp8} (tests/fixtures/trtllm/quantize.json). With it,
# tensorrt_llm/builder.py build() turns use_paged_context_fmha off unless the checkpoint's quant_algo is FP8,
# W4A8_AWQ or NVFP4 (and the GPU is SM >= 89); without paged context FMHA the executor turns KV-cache block reuse
# off (trtGptModelInflightBatching.cpp fixExecutorConfig), and a draft_tokens_external target then refuses to load
# ("KV cache block reuse must be enabled for speculative decoding target model"). tests/fixtures/trtllm/
# paged_context_fmha.json records the chain.
FP8_KV_QUANTS = ("fp8", "w4a8_awq")
# ModelOpt configs (modelopt.torch.quantization), as TensorRT-LLM's own tensorrt_llm/quantization/
# quantize_by_modelopt.py maps them: quant_cfg_choices() {"fp8": FP8_DEFAULT_CFG, "int4_awq": INT4_AWQ_CFG,
# "w4a8_awq": W4A8_AWQ_BETA_CFG, ...}.
MODELOPT_CONFIGS = {"fp8": "FP8_DEFAULT_CFG", "int4_awq": "INT4_AWQ_CFG", "w4a8_awq": "W4A8_AWQ_BETA_CFG"}
DTYPES = {"bf16": "bfloat16"}  # everything else runs its unquantized part in float16
# Calibration: quantize.py's --calib_dataset defaults to the hub dataset cnn_dailymail; a local directory is loaded
# with datasets.load_dataset(dir, split="train") and its "text" column is used (tensorrt_llm/quantization/
# quantize_by_modelopt.py get_calib_dataloader; tests/fixtures/trtllm/quantize.json). The plan writes such a folder
# from the shipped prompt files first, so fp8 / int8_sq / AWQ builds work offline.
CALIB_DIR = "_work/calibration"
CALIB_FILE = "train.jsonl"
MODELOPT_CALIB_SAMPLES = 64  # llmapi flavor: calibration passes over the same texts
LLM_API_FILE = "llm_api.yaml"


@dataclass(frozen=True)
class Step:
    """One unit of work: a command (argv) or a Python call (call + kwargs), run inside the bundle directory."""

    role: str  # "target", "draft" or "bundle"
    name: str  # convert | quantize | build | copy | modelopt | llm_api | calibration
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
    heads: dict[str, int] = field(default_factory=dict)  # role -> num_attention_heads (TP must divide it)
    rope_types: dict[str, str | None] = field(default_factory=dict)  # role -> rope_scaling type, if any


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
    problems = [
        f"{name}: expected one of {FLAVOR_QUANTS[flavor]} for TensorRT-LLM flavor {flavor!r}, "
        f"received {getattr(spec, name)!r}"
        for name in ("target_quant", "draft_quant")
        if getattr(spec, name) not in FLAVOR_QUANTS[flavor]
    ]
    if spec.draft.startswith("self:"):
        problems.append(
            f"draft: expected a checkpoint path or 'self' for backend tensorrt_llm (a truncated "
            f"self-draft is an ONNX-only option), received {spec.draft!r}"
        )
    if flavor == "engine" and spec.kv_cache_dtype == "fp8":
        problems += [
            f"{name}: expected one of {FP8_KV_QUANTS} with kv_cache_dtype 'fp8' (TensorRT-LLM's builder "
            "disables paged context FMHA for an FP8 KV cache outside the fp8 / w4a8_awq workflows, which "
            "turns off the KV-cache block reuse a draft-target target needs to load), received "
            f"{getattr(spec, name)!r}"
            for name in ("target_quant", "draft_quant")
            if getattr(spec, name) not in FP8_KV_QUANTS
        ]
    if problems:
        raise SpecError("; ".join(problems))


def make_plan(spec: BuildSpec, flavor: str, inputs: PlanInputs) -> list[Step]:
    """Every step of a TensorRT-LLM build, in order. Pure: no file, no GPU, no tensorrt_llm needed."""
    check_flavor(spec, flavor)
    max_input_len, max_seq_len = lengths(spec, inputs.max_context)
    quants = {"target": spec.target_quant, "draft": spec.draft_quant}
    steps: list[Step] = []
    if flavor == "engine":
        for role in ("draft", "target"):
            architecture = inputs.architectures[role]
            converter_for(role, architecture)
            check_parallelism(role, architecture, inputs.heads.get(role), spec.tp_size, spec.pp_size)
            check_rope_scaling(role, inputs.rope_types.get(role))
        if any(q in QFORMATS for q in quants.values()):
            steps.append(_calibration_step())
        for role in ("draft", "target"):
            steps += _engine_steps(spec, role, quants[role], inputs, max_input_len, max_seq_len)
    else:
        for role in ("draft", "target"):
            steps.append(_hf_step(role, quants[role], inputs.sources[role]))
        steps.append(
            Step(
                "bundle",
                "llm_api",
                call="tensorrt_llm.LLM",
                kwargs=llm_api_kwargs(spec, max_seq_len),
                outputs=(LLM_API_FILE,),
            )
        )
    return steps


def _engine_steps(
    spec: BuildSpec, role: str, quant: str, inputs: PlanInputs, max_input_len: int, max_seq_len: int
) -> list[Step]:
    """One engine's two steps: its checkpoint (quantized or converted), then trtllm-build."""
    checkpoint = f"_work/{role}.ckpt"
    dtype = DTYPES.get(quant, "float16")
    if quant in QFORMATS:
        convert = _quantize_step(spec, role, quant, inputs, checkpoint, dtype)
    else:
        convert = _convert_step(spec, role, quant, inputs, checkpoint, dtype)
    return [convert, _build_step(spec, role, quant, checkpoint, dtype, max_input_len, max_seq_len)]


def _quantize_step(spec: BuildSpec, role: str, quant: str, inputs: PlanInputs, checkpoint: str, dtype: str) -> Step:
    # examples/quantization/quantize.py: --model_dir --output_dir --dtype --qformat --calib_dataset --calib_size
    # --tp_size --pp_size --kv_cache_dtype {int8,fp8} (argparse; tests/fixtures/trtllm/quantize.json).
    kv = ("--kv_cache_dtype", spec.kv_cache_dtype) if spec.kv_cache_dtype else ()
    return Step(
        role,
        "quantize",
        argv=(
            "python3",
            f"{inputs.examples_dir}/quantization/quantize.py",
            "--model_dir",
            inputs.sources[role],
            "--output_dir",
            checkpoint,
            "--dtype",
            dtype,
            "--qformat",
            quant,
            "--calib_dataset",
            CALIB_DIR,
            "--calib_size",
            str(len(calibration_texts())),
            "--tp_size",
            str(spec.tp_size),
            "--pp_size",
            str(spec.pp_size),
            *kv,
        ),
        outputs=(checkpoint,),
    )


def _convert_step(spec: BuildSpec, role: str, quant: str, inputs: PlanInputs, checkpoint: str, dtype: str) -> Step:
    converter = converter_for(role, inputs.architectures[role])
    return Step(
        role,
        "convert",
        argv=converter.argv(
            inputs.examples_dir,
            inputs.sources[role],
            checkpoint,
            dtype,
            spec.tp_size,
            spec.pp_size,
            quant if quant in WEIGHT_ONLY else None,
        ),
        outputs=(checkpoint,),
    )


def _build_step(
    spec: BuildSpec, role: str, quant: str, checkpoint: str, dtype: str, max_input_len: int, max_seq_len: int
) -> Step:
    engine = f"{role}/engine"
    # trtllm-build flags, from examples/draft_target_model/README.md ("Build draft and target engines"):
    # --use_paged_context_fmha=enable on both ("must be specified since we need KV-Cache reuse"), --max_batch_size,
    # --max_input_len, --max_seq_len, --gemm_plugin=float16 for unquantized fp16 weights; the target gets
    # --speculative_decoding_mode=draft_tokens_external and --max_draft_len.
    # No logits flag: build.py raises "Gather context logits is not support with draft len > 0" for
    # --gather_context_logits (or --gather_all_token_logits) with --max_draft_len > 0, and later builds deprecate
    # --gather_generation_logits ("Use --output_generation_logits at runtime instead"); the target verifies
    # draft tokens itself (tests/fixtures/trtllm/trtllm_build.json).
    gemm = ("--gemm_plugin", dtype) if quant in ("fp16", "bf16", "int8", "int4") else ()
    speculative = (
        ("--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(spec.max_k))
        if role == "target"
        else ()
    )
    build = Step(
        role,
        "build",
        argv=(
            "trtllm-build",
            "--checkpoint_dir",
            checkpoint,
            "--output_dir",
            engine,
            *gemm,
            "--use_paged_context_fmha",
            "enable",
            "--max_batch_size",
            str(spec.max_batch_size),
            "--max_input_len",
            str(max_input_len),
            "--max_seq_len",
            str(max_seq_len),
            *speculative,
        ),
        outputs=(engine,),
    )
    return build


def _calibration_step() -> Step:
    return Step(
        "bundle",
        "calibration",
        call="builder.trtllm.build.write_calibration_set",
        kwargs={"export_dir": CALIB_DIR},
        outputs=(f"{CALIB_DIR}/{CALIB_FILE}",),
    )


def calibration_texts() -> list[str]:
    """Calibration texts from the shipped prompt files (builder/data/distill_prompts.txt and eval.txt).

    Why: quantize.py's default calibration set is a hub download; these need no network and are of the kind of
    text Draftsmith's users run.
    """
    from builder import evaluate
    from builder.distill.corpus import load_prompts

    paragraphs = [p.strip() for p in evaluate.eval_text().split("\n\n") if p.strip()]
    return [prompt.text.strip() for prompt in load_prompts()] + paragraphs


def _hf_step(role: str, quant: str, source: str) -> Step:
    export = f"{role}/hf"
    if quant not in MODELOPT_CONFIGS:
        return Step(
            role,
            "copy",
            call="builder.trtllm.build.copy_checkpoint",
            kwargs={"model_dir": source, "export_dir": export},
            outputs=(export,),
        )
    # ModelOpt: modelopt.torch.quantization.quantize(model, config, forward_loop=...) then
    # modelopt.torch.export.export_hf_checkpoint(model, dtype=..., export_dir=...) (modelopt/torch/export/
    # unified_export_hf.py), the "unified HF checkpoint" the PyTorch backend loads.
    return Step(
        role,
        "modelopt",
        call="builder.trtllm.build.modelopt_quantize",
        kwargs={
            "model_dir": source,
            "export_dir": export,
            "quant_cfg": MODELOPT_CONFIGS[quant],
            "dtype": "float16",
            "calib_samples": MODELOPT_CALIB_SAMPLES,
        },
        outputs=(export,),
    )


def llm_api_kwargs(spec: BuildSpec, max_seq_len: int) -> dict[str, Any]:
    """LLM(...) keywords of an llmapi bundle, paths relative to the bundle (runtime/trtllm/engine.py resolves them).

    Names: tensorrt_llm/llmapi/llm_args.py (BaseLlmArgs: model, tokenizer, dtype, tensor_parallel_size,
    pipeline_parallel_size, max_batch_size, max_seq_len, kv_cache_config; TorchLlmArgs: disable_overlap_scheduler;
    KvCacheConfig: enable_block_reuse, max_tokens, dtype ("auto" or e.g. "fp8", "only for the Pytorch backend")).
    speculative_config is written as from_dict reads it: decoding_type "DraftTarget" (the table key in 1.0-1.2; main
    accepts it too), max_draft_len, and the draft path. Only current main validates max_draft_len > 0 and a set
    speculative_model; make_plan's own checks (max_k >= k >= 1) stand in for it on 1.0-1.2.
    disable_overlap_scheduler=True: the draft/target quick start in docs/source/features/speculative-decoding.md
    passes it (tests/fixtures/trtllm/decoding_types.json). kv_cache_config.max_tokens: every sequence of a full
    batch at full length (the draft-target guide sizes max_tokens_in_paged_kv_cache the same way).
    """
    kv_cache = {"enable_block_reuse": True, "max_tokens": spec.max_batch_size * max_seq_len}
    if spec.kv_cache_dtype:
        kv_cache["dtype"] = spec.kv_cache_dtype
    return {
        "model": "target/hf",
        "tokenizer": "tokenizer",
        "dtype": "bfloat16" if spec.target_quant == "bf16" else "float16",
        "tensor_parallel_size": spec.tp_size,
        "pipeline_parallel_size": spec.pp_size,
        "max_batch_size": spec.max_batch_size,
        "max_seq_len": max_seq_len,
        "disable_overlap_scheduler": True,
        "kv_cache_config": kv_cache,
        "speculative_config": {
            "decoding_type": DECODING_TYPE,
            "max_draft_len": spec.max_k,
            "speculative_model": "draft/hf",
        },
    }


def render_plan(steps: list[Step], flavor: str) -> str:
    """The dry-run text: every step, numbered, runnable from the bundle directory."""
    lines = [f"# TensorRT-LLM {flavor} flavor: {len(steps)} steps, run from the bundle directory"]
    for number, step in enumerate(steps, 1):
        lines.append(f"# {number}. {step.role}: {step.name}")
        lines.append(step.render())
    return "\n".join(lines) + "\n"


def plan_json(steps: list[Step], flavor: str) -> str:
    return json.dumps({"flavor": flavor, "steps": [s.to_dict() for s in steps]}, indent=2)
