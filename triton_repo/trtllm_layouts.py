"""Triton model repositories for tensorrt_llm bundles, rendered from typed data (triton_repo/pbtxt.render).

Two layouts, one per TensorRT-LLM flavor:

* Engine era (``EngineLayout``; Triton's C++ ``tensorrtllm`` backend, tensorrtllm_backend <= 1.3.0rc20)::

      preprocessing/config.pbtxt       text -> token ids (python backend)
      postprocessing/config.pbtxt      token ids -> text (python backend)
      tensorrt_llm/config.pbtxt        the target engine (backend "tensorrtllm")
      tensorrt_llm_draft/config.pbtxt  the draft engine  (same model, made by the same function)
      tensorrt_llm_bls/config.pbtxt    draft-target speculative decoding (python backend, BLS): the entry point
      ensemble/config.pbtxt            preprocessing -> tensorrt_llm -> postprocessing (target only, no drafting)

  The tensor interfaces follow tensorrtllm_backend's all_models/inflight_batcher_llm/*/config.pbtxt, which the
  python backends' model.py files read by name; the values follow examples/draft_target_model/README.md
  ("Triton Inference Server workflow": two tensorrt_llm models, enable_kv_cache_reuse, kv_cache_free_gpu_mem_fraction
  0.5 each when both share a GPU, tensorrt_llm_bls with tensorrt_llm_model_name/tensorrt_llm_draft_model_name).
  The ``1/model.py`` of preprocessing, postprocessing and tensorrt_llm_bls are tensorrtllm_backend's own Python code,
  not written here: install them from the tensorrtllm_backend release that matches the server container
  (``write_repo`` writes a README.md saying so, and ``python_models_from`` links them in).

* LLM API (``LlmApiLayout``; tensorrtllm_backend's all_models/llmapi, every current release)::

      tensorrt_llm/config.pbtxt        python backend; text_input / sampling_param_* -> text_output
      tensorrt_llm/1/model.yaml        LLM(...) keywords, speculative_config included, plus triton_config

  all_models/llmapi/tensorrt_llm/1/model.py reads model.yaml: every key but ``triton_config`` goes to
  ``LLM(**update_llm_args_with_extra_dict({}, yaml))``; ``triton_config.max_batch_size`` and ``.decoupled`` set
  the model's batching and transaction policy (its auto_complete_config).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_repo.pbtxt import ConfigError, model_config, render

DRAFT, TARGET = "tensorrt_llm_draft", "tensorrt_llm"
# Python-backend models whose 1/model.py comes from tensorrtllm_backend (never from Draftsmith).
PYTHON_MODELS = ("preprocessing", "postprocessing", "tensorrt_llm_bls")


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


def parameters(values: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {key: {"string_value": str(value).lower() if isinstance(value, bool) else str(value)}
            for key, value in values.items()}


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

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size: expected >= 1, received {self.max_batch_size}")
        if not 0 < self.kv_cache_free_gpu_mem_fraction <= 1:
            raise ConfigError(f"kv_cache_free_gpu_mem_fraction: expected (0, 1], received "
                              f"{self.kv_cache_free_gpu_mem_fraction}")


def preprocessing(layout: EngineLayout) -> dict[str, Any]:
    # Interface: all_models/inflight_batcher_llm/preprocessing/config.pbtxt (QUERY ... -> INPUT_ID ...).
    return {
        "name": "preprocessing", "backend": "python", "max_batch_size": layout.max_batch_size,
        "input": [tensor("QUERY", "TYPE_STRING", [1]), tensor("DECODER_QUERY", "TYPE_STRING", [1], optional=True),
                  tensor("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1]),
                  tensor("BAD_WORDS_DICT", "TYPE_STRING", [-1], optional=True),
                  tensor("STOP_WORDS_DICT", "TYPE_STRING", [-1], optional=True),
                  tensor("EMBEDDING_BIAS_WORDS", "TYPE_STRING", [-1], optional=True),
                  tensor("EMBEDDING_BIAS_WEIGHTS", "TYPE_FP32", [-1], optional=True),
                  tensor("END_ID", "TYPE_INT32", [1], optional=True),
                  tensor("PAD_ID", "TYPE_INT32", [1], optional=True)],
        "output": [tensor("INPUT_ID", "TYPE_INT32", [-1]), tensor("REQUEST_INPUT_LEN", "TYPE_INT32", [1]),
                   tensor("DECODER_INPUT_ID", "TYPE_INT32", [-1]),
                   tensor("REQUEST_DECODER_INPUT_LEN", "TYPE_INT32", [1]),
                   tensor("BAD_WORDS_IDS", "TYPE_INT32", [2, -1]), tensor("STOP_WORDS_IDS", "TYPE_INT32", [2, -1]),
                   tensor("EMBEDDING_BIAS", "TYPE_FP32", [-1]), tensor("REQUEST_OUTPUT_LEN", "TYPE_INT32", [-1]),
                   tensor("OUT_END_ID", "TYPE_INT32", [1]), tensor("OUT_PAD_ID", "TYPE_INT32", [1])],
        "parameters": parameters({"tokenizer_dir": layout.tokenizer_dir, "add_special_tokens": False}),
        "instance_group": [{"count": layout.instance_count, "kind": "KIND_CPU"}],
    }


def postprocessing(layout: EngineLayout) -> dict[str, Any]:
    # Interface: postprocessing/1/model.py reads TOKENS_BATCH and SEQUENCE_LENGTH (+ optional log-prob and logits
    # tensors) and always returns OUTPUT and the OUT_* tensors.
    return {
        "name": "postprocessing", "backend": "python", "max_batch_size": layout.max_batch_size,
        "input": [tensor("TOKENS_BATCH", "TYPE_INT32", [-1, -1]), tensor("SEQUENCE_LENGTH", "TYPE_INT32", [-1]),
                  tensor("CUM_LOG_PROBS", "TYPE_FP32", [-1], optional=True),
                  tensor("OUTPUT_LOG_PROBS", "TYPE_FP32", [-1, -1], optional=True),
                  tensor("CONTEXT_LOGITS", "TYPE_FP32", [-1, -1], optional=True),
                  tensor("GENERATION_LOGITS", "TYPE_FP32", [-1, -1, -1], optional=True)],
        "output": [tensor("OUTPUT", "TYPE_STRING", [-1]), tensor("OUT_CUM_LOG_PROBS", "TYPE_FP32", [-1]),
                   tensor("OUT_OUTPUT_LOG_PROBS", "TYPE_FP32", [-1, -1]),
                   tensor("OUT_CONTEXT_LOGITS", "TYPE_FP32", [-1, -1]),
                   tensor("OUT_GENERATION_LOGITS", "TYPE_FP32", [-1, -1, -1])],
        "parameters": parameters({"tokenizer_dir": layout.tokenizer_dir, "skip_special_tokens": True}),
        "instance_group": [{"count": layout.instance_count, "kind": "KIND_CPU"}],
    }


def _trtllm_inputs() -> list[dict[str, Any]]:
    # all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt: the inputs the C++ backend accepts; draft_input_ids
    # and draft_logits carry the external draft tokens (and logits) to the target.
    scalar_optional = [("end_id", "TYPE_INT32"), ("pad_id", "TYPE_INT32"), ("beam_width", "TYPE_INT32"),
                       ("temperature", "TYPE_FP32"), ("runtime_top_k", "TYPE_INT32"), ("runtime_top_p", "TYPE_FP32"),
                       ("len_penalty", "TYPE_FP32"), ("repetition_penalty", "TYPE_FP32"),
                       ("min_length", "TYPE_INT32"), ("presence_penalty", "TYPE_FP32"),
                       ("frequency_penalty", "TYPE_FP32"), ("random_seed", "TYPE_UINT64"),
                       ("return_log_probs", "TYPE_BOOL"), ("return_context_logits", "TYPE_BOOL"),
                       ("return_generation_logits", "TYPE_BOOL"), ("draft_acceptance_threshold", "TYPE_FP32")]
    return [tensor("input_ids", "TYPE_INT32", [-1], ragged=True),
            tensor("input_lengths", "TYPE_INT32", [1], scalar=True),
            tensor("request_output_len", "TYPE_INT32", [1]),
            tensor("draft_input_ids", "TYPE_INT32", [-1], optional=True, ragged=True),
            tensor("draft_logits", "TYPE_FP32", [-1, -1], optional=True, ragged=True),
            *[tensor(name, kind, [1], optional=True, scalar=True) for name, kind in scalar_optional],
            tensor("stop_words_list", "TYPE_INT32", [2, -1], optional=True, ragged=True),
            tensor("bad_words_list", "TYPE_INT32", [2, -1], optional=True, ragged=True),
            tensor("embedding_bias", "TYPE_FP32", [-1], optional=True, ragged=True),
            tensor("stop", "TYPE_BOOL", [1], optional=True), tensor("streaming", "TYPE_BOOL", [1], optional=True)]


def tensorrt_llm(layout: EngineLayout, role: str) -> dict[str, Any]:
    """The target's or the draft's tensorrt_llm model: one function, so the two cannot drift apart."""
    name, engine_dir, devices = ((TARGET, layout.target_engine_dir, layout.target_gpu_device_ids) if role == "target"
                                 else (DRAFT, layout.draft_engine_dir, layout.draft_gpu_device_ids))
    return {
        "name": name, "backend": "tensorrtllm", "max_batch_size": layout.max_batch_size,
        "model_transaction_policy": {"decoupled": layout.decoupled},
        "dynamic_batching": {"preferred_batch_size": [layout.max_batch_size],
                             "max_queue_delay_microseconds": layout.max_queue_delay_microseconds},
        "input": _trtllm_inputs(),
        "output": [tensor("output_ids", "TYPE_INT32", [-1, -1]), tensor("sequence_length", "TYPE_INT32", [-1]),
                   tensor("cum_log_probs", "TYPE_FP32", [-1]), tensor("output_log_probs", "TYPE_FP32", [-1, -1]),
                   tensor("context_logits", "TYPE_FP32", [-1, -1]),
                   tensor("generation_logits", "TYPE_FP32", [-1, -1, -1])],
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        # Parameter keys: the same config.pbtxt; values: draft_target_model/README.md's fill_template call
        # (max_beam_width 1, inflight_fused_batching, exclude_input_in_output, enable_kv_cache_reuse True).
        # Keys left out take the backend's defaults.
        "parameters": parameters({
            "max_beam_width": 1, "FORCE_CPU_ONLY_INPUT_TENSORS": "no", "gpt_model_type": "inflight_fused_batching",
            "gpt_model_path": engine_dir, "batch_scheduler_policy": "guaranteed_no_evict",
            "kv_cache_free_gpu_mem_fraction": layout.kv_cache_free_gpu_mem_fraction,
            "exclude_input_in_output": True, "enable_kv_cache_reuse": True, "gpu_device_ids": devices}),
    }


def tensorrt_llm_bls(layout: EngineLayout) -> dict[str, Any]:
    # Interface: all_models/inflight_batcher_llm/tensorrt_llm_bls/config.pbtxt (num_draft_tokens, use_draft_logits).
    optional = [("decoder_text_input", "TYPE_STRING", [1]), ("bad_words", "TYPE_STRING", [-1]),
                ("stop_words", "TYPE_STRING", [-1]), ("end_id", "TYPE_INT32", [1]), ("pad_id", "TYPE_INT32", [1]),
                ("top_k", "TYPE_INT32", [1]), ("top_p", "TYPE_FP32", [1]), ("temperature", "TYPE_FP32", [1]),
                ("length_penalty", "TYPE_FP32", [1]), ("repetition_penalty", "TYPE_FP32", [1]),
                ("min_length", "TYPE_INT32", [1]), ("presence_penalty", "TYPE_FP32", [1]),
                ("frequency_penalty", "TYPE_FP32", [1]), ("random_seed", "TYPE_UINT64", [1]),
                ("beam_width", "TYPE_INT32", [1]), ("stream", "TYPE_BOOL", [1]),
                ("embedding_bias_words", "TYPE_STRING", [-1]), ("embedding_bias_weights", "TYPE_FP32", [-1]),
                ("num_draft_tokens", "TYPE_INT32", [1])]
    flags = [("return_log_probs", "TYPE_BOOL"), ("return_context_logits", "TYPE_BOOL"),
             ("return_generation_logits", "TYPE_BOOL"), ("use_draft_logits", "TYPE_BOOL")]
    return {
        "name": "tensorrt_llm_bls", "backend": "python", "max_batch_size": layout.max_batch_size,
        "model_transaction_policy": {"decoupled": layout.decoupled},
        "input": [tensor("text_input", "TYPE_STRING", [1]), tensor("max_tokens", "TYPE_INT32", [1]),
                  *[tensor(n, t, d, optional=True) for n, t, d in optional],
                  *[tensor(n, t, [1], optional=True, scalar=True) for n, t in flags]],
        "output": [tensor("text_output", "TYPE_STRING", [-1]), tensor("cum_log_probs", "TYPE_FP32", [-1]),
                   tensor("output_log_probs", "TYPE_FP32", [-1, -1]),
                   tensor("context_logits", "TYPE_FP32", [-1, -1]),
                   tensor("generation_logits", "TYPE_FP32", [-1, -1, -1]),
                   tensor("batch_index", "TYPE_INT32", [1])],
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
                          "streaming": "stream"},
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


# --- LLM API ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LlmApiLayout:
    llm_kwargs: dict  # LLM(...) keywords with absolute paths (runtime/trtllm_engine.llm_api_kwargs)
    max_batch_size: int = 8
    decoupled: bool = False


def llmapi_config(layout: LlmApiLayout) -> dict[str, Any]:
    # Inputs read by all_models/llmapi/tensorrt_llm/1/model.py and helpers.get_sampling_params_from_request
    # ("sampling_param_<name>" for best_of, temperature, top_k, top_p, frequency_penalty, presence_penalty,
    # max_tokens, seed, exclude_input_from_output, return_perf_metrics; stop as a string list).
    sampling = [("temperature", "TYPE_FP32"), ("top_k", "TYPE_INT32"), ("top_p", "TYPE_FP32"),
                ("frequency_penalty", "TYPE_FP32"), ("presence_penalty", "TYPE_FP32"),
                ("max_tokens", "TYPE_INT32"), ("seed", "TYPE_UINT64"), ("best_of", "TYPE_INT32"),
                ("exclude_input_from_output", "TYPE_BOOL"), ("return_perf_metrics", "TYPE_BOOL")]
    return {
        "name": "tensorrt_llm", "backend": "python", "max_batch_size": layout.max_batch_size,
        "model_transaction_policy": {"decoupled": layout.decoupled},
        "input": [tensor("text_input", "TYPE_STRING", [-1]),
                  *[tensor(f"sampling_param_{n}", t, [1], optional=True) for n, t in sampling],
                  tensor("sampling_param_stop", "TYPE_STRING", [-1], optional=True),
                  tensor("streaming", "TYPE_BOOL", [1], optional=True)],
        "output": [tensor("text_output", "TYPE_STRING", [-1])],
        "instance_group": [{"count": 1, "kind": "KIND_MODEL"}],
    }


def llmapi_model_yaml(layout: LlmApiLayout) -> dict[str, Any]:
    """model.yaml: LLM keywords plus triton_config. speculative_config keeps its decoding_type ("Draft_Target");
    the draft path goes under speculative_model_dir, the name every release since 1.0 accepts (current releases
    read it as an alias: llm_args.py AliasChoices("speculative_model", "speculative_model_dir"))."""
    kwargs = dict(layout.llm_kwargs)
    speculative = dict(kwargs.pop("speculative_config"))
    speculative["speculative_model_dir"] = speculative.pop("speculative_model")
    return {**kwargs, "backend": "pytorch", "speculative_config": speculative,
            "triton_config": {"max_batch_size": layout.max_batch_size, "decoupled": layout.decoupled}}


# --- files -----------------------------------------------------------------------------------------------------------

def engine_repo_files(layout: EngineLayout) -> dict[str, str]:
    configs = engine_configs(layout)
    check_ensemble(configs)
    files = {f"{name}/config.pbtxt": render(config) for name, config in configs.items()}
    files[f"{TARGET}/1/.keep"] = files[f"{DRAFT}/1/.keep"] = files["ensemble/1/.keep"] = ""
    files["README.md"] = (
        "# Draftsmith TensorRT-LLM draft-target repository (engine era)\n\n"
        "Entry point: `tensorrt_llm_bls` (text_input, max_tokens, num_draft_tokens, use_draft_logits).\n"
        f"Install `1/model.py` (and `1/lib/` for the BLS) of {', '.join(PYTHON_MODELS)} from the tensorrtllm_backend "
        "release matching your tritonserver container (all_models/inflight_batcher_llm/), or pass "
        "`python_models_from` to write_repo. Draftsmith does not ship tensorrtllm_backend's code.\n")
    return files


def llmapi_repo_files(layout: LlmApiLayout) -> dict[str, str]:
    import yaml
    return {"tensorrt_llm/config.pbtxt": render(llmapi_config(layout)),
            "tensorrt_llm/1/model.yaml": yaml.safe_dump(llmapi_model_yaml(layout), sort_keys=False),
            "README.md": ("# Draftsmith TensorRT-LLM repository (LLM API)\n\nInstall `tensorrt_llm/1/model.py` from "
                          "tensorrtllm_backend's all_models/llmapi/ (same release as the container).\n")}


def write_repo(files: dict[str, str], root: str | Path, python_models_from: str | Path | None = None) -> Path:
    """Write ``files`` under ``root``; with ``python_models_from`` (an all_models/inflight_batcher_llm or
    all_models/llmapi folder), symlink each model's ``1/`` python files from there."""
    root = Path(root)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    if python_models_from:
        source = Path(python_models_from)
        for model in [p.parent.name for p in root.glob("*/config.pbtxt")]:
            for item in sorted((source / model / "1").glob("*")) if (source / model / "1").is_dir() else []:
                link = root / model / "1" / item.name
                if not link.exists():
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link.symlink_to(item.resolve())
    return root


def repo_for_bundle(bundle: str | Path, max_batch_size: int | None = None, decoupled: bool = False,
                    **options) -> dict[str, str]:
    """The repository files for a tensorrt_llm bundle, chosen by its flavor."""
    from runtime.bundle import load_manifest
    root = Path(bundle).absolute()
    manifest = load_manifest(root, verify=False)
    if manifest.spec.backend != "tensorrt_llm":
        raise ConfigError(f"{root} is a {manifest.spec.backend} bundle; these layouts are for tensorrt_llm bundles")
    batch = max_batch_size or manifest.spec.max_batch_size
    if manifest.spec.trtllm_flavor == "llmapi":
        from runtime.trtllm_engine import llm_api_kwargs
        return llmapi_repo_files(LlmApiLayout(llm_api_kwargs(root, manifest), batch, decoupled))
    return engine_repo_files(EngineLayout(str(root / manifest.target.engine), str(root / manifest.draft.engine),
                                          str(root / "tokenizer"), batch, decoupled, **options))


def parse_all(files: dict[str, str]) -> dict[str, Any]:
    """Every config.pbtxt parsed back into ModelConfig (what the tests check)."""
    from triton_repo.pbtxt import parse
    return {rel: parse(text) for rel, text in files.items() if rel.endswith("config.pbtxt")}


__all__ = ["EngineLayout", "LlmApiLayout", "engine_configs", "engine_repo_files", "llmapi_repo_files",
           "repo_for_bundle", "write_repo", "check_ensemble", "model_config", "parse_all"]
