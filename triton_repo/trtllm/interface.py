"""The Triton-side interface of TensorRT-LLM's models, as declarations: what each config.pbtxt must declare.

Recorded from the 1.x-era triton_backend/all_models/inflight_batcher_llm/*/config.pbtxt and all_models/llmapi
(tests/fixtures/trtllm/inflight_batcher_llm.json and llmapi.json name the commits read), with the template's
${logits_datatype} as TYPE_FP32 and its prompt-table/encoder data types as TYPE_FP16. triton_repo/trtllm/layouts.py
renders them when no upstream copy of the models is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from triton_repo.pbtxt import ConfigError

UPSTREAM_HINT = (
    "a copy of TensorRT-LLM's triton_backend/all_models/inflight_batcher_llm (or all_models/llmapi) "
    "of the release your tritonserver container runs; the NGC Triton TRT-LLM container has one"
)


def tensor(
    name: str, data_type: str, dims: list[int], optional: bool = False, ragged: bool = False, scalar: bool = False
) -> dict[str, Any]:
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
    return [
        tensor(name, "TYPE_" + kind, dims, optional="o" in flags, ragged="g" in flags, scalar="r" in flags)
        for name, kind, dims, flags in table
    ]


def parameters(values: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {key: {"string_value": parameter_text(value)} for key, value in values.items()}


def parameter_text(value: Any) -> str:
    """A parameter's ``string_value`` as upstream writes it (booleans lower case). Public: the engine layout fills
    upstream's config templates with the same text (triton_repo/trtllm/layouts.py)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


# --- the recorded interface (1.x-era triton_backend/all_models/inflight_batcher_llm/*/config.pbtxt) -----------------
# Declarations as upstream's templates make them, with the template's ${logits_datatype} as TYPE_FP32 and its
# prompt-table/encoder data types as TYPE_FP16. Commits read: tests/fixtures/trtllm/inflight_batcher_llm.json.
# Public tables (PRE_*, POST_*, TRT_*, BLS_*, LLMAPI_*): this module only declares them; the engine layout
# (triton_repo/trtllm/layouts.py) and the LLM-API layout (triton_repo/trtllm/llmapi_layout.py) render them.

_V4 = [-1, -1, -1, -1]
PRE_IN = [
    ("QUERY", "STRING", [1], ""),
    ("DECODER_QUERY", "STRING", [1], "o"),
    ("IMAGE_BYTES", "UINT8", _V4, "o"),
    ("IMAGE_URL", "STRING", [1], "o"),
    ("IMAGES", "STRING", [-1], "o"),
    ("VIDEO_BYTES", "UINT8", _V4, "o"),
    ("REQUEST_OUTPUT_LEN", "INT32", [1], ""),
    ("BAD_WORDS_DICT", "STRING", [-1], "o"),
    ("STOP_WORDS_DICT", "STRING", [-1], "o"),
    ("EMBEDDING_BIAS_WORDS", "STRING", [-1], "o"),
    ("EMBEDDING_BIAS_WEIGHTS", "FP32", [-1], "o"),
    ("END_ID", "INT32", [1], "o"),
    ("PAD_ID", "INT32", [1], "o"),
    ("PROMPT_TABLE_EXTRA_ID", "UINT64", [1], "o"),
]
PRE_OUT = [
    ("INPUT_ID", "INT32", [-1], ""),
    ("REQUEST_INPUT_LEN", "INT32", [1], ""),
    ("DECODER_INPUT_ID", "INT32", [-1], ""),
    ("REQUEST_DECODER_INPUT_LEN", "INT32", [1], ""),
    ("BAD_WORDS_IDS", "INT32", [2, -1], ""),
    ("STOP_WORDS_IDS", "INT32", [2, -1], ""),
    ("EMBEDDING_BIAS", "FP32", [-1], ""),
    ("REQUEST_OUTPUT_LEN", "INT32", [-1], ""),
    ("OUT_END_ID", "INT32", [1], ""),
    ("OUT_PAD_ID", "INT32", [1], ""),
    ("OUT_PROMPT_TABLE_EXTRA_IDS", "UINT64", [-1], ""),
    ("PIXEL_VALUES", "FP16", _V4, ""),
    ("ASPECT_RATIO_IDS", "INT64", [-1], ""),
    ("ASPECT_RATIO_MASK", "INT64", [-1, -1], ""),
    ("CROSS_ATTENTION_MASK", "INT64", [-1, -1, -1], ""),
    ("IMAGE_SIZES", "INT64", [-1, 2], ""),
    ("IS_VIDEO_INPUT", "BOOL", [1], ""),
    ("ATTENTION_MASK", "INT64", [-1], ""),
    ("IMAGE_GRID_THW", "INT64", [3], ""),
    ("VISION_INPUT_ID", "INT32", [-1], ""),
]
POST_IN = [("TOKENS_BATCH", "INT32", [-1, -1], ""), ("SEQUENCE_LENGTH", "INT32", [-1], "")]
POST_OUT = [("OUTPUT", "STRING", [-1], "")]
_SCALAR_OPTIONAL = [
    "num_return_sequences:INT32",
    "draft_acceptance_threshold:FP32",
    "end_id:INT32",
    "pad_id:INT32",
    "beam_width:INT32",
    "temperature:FP32",
    "runtime_top_k:INT32",
    "runtime_top_p:FP32",
    "runtime_top_p_min:FP32",
    "runtime_top_p_decay:FP32",
    "runtime_top_p_reset_ids:INT32",
    "len_penalty:FP32",
    "early_stopping:BOOL",
    "repetition_penalty:FP32",
    "min_tokens:INT32",
    "beam_search_diversity_rate:FP32",
    "presence_penalty:FP32",
    "frequency_penalty:FP32",
    "seed:UINT64",
    "return_log_probs:BOOL",
    "return_context_logits:BOOL",
    "return_generation_logits:BOOL",
    "return_perf_metrics:BOOL",
    "return_num_input_tokens:BOOL",
    "return_num_output_tokens:BOOL",
    "exclude_input_in_output:BOOL",
    "stop:BOOL",
    "streaming:BOOL",
    "prompt_vocab_size:INT32",
    "lora_task_id:UINT64",
]
TRT_IN = (
    [
        ("input_ids", "INT32", [-1], "go"),
        ("encoder_input_features", "FP16", [-1, -1], "go"),
        ("encoder_output_lengths", "INT32", [1], "ro"),
        ("input_lengths", "INT32", [1], "r"),
        ("request_output_len", "INT32", [1], "r"),
        ("draft_input_ids", "INT32", [-1], "og"),
        ("decoder_input_ids", "INT32", [-1], "og"),
        ("decoder_input_lengths", "INT32", [1], "or"),
        ("draft_logits", "FP32", [-1, -1], "og"),
        ("stop_words_list", "INT32", [2, -1], "og"),
        ("bad_words_list", "INT32", [2, -1], "og"),
        ("embedding_bias", "FP32", [-1], "og"),
    ]
    + [(entry.split(":")[0], entry.split(":")[1], [1], "ro") for entry in _SCALAR_OPTIONAL]
    + [
        ("prompt_embedding_table", "FP16", [-1, -1], "og"),
        ("prompt_table_extra_ids", "UINT64", [-1], "og"),
        ("cross_attention_mask", "BOOL", [-1, -1], "og"),
        ("mrope_rotary_cos_sin", "FP32", [-1], "o"),
        ("mrope_position_deltas", "INT64", [1], "o"),
        ("lora_weights", "FP16", [-1, -1], "og"),
        ("lora_config", "INT32", [-1, 3], "og"),
        ("context_phase_params", "UINT8", [-1], "og"),
        ("skip_cross_attn_blocks", "BOOL", [1], "og"),
    ]
    + [(f"retention_token_range_{n}", "INT32", [-1], "og") for n in ("starts", "ends", "priorities", "durations_ms")]
    + [
        ("retention_decode_priority", "INT32", [1], "og"),
        ("retention_decode_duration_ms", "INT32", [1], "og"),
        ("guided_decoding_guide_type", "STRING", [1], "og"),
        ("guided_decoding_guide", "STRING", [1], "og"),
        ("lookahead_window_size", "INT32", [1], "og"),
        ("lookahead_ngram_size", "INT32", [1], "og"),
        ("lookahead_verification_set_size", "INT32", [1], "og"),
    ]
)
_REQUEST_PERF_OUT = [  # the request's timings and draft acceptance: the engine model and the LLM API model alike
    (n, "INT64", [1], "")
    for n in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
] + [
    ("acceptance_rate", "FP32", [1], ""),
    ("total_accepted_draft_tokens", "INT32", [1], ""),
    ("total_draft_tokens", "INT32", [1], ""),
]
_METRICS_OUT = (
    [("batch_index", "INT32", [1], ""), ("sequence_index", "INT32", [1], "")]
    + [
        (n, "INT32", [1], "")
        for n in ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")
    ]
    + _REQUEST_PERF_OUT
    + [("num_input_tokens", "INT32", [1], ""), ("num_output_tokens", "INT32", [1], "")]
)
_LOGITS_OUT = [
    ("cum_log_probs", "FP32", [-1], ""),
    ("output_log_probs", "FP32", [-1, -1], ""),
    ("context_logits", "FP32", [-1, -1], ""),
    ("generation_logits", "FP32", [-1, -1, -1], ""),
]
TRT_OUT = (
    [("output_ids", "INT32", [-1, -1], ""), ("sequence_length", "INT32", [-1], "")]
    + _LOGITS_OUT
    + _METRICS_OUT[:2]
    + [("context_phase_params", "UINT8", [-1], "")]
    + _METRICS_OUT[2:]
)
BLS_IN = (
    [
        ("text_input", "STRING", [1], ""),
        ("decoder_text_input", "STRING", [1], "o"),
        ("image_input", "FP16", [-1, 3, -1, -1], "o"),
        ("image_bytes_input", "UINT8", _V4, "o"),
        ("image_url_input", "STRING", [1], "o"),
        ("video_bytes_input", "UINT8", _V4, "o"),
        ("max_tokens", "INT32", [1], ""),
        ("bad_words", "STRING", [-1], "o"),
        ("stop_words", "STRING", [-1], "o"),
        ("exclude_input_in_output", "BOOL", [1], "o"),
        ("end_id", "INT32", [1], "o"),
        ("pad_id", "INT32", [1], "o"),
        ("top_k", "INT32", [1], "o"),
        ("top_p", "FP32", [1], "o"),
        ("temperature", "FP32", [1], "o"),
        ("length_penalty", "FP32", [1], "o"),
        ("repetition_penalty", "FP32", [1], "o"),
        ("min_tokens", "INT32", [1], "o"),
        ("presence_penalty", "FP32", [1], "o"),
        ("frequency_penalty", "FP32", [1], "o"),
        ("seed", "UINT64", [1], "o"),
    ]
    + [(n, "BOOL", [1], "ro") for n in ("return_log_probs", "return_context_logits", "return_generation_logits")]
    + [
        ("num_return_sequences", "INT32", [1], "ro"),
        ("beam_width", "INT32", [1], "o"),
        ("stream", "BOOL", [1], "o"),
        ("prompt_embedding_table", "FP16", [-1, -1], "o"),
        ("prompt_vocab_size", "INT32", [1], "o"),
        ("prompt_table_extra_id", "UINT64", [1], "o"),
        ("embedding_bias_words", "STRING", [-1], "o"),
        ("embedding_bias_weights", "FP32", [-1], "o"),
        ("num_draft_tokens", "INT32", [1], "o"),
        ("use_draft_logits", "BOOL", [1], "ro"),
        ("lora_task_id", "UINT64", [1], "ro"),
        ("lora_weights", "FP16", [-1, -1], "og"),
        ("lora_config", "INT32", [-1, 3], "og"),
    ]
    + [(n, "BOOL", [1], "ro") for n in ("return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens")]
    + [("guided_decoding_guide_type", "STRING", [1], "o"), ("guided_decoding_guide", "STRING", [1], "o")]
)
BLS_OUT = [("text_output", "STRING", [-1], "")] + _LOGITS_OUT + _METRICS_OUT


# all_models/llmapi/tensorrt_llm/config.pbtxt (tests/fixtures/trtllm/llmapi.json for the commit).
_LLMAPI_SAMPLING = [
    ("best_of", "INT32"),
    ("temperature", "FP32"),
    ("top_k", "INT32"),
    ("top_p", "FP32"),
    ("frequency_penalty", "FP32"),
    ("presence_penalty", "FP32"),
    ("max_tokens", "INT32"),
]
LLMAPI_IN = (
    [("text_input", "STRING", [-1], ""), ("streaming", "BOOL", [1], "o")]
    + [(f"sampling_param_{n}", t, [1], "o") for n, t in _LLMAPI_SAMPLING]
    + [
        ("sampling_param_stop", "STRING", [-1], "o"),
        ("sampling_param_seed", "UINT64", [1], "o"),
        ("sampling_param_exclude_input_from_output", "BOOL", [1], "o"),
        ("sampling_param_return_perf_metrics", "BOOL", [1], "o"),
    ]
    + [
        (n, "BOOL", [1], "o")
        for n in ("return_finish_reason", "return_stop_reason", "return_cumulative_logprob", "stop")
    ]
)
LLMAPI_OUT = (
    [
        ("text_output", "STRING", [-1], ""),
        ("finish_reason", "STRING", [-1], ""),
        ("stop_reason", "STRING", [-1], ""),
        ("cumulative_logprob", "FP32", [-1], ""),
    ]
    + [
        (n, "INT32", [-1], "")
        for n in (
            "kv_cache_reused_block",
            "kv_cache_missed_block",
            "kv_cache_alloc_new_blocks",
            "kv_cache_alloc_total_blocks",
        )
    ]
    + [("kv_cache_hit_rate", "FP32", [-1], "")]
    + _REQUEST_PERF_OUT
)


# --- upstream copies ---------------------------------------------------------------------------------------------


def upstream_dir(upstream: str | Path, needed: list[str]) -> Path:
    """The upstream models folder ``--upstream-models`` names, checked to hold every file of ``needed``. Public: both
    layouts (engine and LLM API) copy from it."""
    source = Path(upstream).expanduser().resolve()
    missing = [rel for rel in needed if not (source / rel).is_file()]
    if missing:
        raise ConfigError(f"--upstream-models {source}: missing {', '.join(missing)}; expected {UPSTREAM_HINT}")
    return source


def copied_version_folder(folder: Path, name: str) -> dict[str, str]:
    """Text files of ``folder/1`` (model.py, lib/*.py, ...) keyed as they go into the repository. Public: both layouts
    (engine and LLM API) copy upstream's ``1/`` folders with it."""
    version = folder / "1"
    copied = {}
    for path in sorted(version.rglob("*")) if version.is_dir() else []:
        if path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts:
            copied[f"{name}/1/{path.relative_to(version).as_posix()}"] = path.read_text(encoding="utf-8")
    if not copied:
        copied[f"{name}/1/.keep"] = ""
    return copied
