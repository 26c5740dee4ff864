"""Triton model repositories for tensorrt_llm bundles, rendered from typed data (triton_repo/pbtxt.render).

Two layouts, one per TensorRT-LLM flavor. Since v0.20 the Triton models live in NVIDIA/TensorRT-LLM under
``triton_backend/all_models/`` (tensorrtllm_backend keeps only the container build); the NGC Triton TRT-LLM
container ships a copy of them.

* Engine era (``EngineLayout``; Triton's C++ ``tensorrtllm`` backend, releases up to 1.3.0rc20)::

      preprocessing/               text -> token ids (python backend)
      postprocessing/              token ids -> text (python backend)
      tensorrt_llm/                the target engine (backend "tensorrtllm")
      tensorrt_llm_draft/          the draft engine (the same config, renamed, other engine)
      tensorrt_llm_bls/            draft-target speculative decoding (python backend, BLS): the entry point
      ensemble/                    preprocessing -> tensorrt_llm -> postprocessing (target only, no drafting)

  Preferred: given a copy of upstream's ``inflight_batcher_llm`` folder (``upstream_models``), its own
  ``config.pbtxt`` templates are filled the way ``triton_backend/tools/fill_template.py`` does (every key we set must
  exist in the template; the others stay for the models to treat as unset), the draft model is the target's
  config renamed (as the draft-target guide's ``cp -r`` + ``sed``), and the ``1/`` Python files are copied from the
  same folder. Without one, the configs declare the interface recorded from the 1.x-era files
  (``_PRE_*``, ``_TRT_*``, ``_BLS_*`` below; tests/fixtures/trtllm/inflight_batcher_llm.json lists what each model
  reads and tests/test_trtllm_conformance.py holds the configs to it), and the ``1/`` folders must be installed
  from the matching release.

* LLM API (``LlmApiLayout``; all_models/llmapi, every release since 1.0)::

      tensorrt_llm/config.pbtxt        python backend, KIND_CPU, no max_batch_size (model.yaml sets it)
      tensorrt_llm/1/model.yaml        LLM(...) keywords, speculative_config included, plus triton_config

  all_models/llmapi/tensorrt_llm/1/model.py reads model.yaml: every key but ``triton_config`` goes to
  ``LLM(**update_llm_args_with_extra_dict({}, yaml))``; ``triton_config.max_batch_size`` and ``.decoupled`` set
  the model's batching and transaction policy. Its ``_convert_request`` refuses a batched ``text_input``, so
  ``triton_config.max_batch_size`` is 0, as in upstream's own model.yaml.
"""

from __future__ import annotations

import shutil
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_repo.pbtxt import ConfigError, model_config, render

DRAFT, TARGET = "tensorrt_llm_draft", "tensorrt_llm"
ENGINE_MODELS = ("preprocessing", "postprocessing", TARGET, "tensorrt_llm_bls", "ensemble")
# Python-backend models whose 1/ folder comes from upstream (never from Draftsmith).
PYTHON_MODELS = ("preprocessing", "postprocessing", "tensorrt_llm_bls")
UPSTREAM_HINT = ("a copy of TensorRT-LLM's triton_backend/all_models/inflight_batcher_llm (or all_models/llmapi) "
                 "of the release your tritonserver container runs; the NGC Triton TRT-LLM container has one")


def tensor(name: str, data_type: str, dims: list[int], optional: bool = False, ragged: bool = False,
           scalar: bool = False) -> dict[str, Any]:
    """One input/output entry of ModelConfig (JSON form)."""
    entry: dict[str, Any] = {"name": name, "data_type": data_type, "dims": dims}
    if scalar:
        entry["reshape"] = {"shape": []}
    if optional:
        entry["optional"] = True
    if ragged:
        entry["allow_ragged_batch"] = True
    return entry


def tensors(table: list[tuple[str, str, list[int], str]]) -> list[dict[str, Any]]:
    """Rows of (name, type, dims, flags): flags 'o' optional, 'r' reshape to a scalar, 'g' ragged batch."""
    return [tensor(name, "TYPE_" + kind, dims, optional="o" in flags, ragged="g" in flags, scalar="r" in flags)
            for name, kind, dims, flags in table]


def parameters(values: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {key: {"string_value": _text(value)} for key, value in values.items()}


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# --- the recorded interface (1.x-era triton_backend/all_models/inflight_batcher_llm/*/config.pbtxt) -----------------
# Declarations as upstream's templates make them, with the template's ${logits_datatype} as TYPE_FP32 and its
# prompt-table/encoder data types as TYPE_FP16. Commits read: tests/fixtures/trtllm/inflight_batcher_llm.json.

_V4 = [-1, -1, -1, -1]
_PRE_IN = [("QUERY", "STRING", [1], ""), ("DECODER_QUERY", "STRING", [1], "o"), ("IMAGE_BYTES", "UINT8", _V4, "o"),
           ("IMAGE_URL", "STRING", [1], "o"), ("IMAGES", "STRING", [-1], "o"), ("VIDEO_BYTES", "UINT8", _V4, "o"),
           ("REQUEST_OUTPUT_LEN", "INT32", [1], ""), ("BAD_WORDS_DICT", "STRING", [-1], "o"),
           ("STOP_WORDS_DICT", "STRING", [-1], "o"), ("EMBEDDING_BIAS_WORDS", "STRING", [-1], "o"),
           ("EMBEDDING_BIAS_WEIGHTS", "FP32", [-1], "o"), ("END_ID", "INT32", [1], "o"),
           ("PAD_ID", "INT32", [1], "o"), ("PROMPT_TABLE_EXTRA_ID", "UINT64", [1], "o")]
_PRE_OUT = [("INPUT_ID", "INT32", [-1], ""), ("REQUEST_INPUT_LEN", "INT32", [1], ""),
            ("DECODER_INPUT_ID", "INT32", [-1], ""), ("REQUEST_DECODER_INPUT_LEN", "INT32", [1], ""),
            ("BAD_WORDS_IDS", "INT32", [2, -1], ""), ("STOP_WORDS_IDS", "INT32", [2, -1], ""),
            ("EMBEDDING_BIAS", "FP32", [-1], ""), ("REQUEST_OUTPUT_LEN", "INT32", [-1], ""),
            ("OUT_END_ID", "INT32", [1], ""), ("OUT_PAD_ID", "INT32", [1], ""),
            ("OUT_PROMPT_TABLE_EXTRA_IDS", "UINT64", [-1], ""), ("PIXEL_VALUES", "FP16", _V4, ""),
            ("ASPECT_RATIO_IDS", "INT64", [-1], ""), ("ASPECT_RATIO_MASK", "INT64", [-1, -1], ""),
            ("CROSS_ATTENTION_MASK", "INT64", [-1, -1, -1], ""), ("IMAGE_SIZES", "INT64", [-1, 2], ""),
            ("IS_VIDEO_INPUT", "BOOL", [1], ""), ("ATTENTION_MASK", "INT64", [-1], ""),
            ("IMAGE_GRID_THW", "INT64", [3], ""), ("VISION_INPUT_ID", "INT32", [-1], "")]
_POST_IN = [("TOKENS_BATCH", "INT32", [-1, -1], ""), ("SEQUENCE_LENGTH", "INT32", [-1], "")]
_POST_OUT = [("OUTPUT", "STRING", [-1], "")]
_SCALAR_OPTIONAL = ["num_return_sequences:INT32", "draft_acceptance_threshold:FP32", "end_id:INT32", "pad_id:INT32",
                    "beam_width:INT32", "temperature:FP32", "runtime_top_k:INT32", "runtime_top_p:FP32",
                    "runtime_top_p_min:FP32", "runtime_top_p_decay:FP32", "runtime_top_p_reset_ids:INT32",
                    "len_penalty:FP32", "early_stopping:BOOL", "repetition_penalty:FP32", "min_tokens:INT32",
                    "beam_search_diversity_rate:FP32", "presence_penalty:FP32", "frequency_penalty:FP32",
                    "seed:UINT64", "return_log_probs:BOOL", "return_context_logits:BOOL",
                    "return_generation_logits:BOOL", "return_perf_metrics:BOOL", "return_num_input_tokens:BOOL",
                    "return_num_output_tokens:BOOL", "exclude_input_in_output:BOOL", "stop:BOOL", "streaming:BOOL",
                    "prompt_vocab_size:INT32", "lora_task_id:UINT64"]
_TRT_IN = ([("input_ids", "INT32", [-1], "go"), ("encoder_input_features", "FP16", [-1, -1], "go"),
            ("encoder_output_lengths", "INT32", [1], "ro"), ("input_lengths", "INT32", [1], "r"),
            ("request_output_len", "INT32", [1], "r"), ("draft_input_ids", "INT32", [-1], "og"),
            ("decoder_input_ids", "INT32", [-1], "og"), ("decoder_input_lengths", "INT32", [1], "or"),
            ("draft_logits", "FP32", [-1, -1], "og"), ("stop_words_list", "INT32", [2, -1], "og"),
            ("bad_words_list", "INT32", [2, -1], "og"), ("embedding_bias", "FP32", [-1], "og")]
           + [(entry.split(":")[0], entry.split(":")[1], [1], "ro") for entry in _SCALAR_OPTIONAL]
           + [("prompt_embedding_table", "FP16", [-1, -1], "og"), ("prompt_table_extra_ids", "UINT64", [-1], "og"),
              ("cross_attention_mask", "BOOL", [-1, -1], "og"), ("mrope_rotary_cos_sin", "FP32", [-1], "o"),
              ("mrope_position_deltas", "INT64", [1], "o"), ("lora_weights", "FP16", [-1, -1], "og"),
              ("lora_config", "INT32", [-1, 3], "og"), ("context_phase_params", "UINT8", [-1], "og"),
              ("skip_cross_attn_blocks", "BOOL", [1], "og")]
           + [(f"retention_token_range_{n}", "INT32", [-1], "og") for n in ("starts", "ends", "priorities",
                                                                              "durations_ms")]
           + [("retention_decode_priority", "INT32", [1], "og"), ("retention_decode_duration_ms", "INT32", [1], "og"),
              ("guided_decoding_guide_type", "STRING", [1], "og"), ("guided_decoding_guide", "STRING", [1], "og"),
              ("lookahead_window_size", "INT32", [1], "og"), ("lookahead_ngram_size", "INT32", [1], "og"),
              ("lookahead_verification_set_size", "INT32", [1], "og")])
_METRICS_OUT = ([("batch_index", "INT32", [1], ""), ("sequence_index", "INT32", [1], "")]
                + [(n, "INT32", [1], "") for n in ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks",
                                                   "kv_cache_alloc_total_blocks")]
                + [(n, "INT64", [1], "") for n in ("arrival_time_ns", "first_scheduled_time_ns",
                                                   "first_token_time_ns", "last_token_time_ns")]
                + [("acceptance_rate", "FP32", [1], ""), ("total_accepted_draft_tokens", "INT32", [1], ""),
                   ("total_draft_tokens", "INT32", [1], ""), ("num_input_tokens", "INT32", [1], ""),
                   ("num_output_tokens", "INT32", [1], "")])
_LOGITS_OUT = [("cum_log_probs", "FP32", [-1], ""), ("output_log_probs", "FP32", [-1, -1], ""),
               ("context_logits", "FP32", [-1, -1], ""), ("generation_logits", "FP32", [-1, -1, -1], "")]
_TRT_OUT = ([("output_ids", "INT32", [-1, -1], ""), ("sequence_length", "INT32", [-1], "")] + _LOGITS_OUT
            + _METRICS_OUT[:2] + [("context_phase_params", "UINT8", [-1], "")] + _METRICS_OUT[2:])
_BLS_IN = ([("text_input", "STRING", [1], ""), ("decoder_text_input", "STRING", [1], "o"),
            ("image_input", "FP16", [-1, 3, -1, -1], "o"), ("image_bytes_input", "UINT8", _V4, "o"),
            ("image_url_input", "STRING", [1], "o"), ("video_bytes_input", "UINT8", _V4, "o"),
            ("max_tokens", "INT32", [1], ""), ("bad_words", "STRING", [-1], "o"), ("stop_words", "STRING", [-1], "o"),
            ("exclude_input_in_output", "BOOL", [1], "o"), ("end_id", "INT32", [1], "o"),
            ("pad_id", "INT32", [1], "o"), ("top_k", "INT32", [1], "o"), ("top_p", "FP32", [1], "o"),
            ("temperature", "FP32", [1], "o"), ("length_penalty", "FP32", [1], "o"),
            ("repetition_penalty", "FP32", [1], "o"), ("min_tokens", "INT32", [1], "o"),
            ("presence_penalty", "FP32", [1], "o"), ("frequency_penalty", "FP32", [1], "o"),
            ("seed", "UINT64", [1], "o")]
           + [(n, "BOOL", [1], "ro") for n in ("return_log_probs", "return_context_logits",
                                               "return_generation_logits")]
           + [("num_return_sequences", "INT32", [1], "ro"), ("beam_width", "INT32", [1], "o"),
              ("stream", "BOOL", [1], "o"), ("prompt_embedding_table", "FP16", [-1, -1], "o"),
              ("prompt_vocab_size", "INT32", [1], "o"), ("prompt_table_extra_id", "UINT64", [1], "o"),
              ("embedding_bias_words", "STRING", [-1], "o"), ("embedding_bias_weights", "FP32", [-1], "o"),
              ("num_draft_tokens", "INT32", [1], "o"), ("use_draft_logits", "BOOL", [1], "ro"),
              ("lora_task_id", "UINT64", [1], "ro"), ("lora_weights", "FP16", [-1, -1], "og"),
              ("lora_config", "INT32", [-1, 3], "og")]
           + [(n, "BOOL", [1], "ro") for n in ("return_perf_metrics", "return_num_input_tokens",
                                               "return_num_output_tokens")]
           + [("guided_decoding_guide_type", "STRING", [1], "o"), ("guided_decoding_guide", "STRING", [1], "o")])
_BLS_OUT = [("text_output", "STRING", [-1], "")] + _LOGITS_OUT + _METRICS_OUT


# --- engine era ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineLayout:
    """Everything the engine-era repository depends on; paths as the server will see them."""

    target_engine_dir: str
    draft_engine_dir: str
    tokenizer_dir: str
    max_batch_size: int = 8
    decoupled: bool = False  # True: streaming responses (tensorrt_llm_bls "stream" input)
    kv_cache_free_gpu_mem_fraction: float = 0.4  # per model: target and draft share one GPU by default
    target_gpu_device_ids: str = "0"
    draft_gpu_device_ids: str = "0"
    max_queue_delay_microseconds: int = 0
    instance_count: int = 1  # preprocessing, postprocessing and BLS instances
    # KV-cache block reuse (the draft-target guide turns it on); it can move logits by about one BF16 ULP
    # (TensorRT-LLM issue 15503), so an exact greedy comparison against target-only output turns it off.
    enable_kv_cache_reuse: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size: expected >= 1, received {self.max_batch_size}")
        if not 0 < self.kv_cache_free_gpu_mem_fraction <= 1:
            raise ConfigError(f"kv_cache_free_gpu_mem_fraction: expected (0, 1], received "
                              f"{self.kv_cache_free_gpu_mem_fraction}")


def _batching(layout: EngineLayout) -> dict[str, Any]:
    return {"preferred_batch_size": [layout.max_batch_size],
            "max_queue_delay_microseconds": layout.max_queue_delay_microseconds}


def preprocessing(layout: EngineLayout) -> dict[str, Any]:
    # model.py indexes parameters['tokenizer_dir'] and ['multimodal_model_path'] (KeyError when absent; "" means
    # none) and looks up every INPUT_ID ... IMAGE_SIZES output config by name at load time.
    return {
        "name": "preprocessing", "backend": "python", "max_batch_size": layout.max_batch_size,
        "dynamic_batching": _batching(layout), "input": tensors(_PRE_IN), "output": tensors(_PRE_OUT),
        "parameters": parameters({"tokenizer_dir": layout.tokenizer_dir, "add_special_tokens": False,
                                  "multimodal_model_path": "", "gpt_model_path": layout.target_engine_dir}),
        "instance_group": [{"count": layout.instance_count, "kind": "KIND_CPU"}],
    }


def postprocessing(layout: EngineLayout) -> dict[str, Any]:
    # model.py raises for any input but TOKENS_BATCH and SEQUENCE_LENGTH, and returns OUTPUT only.
    return {
        "name": "postprocessing", "backend": "python", "max_batch_size": layout.max_batch_size,
        "dynamic_batching": {}, "input": tensors(_POST_IN), "output": tensors(_POST_OUT),
        "parameters": parameters({"tokenizer_dir": layout.tokenizer_dir, "skip_special_tokens": True}),
        "instance_group": [{"count": layout.instance_count, "kind": "KIND_CPU"}],
    }


def tensorrt_llm(layout: EngineLayout, role: str) -> dict[str, Any]:
    """The target's or the draft's tensorrt_llm model: one function, so the two cannot drift apart."""
    name, engine_dir, devices = ((TARGET, layout.target_engine_dir, layout.target_gpu_device_ids) if role == "target"
                                 else (DRAFT, layout.draft_engine_dir, layout.draft_gpu_device_ids))
    return {
        "name": name, "backend": "tensorrtllm", "max_batch_size": layout.max_batch_size,
        "model_transaction_policy": {"decoupled": layout.decoupled}, "dynamic_batching": _batching(layout),
        "input": tensors(_TRT_IN), "output": tensors(_TRT_OUT),
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        # Values: the draft-target guide's fill_template call (max_beam_width 1, inflight_fused_batching,
        # exclude_input_in_output, enable_kv_cache_reuse); keys left out take the backend's defaults.
        "parameters": parameters(_trt_values(layout, engine_dir, devices, template=False)),
    }


def _trt_values(layout: EngineLayout, engine_dir: str, devices: str, template: bool) -> dict[str, Any]:
    """tensorrt_llm parameter values; template=True: keyed by the config template's ${placeholders}."""
    values = {"max_beam_width": 1, "batch_scheduler_policy": "guaranteed_no_evict",
              "kv_cache_free_gpu_mem_fraction": layout.kv_cache_free_gpu_mem_fraction,
              "exclude_input_in_output": True, "enable_kv_cache_reuse": layout.enable_kv_cache_reuse,
              "gpu_device_ids": devices}
    if template:
        return {**values, "triton_backend": "tensorrtllm", "triton_max_batch_size": layout.max_batch_size,
                "decoupled_mode": layout.decoupled, "batching_strategy": "inflight_fused_batching",
                "engine_dir": engine_dir, "max_queue_delay_microseconds": layout.max_queue_delay_microseconds,
                "logits_datatype": "TYPE_FP32"}
    return {**values, "FORCE_CPU_ONLY_INPUT_TENSORS": "no", "gpt_model_type": "inflight_fused_batching",
            "gpt_model_path": engine_dir}


def tensorrt_llm_bls(layout: EngineLayout) -> dict[str, Any]:
    return {
        "name": "tensorrt_llm_bls", "backend": "python", "max_batch_size": layout.max_batch_size,
        "model_transaction_policy": {"decoupled": layout.decoupled},
        "input": tensors(_BLS_IN), "output": tensors(_BLS_OUT),
        "parameters": parameters({"accumulate_tokens": False, "tensorrt_llm_model_name": TARGET,
                                  "tensorrt_llm_draft_model_name": DRAFT}),
        "instance_group": [{"count": layout.instance_count, "kind": "KIND_CPU"}],
    }


def ensemble(layout: EngineLayout) -> dict[str, Any]:
    """Target-only text in/text out (the BLS is the speculative entry point); maps checked by check_ensemble."""
    def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> dict[str, Any]:
        return {"model_name": model, "model_version": -1, "input_map": inputs, "output_map": outputs}
    return {
        "name": "ensemble", "platform": "ensemble", "max_batch_size": layout.max_batch_size,
        "input": [tensor("text_input", "TYPE_STRING", [1]), tensor("max_tokens", "TYPE_INT32", [1]),
                  tensor("end_id", "TYPE_INT32", [1], optional=True),
                  tensor("pad_id", "TYPE_INT32", [1], optional=True),
                  tensor("temperature", "TYPE_FP32", [1], optional=True),
                  tensor("top_k", "TYPE_INT32", [1], optional=True), tensor("top_p", "TYPE_FP32", [1], optional=True),
                  tensor("seed", "TYPE_UINT64", [1], optional=True),
                  tensor("stream", "TYPE_BOOL", [1], optional=True)],
        "output": [tensor("text_output", "TYPE_STRING", [-1])],
        "ensemble_scheduling": {"step": [
            step("preprocessing", {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "END_ID": "end_id",
                                   "PAD_ID": "pad_id"},
                 {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
                  "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "OUT_END_ID": "_END_ID", "OUT_PAD_ID": "_PAD_ID"}),
            step(TARGET, {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
                          "request_output_len": "_REQUEST_OUTPUT_LEN", "end_id": "_END_ID", "pad_id": "_PAD_ID",
                          "temperature": "temperature", "runtime_top_k": "top_k", "runtime_top_p": "top_p",
                          "seed": "seed", "streaming": "stream"},
                 {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"}),
            step("postprocessing", {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
                 {"OUTPUT": "text_output"}),
        ]},
    }


def engine_configs(layout: EngineLayout) -> dict[str, dict[str, Any]]:
    """Model name -> ModelConfig data of the engine-era draft-target repository."""
    configs = [preprocessing(layout), postprocessing(layout), tensorrt_llm(layout, "target"),
               tensorrt_llm(layout, "draft"), tensorrt_llm_bls(layout), ensemble(layout)]
    return {c["name"]: c for c in configs}


def check_ensemble(configs: dict[str, dict[str, Any]], name: str = "ensemble") -> None:
    """Every mapped tensor exists on both sides with the same data type; raise ConfigError listing every mismatch."""
    spec = configs[name]
    types = {t["name"]: t["data_type"] for t in spec["input"] + spec["output"]}
    problems = []
    for step in spec["ensemble_scheduling"]["step"]:
        model = configs.get(step["model_name"])
        if model is None:
            problems.append(f"step model {step['model_name']!r} is not in the repository")
            continue
        inputs = {t["name"]: t["data_type"] for t in model["input"]}
        outputs = {t["name"]: t["data_type"] for t in model["output"]}
        for key, value in step["input_map"].items():
            if key not in inputs:
                problems.append(f"{model['name']} has no input {key!r}")
            elif value in types and types[value] != inputs[key]:
                problems.append(f"{model['name']}.{key} is {inputs[key]}, {value} is {types[value]}")
            types.setdefault(value, inputs.get(key, "?"))
        for key, value in step["output_map"].items():
            if key not in outputs:
                problems.append(f"{model['name']} has no output {key!r}")
            elif value in types and types[value] != outputs[key]:
                problems.append(f"{model['name']}.{key} is {outputs[key]}, {value} is {types[value]}")
            types.setdefault(value, outputs.get(key, "?"))
    if problems:
        raise ConfigError(f"{name}: " + "; ".join(problems))


def engine_repo_files(layout: EngineLayout) -> dict[str, str]:
    """The recorded-interface repository (no upstream copy given)."""
    configs = engine_configs(layout)
    check_ensemble(configs)
    files = {f"{name}/config.pbtxt": render(config) for name, config in configs.items()}
    files[f"{TARGET}/1/.keep"] = files[f"{DRAFT}/1/.keep"] = files["ensemble/1/.keep"] = ""
    files["README.md"] = _engine_readme(upstream=False)
    return files


def _engine_readme(upstream: bool) -> str:
    where = ("The `1/` folders were copied from the upstream folder given." if upstream else
             f"Install the `1/` folders of {', '.join(PYTHON_MODELS)} (model.py, and lib/ for the BLS) from "
             "TensorRT-LLM's triton_backend/all_models/inflight_batcher_llm/ of the release your tritonserver "
             "container runs, or regenerate with --upstream-models pointing at that folder. Draftsmith does not "
             "ship upstream's code.")
    return ("# Draftsmith TensorRT-LLM draft-target repository (engine era)\n\n"
            "Entry point: `tensorrt_llm_bls` (text_input, max_tokens, num_draft_tokens; one sequence per request "
            "when num_draft_tokens > 0). Its speculative path reads the target's and draft's configs over gRPC at "
            "localhost:8001, so serve with `--grpc-port 8001`.\n" + where + "\n")


# --- engine era from upstream's templates (fill_template.py semantics) -------------------------------------------

def fill_template(text: str, values: dict[str, Any], where: str) -> str:
    """``${key}`` substitution as tools/fill_template.py does it, but strict about our keys.

    Every key given must occur in the template (a template without it is another release's interface: say so);
    placeholders we do not set stay, as upstream leaves them, for the models to read as unset.
    """
    missing = [key for key in values if "${" + key + "}" not in text]
    if missing:
        raise ConfigError(f"{where}: the template has no ${{{'}, ${'.join(missing)}}}: it is not the "
                          f"inflight_batcher_llm interface this generator fills ({UPSTREAM_HINT})")
    return string.Template(text).safe_substitute({k: _text(v) for k, v in values.items()})


def _template_values(layout: EngineLayout) -> dict[str, dict[str, Any]]:
    """Per upstream model: the placeholders we fill (names: each config.pbtxt template; values: the guide's)."""
    return {
        "preprocessing": {"triton_max_batch_size": layout.max_batch_size, "tokenizer_dir": layout.tokenizer_dir,
                          "add_special_tokens": False, "multimodal_model_path": "",
                          "engine_dir": layout.target_engine_dir,
                          "preprocessing_instance_count": layout.instance_count},
        "postprocessing": {"triton_max_batch_size": layout.max_batch_size, "tokenizer_dir": layout.tokenizer_dir,
                           "skip_special_tokens": True, "postprocessing_instance_count": layout.instance_count},
        TARGET: _trt_values(layout, layout.target_engine_dir, layout.target_gpu_device_ids, template=True),
        DRAFT: _trt_values(layout, layout.draft_engine_dir, layout.draft_gpu_device_ids, template=True),
        "tensorrt_llm_bls": {"triton_max_batch_size": layout.max_batch_size, "decoupled_mode": layout.decoupled,
                             "bls_instance_count": layout.instance_count, "accumulate_tokens": False,
                             "tensorrt_llm_model_name": TARGET, "tensorrt_llm_draft_model_name": DRAFT,
                             "logits_datatype": "TYPE_FP32"},
        "ensemble": {"triton_max_batch_size": layout.max_batch_size, "logits_datatype": "TYPE_FP32"},
    }


# Placeholders that only some releases' templates have: filled when present.
_IF_PRESENT = {"max_queue_delay_microseconds": 0, "max_queue_size": 0,
               "encoder_input_features_data_type": "TYPE_FP16", "prompt_embedding_table_data_type": "TYPE_FP16"}


def upstream_engine_files(layout: EngineLayout, upstream: str | Path) -> dict[str, str]:
    """The repository from upstream's own inflight_batcher_llm folder: templates filled, 1/ files copied."""
    from google.protobuf import text_format

    from triton_repo.pbtxt import parse
    source = _upstream_dir(upstream, [f"{m}/config.pbtxt" for m in ENGINE_MODELS])
    files: dict[str, str] = {}
    for name, values in _template_values(layout).items():
        folder = TARGET if name == DRAFT else name
        text = (source / folder / "config.pbtxt").read_text(encoding="utf-8")
        extra = {k: v for k, v in _IF_PRESENT.items() if "${" + k + "}" in text}
        filled = fill_template(text, {**values, **extra}, f"{folder}/config.pbtxt")
        try:
            config = parse(filled)
        except text_format.ParseError as err:
            raise ConfigError(f"{folder}/config.pbtxt from {source} does not parse after filling ({err}); "
                              f"a placeholder outside a string is not filled by this generator") from None
        config.name = name
        files[f"{name}/config.pbtxt"] = text_format.MessageToString(config)
        files.update(_copied_version_folder(source / folder, name))
    files["README.md"] = _engine_readme(upstream=True)
    return files


def _upstream_dir(upstream: str | Path, needed: list[str]) -> Path:
    source = Path(upstream).expanduser().resolve()
    missing = [rel for rel in needed if not (source / rel).is_file()]
    if missing:
        raise ConfigError(f"--upstream-models {source}: missing {', '.join(missing)}; expected {UPSTREAM_HINT}")
    return source


def _copied_version_folder(folder: Path, name: str) -> dict[str, str]:
    """Text files of ``folder/1`` (model.py, lib/*.py, ...) keyed as they go into the repository."""
    version = folder / "1"
    copied = {}
    for path in sorted(version.rglob("*")) if version.is_dir() else []:
        if path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts:
            copied[f"{name}/1/{path.relative_to(version).as_posix()}"] = path.read_text(encoding="utf-8")
    if not copied:
        copied[f"{name}/1/.keep"] = ""
    return copied


# --- LLM API ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LlmApiLayout:
    llm_kwargs: dict  # LLM(...) keywords with absolute paths (runtime/trtllm_engine.llm_api_kwargs, checked)
    max_batch_size: int = 8  # the LLM's own batching (LLM(max_batch_size=...)); Triton's stays 0
    decoupled: bool = False


# all_models/llmapi/tensorrt_llm/config.pbtxt (tests/fixtures/trtllm/llmapi.json for the commit).
_LLMAPI_SAMPLING = [("best_of", "INT32"), ("temperature", "FP32"), ("top_k", "INT32"), ("top_p", "FP32"),
                    ("frequency_penalty", "FP32"), ("presence_penalty", "FP32"), ("max_tokens", "INT32")]
_LLMAPI_IN = ([("text_input", "STRING", [-1], ""), ("streaming", "BOOL", [1], "o")]
              + [(f"sampling_param_{n}", t, [1], "o") for n, t in _LLMAPI_SAMPLING]
              + [("sampling_param_stop", "STRING", [-1], "o"), ("sampling_param_seed", "UINT64", [1], "o"),
                 ("sampling_param_exclude_input_from_output", "BOOL", [1], "o"),
                 ("sampling_param_return_perf_metrics", "BOOL", [1], "o")]
              + [(n, "BOOL", [1], "o") for n in ("return_finish_reason", "return_stop_reason",
                                                 "return_cumulative_logprob", "stop")])
_LLMAPI_OUT = ([("text_output", "STRING", [-1], ""), ("finish_reason", "STRING", [-1], ""),
                ("stop_reason", "STRING", [-1], ""), ("cumulative_logprob", "FP32", [-1], "")]
               + [(n, "INT32", [-1], "") for n in ("kv_cache_reused_block", "kv_cache_missed_block",
                                                   "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks")]
               + [("kv_cache_hit_rate", "FP32", [-1], "")]
               + [(n, "INT64", [1], "") for n in ("arrival_time_ns", "first_scheduled_time_ns",
                                                  "first_token_time_ns", "last_token_time_ns")]
               + [("acceptance_rate", "FP32", [1], ""), ("total_accepted_draft_tokens", "INT32", [1], ""),
                  ("total_draft_tokens", "INT32", [1], "")])


def llmapi_config(layout: LlmApiLayout) -> dict[str, Any]:
    # No max_batch_size and no model_transaction_policy here: upstream's config.pbtxt says they belong in
    # model.yaml's triton_config, which model.py's auto_complete_config applies.
    return {"name": "tensorrt_llm", "backend": "python", "input": tensors(_LLMAPI_IN),
            "output": tensors(_LLMAPI_OUT), "instance_group": [{"count": 1, "kind": "KIND_CPU"}]}


def llmapi_model_yaml(layout: LlmApiLayout) -> dict[str, Any]:
    """model.yaml: LLM keywords plus triton_config. speculative_config as from_dict reads it in every release line:
    decoding_type "DraftTarget", the draft under speculative_model_dir (1.0-1.2's field; current main reads it as
    an alias: AliasChoices("speculative_model", "speculative_model_dir"))."""
    from runtime.trtllm_engine import DECODING_TYPE
    kwargs = dict(layout.llm_kwargs)
    speculative = dict(kwargs.pop("speculative_config"))
    return {**kwargs, "backend": "pytorch",
            "speculative_config": {"decoding_type": DECODING_TYPE, "max_draft_len": speculative["max_draft_len"],
                                   "speculative_model_dir": speculative["speculative_model"]},
            "triton_config": {"max_batch_size": 0, "decoupled": layout.decoupled}}


def llmapi_repo_files(layout: LlmApiLayout, upstream: str | Path | None = None) -> dict[str, str]:
    import yaml
    files = {"tensorrt_llm/1/model.yaml": yaml.safe_dump(llmapi_model_yaml(layout), sort_keys=False)}
    if upstream is None:
        files["tensorrt_llm/config.pbtxt"] = render(llmapi_config(layout))
        files["README.md"] = ("# Draftsmith TensorRT-LLM repository (LLM API)\n\nInstall `tensorrt_llm/1/model.py` "
                              "and `helpers.py` from TensorRT-LLM's triton_backend/all_models/llmapi/ (same release as "
                              "the container), or regenerate with --upstream-models pointing at that folder.\n")
        return files
    source = _upstream_dir(upstream, ["tensorrt_llm/config.pbtxt", "tensorrt_llm/1/model.py"])
    files["tensorrt_llm/config.pbtxt"] = (source / "tensorrt_llm" / "config.pbtxt").read_text(encoding="utf-8")
    copied = _copied_version_folder(source / "tensorrt_llm", "tensorrt_llm")
    copied.pop("tensorrt_llm/1/model.yaml", None)  # upstream's example; ours replaces it
    files.update(copied)
    files["README.md"] = ("# Draftsmith TensorRT-LLM repository (LLM API)\n\n"
                          "Model files copied from the upstream folder.\n")
    return files


# --- files -----------------------------------------------------------------------------------------------------------

def write_repo(files: dict[str, str], root: str | Path, overwrite: bool = False) -> Path:
    """Write ``files`` under ``root`` (created; it must not exist unless ``overwrite`` and it holds our README)."""
    root = Path(root)
    if root.exists():
        ours = (root / "README.md").is_file() and "Draftsmith TensorRT-LLM" in (root / "README.md").read_text(
            encoding="utf-8", errors="replace")
        if not overwrite or not ours:
            raise ConfigError(f"{root} exists; " + ("pass overwrite (--force) to replace it" if ours else
                                                    "it is not a repository this generator wrote: choose another "
                                                    "path"))
        shutil.rmtree(root)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def repo_for_bundle(bundle: str | Path, max_batch_size: int | None = None, decoupled: bool = False,
                    upstream_models: str | Path | None = None, **options) -> dict[str, str]:
    """The repository files for a tensorrt_llm bundle, chosen by its flavor; ``upstream_models``: a copy of upstream's
    inflight_batcher_llm (engine flavor) or llmapi (LLM-API flavor) folder to fill and copy from."""
    from runtime.bundle import load_manifest
    root = Path(bundle).absolute()
    manifest = load_manifest(root, verify=False)
    if manifest.spec.backend != "tensorrt_llm":
        raise ConfigError(f"{root} is a {manifest.spec.backend} bundle; these layouts are for tensorrt_llm bundles")
    batch = max_batch_size or manifest.spec.max_batch_size
    if manifest.spec.trtllm_flavor == "llmapi":
        from runtime.trtllm_engine import llm_api_kwargs
        return llmapi_repo_files(LlmApiLayout(llm_api_kwargs(root, manifest), batch, decoupled), upstream_models)
    layout = EngineLayout(str(root / manifest.target.engine), str(root / manifest.draft.engine),
                          str(root / "tokenizer"), batch, decoupled, **options)
    return upstream_engine_files(layout, upstream_models) if upstream_models else engine_repo_files(layout)


def write_trtllm_repository(bundle: str | Path, out: str | Path, upstream_models: str | Path | None = None,
                            overwrite: bool = False, **options) -> Path:
    """repo_for_bundle + write_repo: what ``build-engines --triton-repo`` runs for tensorrt_llm bundles."""
    return write_repo(repo_for_bundle(bundle, upstream_models=upstream_models, **options), out, overwrite)


def parse_all(files: dict[str, str]) -> dict[str, Any]:
    """Every config.pbtxt parsed back into ModelConfig (what the tests check)."""
    from triton_repo.pbtxt import parse
    return {rel: parse(text) for rel, text in files.items() if rel.endswith("config.pbtxt")}


__all__ = ["EngineLayout", "LlmApiLayout", "engine_configs", "engine_repo_files", "llmapi_repo_files",
           "upstream_engine_files", "fill_template", "repo_for_bundle", "write_repo", "write_trtllm_repository",
           "check_ensemble", "model_config", "parse_all"]
