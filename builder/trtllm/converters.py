"""Which TensorRT-LLM checkpoint converter builds which architecture, and what each one accepts.

The engine flavor turns a Hugging Face folder into a TensorRT-LLM checkpoint with a per-family
``examples/models/core/<family>/convert_checkpoint.py`` (or ModelOpt's ``examples/quantization/quantize.py`` for the
formats that need calibration). The families differ in their flags and in what parallelism they take, so each is a
row here, keyed by the config.json architecture class name (builder/architectures.py registry names).

Sources (NVIDIA/TensorRT-LLM; tests/fixtures/trtllm/converters.json records the commit of each file read):

* ``tensorrt_llm/models/__init__.py`` MODEL_MAP: LlamaForCausalLM and MistralForCausalLM -> LLaMAForCausalLM;
  Qwen2ForCausalLM and Qwen3ForCausalLM -> QWenForCausalLM; Phi3ForCausalLM -> Phi3ForCausalLM;
  Gemma2ForCausalLM / Gemma3ForCausalLM (tensorrt_llm/models/gemma/config.py GEMMA2_/GEMMA3_ARCHITECTURE)
  -> GemmaForCausalLM.
* ``examples/models/core/{llama,qwen,phi}/convert_checkpoint.py``: --model_dir --output_dir --dtype --tp_size
  --pp_size --use_weight_only --weight_only_precision; phi asserts ``pp_size == 1`` ("Pipeline parallelism is not
  supported.").
* ``examples/models/core/gemma/convert_checkpoint.py``: its own spelling: --ckpt-type hf --model-dir
  --output-model-dir --world-size (tensor parallelism only: "We don't support pipeline parallelism yet for Gemma").
* ``tensorrt_llm/layers/attention.py``: ``assert num_attention_heads % tp_size == 0`` (KV heads are replicated when
  fewer than tp_size).
* ``tensorrt_llm/functional.py`` RotaryScalingType: none, linear, dynamic, longrope, llama3, yarn, mrope;
  ``from_string`` raises "Unsupported rotary scaling type" for anything else.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.bundle import SpecError


@dataclass(frozen=True)
class Converter:
    """One upstream convert_checkpoint.py and the argument dialect it speaks."""

    script: str  # relative to TensorRT-LLM's examples/
    dialect: str  # "standard" (--model_dir/--output_dir/--tp_size/--pp_size) or "gemma" (--model-dir/--world-size)
    pipeline_parallel: bool  # False: the converter refuses pp_size > 1
    weight_only: tuple[str, ...] = ("int8", "int4")  # --weight_only_precision choices Draftsmith uses

    def argv(
        self, examples_dir: str, source: str, output: str, dtype: str, tp: int, pp: int, weight_only: str | None
    ) -> tuple[str, ...]:
        """The converter's command line, in its own dialect."""
        head = ("python3", f"{examples_dir}/{self.script}")
        if self.dialect == "gemma":
            args = (
                "--ckpt-type",
                "hf",
                "--model-dir",
                source,
                "--output-model-dir",
                output,
                "--dtype",
                dtype,
                "--world-size",
                str(tp),
            )
        else:
            args = (
                "--model_dir",
                source,
                "--output_dir",
                output,
                "--dtype",
                dtype,
                "--tp_size",
                str(tp),
                "--pp_size",
                str(pp),
            )
        quant = ("--use_weight_only", "--weight_only_precision", weight_only) if weight_only else ()
        return head + args + quant


_LLAMA = Converter("models/core/llama/convert_checkpoint.py", "standard", True)
_QWEN = Converter("models/core/qwen/convert_checkpoint.py", "standard", True)
_PHI = Converter("models/core/phi/convert_checkpoint.py", "standard", False)
_GEMMA = Converter("models/core/gemma/convert_checkpoint.py", "gemma", False)

CONVERTERS: dict[str, Converter] = {
    "LlamaForCausalLM": _LLAMA,  # Llama 2/3.x, SmolLM2; rope scaling checked by check_rope_scaling
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _QWEN,
    "Qwen3ForCausalLM": _QWEN,
    "Phi3ForCausalLM": _PHI,  # Phi-3 and Phi-4-mini (both Phi3ForCausalLM in config.json)
    "Gemma2ForCausalLM": _GEMMA,
    "Gemma3ForCausalLM": _GEMMA,
}

# RotaryScalingType names a Llama-style converter turns into its rotary_scaling (mrope is Qwen2-VL's, not ours).
ROPE_SCALING_TYPES = ("linear", "dynamic", "longrope", "llama3", "yarn")


def converter_for(role: str, architecture: str) -> Converter:
    """The converter row, or SpecError naming every architecture upstream has a converter for."""
    if architecture not in CONVERTERS:
        raise SpecError(
            f"{role}: expected an architecture with a TensorRT-LLM convert_checkpoint.py "
            f"({', '.join(sorted(CONVERTERS))}), received {architecture!r}"
        )
    return CONVERTERS[architecture]


def check_rope_scaling(role: str, rope_type: str | None) -> None:
    """Refuse a rope scaling the TensorRT runtime has no kernel for (None / 'default': unscaled)."""
    if rope_type in (None, "", "default") or rope_type in ROPE_SCALING_TYPES:
        return
    raise SpecError(
        f"{role}: expected a rope scaling TensorRT-LLM implements ({', '.join(ROPE_SCALING_TYPES)}), "
        f"received rope_type {rope_type!r}"
    )


def check_parallelism(role: str, architecture: str, heads: int | None, tp: int, pp: int) -> None:
    """tp must divide the attention heads; pp > 1 only where the converter takes it."""
    problems = []
    if heads and heads % tp:
        valid = [n for n in range(1, heads + 1) if heads % n == 0]
        problems.append(
            f"{role}: tp_size expected a divisor of the {heads} attention heads {valid} (TensorRT-LLM's "
            f"attention layer asserts num_attention_heads % tp_size == 0), received {tp}"
        )
    if pp > 1 and not converter_for(role, architecture).pipeline_parallel:
        problems.append(
            f"{role}: pp_size expected 1 for {architecture} (its convert_checkpoint.py supports tensor "
            f"parallelism only), received {pp}"
        )
    if problems:
        raise SpecError("; ".join(problems))


def rope_type_of(config) -> str | None:
    """The rope scaling type a transformers config declares (``rope_scaling['rope_type']`` or ``['type']``)."""
    scaling = getattr(config, "rope_scaling", None)
    if not isinstance(scaling, dict):
        return None
    value = scaling.get("rope_type", scaling.get("type"))
    return str(value) if value is not None else None
