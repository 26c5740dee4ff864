"""Triton model repositories for tensorrt_llm bundles, rendered from typed data (triton_repo/pbtxt.render).

Longer than most modules: the two layouts are tables of upstream's model configs side by side, each named
with the upstream file it follows; their shared interface tables are triton_repo/trtllm/interface.py.

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
  (``PRE_*``, ``TRT_*``, ``BLS_*`` in triton_repo/trtllm/interface.py;
  tests/fixtures/trtllm/inflight_batcher_llm.json lists what each model reads and tests/test_trtllm_conformance.py
  holds the configs to it), and the ``1/`` folders must be installed from the matching release.

  Placement (triton_repo/trtllm/launch.py): ``gpu_device_ids`` per model from the device lists, or
  ``participant_ids`` + ``num_nodes`` across nodes, and a ``launch.sh`` running TensorRT-LLM's own
  launch_triton_server.py (``--multi-model``: orchestrator mode, which two tensorrt_llm models need).

* LLM API (``LlmApiLayout``; all_models/llmapi, every release since 1.0)::

      tensorrt_llm/config.pbtxt        python backend, KIND_CPU, no max_batch_size (model.yaml sets it)
      tensorrt_llm/1/model.yaml        LLM(...) keywords, speculative_config included, plus triton_config

  all_models/llmapi/tensorrt_llm/1/model.py reads model.yaml: every key but ``triton_config`` goes to
  ``LLM(**update_llm_args_with_extra_dict({}, yaml))``; ``triton_config.max_batch_size`` and ``.decoupled`` set
  the model's batching and transaction policy. Its ``_convert_request`` refuses a batched ``text_input``, so
  ``triton_config.max_batch_size`` is 0, as in upstream's own model.yaml.
"""

from __future__ import annotations

import re
import shutil
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_repo.pbtxt import ConfigError, render
from triton_repo.trtllm.interface import (
    BLS_IN,
    BLS_OUT,
    POST_IN,
    POST_OUT,
    PRE_IN,
    PRE_OUT,
    TRT_IN,
    TRT_OUT,
    UPSTREAM_HINT,
    copied_version_folder,
    parameter_text,
    parameters,
    tensor,
    tensors,
    upstream_dir,
)
from triton_repo.trtllm.llmapi_layout import LlmApiLayout, llmapi_repo_files
from triton_repo.trtllm.launch import Placement, engine_launch_args, launch_script, llmapi_launch_args, placement

DRAFT, TARGET = "tensorrt_llm_draft", "tensorrt_llm"
ENGINE_MODELS = ("preprocessing", "postprocessing", TARGET, "tensorrt_llm_bls", "ensemble")
# Python-backend models whose 1/ folder comes from upstream (never from Draftsmith).
PYTHON_MODELS = ("preprocessing", "postprocessing", "tensorrt_llm_bls")

# --- engine era ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineLayout:
    """Everything the engine-era repository depends on; paths as the server will see them."""

    target_engine_dir: str
    draft_engine_dir: str
    tokenizer_dir: str
    max_batch_size: int = 8
    decoupled: bool = False  # True: streaming responses (tensorrt_llm_bls "stream" input)
    # Per model, of the GPU memory free when it loads; 0.5: the draft-target guide's value for two models per GPU.
    kv_cache_free_gpu_mem_fraction: float = 0.5
    target_gpu_device_ids: str = "0"  # comma list, one id per rank (model_state.cc); "" with participant ids only
    draft_gpu_device_ids: str = "0"
    target_participant_ids: str = ""  # MPI ranks, multi-node only (processes started up front)
    draft_participant_ids: str = ""
    num_nodes: int = 1
    max_tokens_in_paged_kv_cache: int = 0  # 0: unset (the backend's default, 90% of free memory per model)
    max_queue_delay_microseconds: int = 0
    instance_count: int = 1  # preprocessing, postprocessing and BLS instances
    # KV-cache block reuse must stay on: a draft_tokens_external target refuses to load without it
    # (trtGptModelInflightBatching.cpp; tests/fixtures/trtllm/batch_manager.json).
    enable_kv_cache_reuse: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size: expected >= 1, received {self.max_batch_size}")
        if not 0 < self.kv_cache_free_gpu_mem_fraction <= 1:
            raise ConfigError(
                f"kv_cache_free_gpu_mem_fraction: expected (0, 1], received {self.kv_cache_free_gpu_mem_fraction}"
            )
        if self.enable_kv_cache_reuse is not True:
            raise ConfigError(
                "enable_kv_cache_reuse: expected True (TensorRT-LLM's batch manager refuses a "
                'draft_tokens_external target without it: "KV cache block reuse must be enabled for '
                f'speculative decoding target model"), received {self.enable_kv_cache_reuse!r}'
            )
        if not (self.target_gpu_device_ids or self.target_participant_ids):
            raise ConfigError("target_gpu_device_ids: expected GPU ids (or participant ids across nodes)")

    @classmethod
    def placed(
        cls, target_engine_dir: str, draft_engine_dir: str, tokenizer_dir: str, where: Placement, **options
    ) -> "EngineLayout":
        """The layout with device / participant ids from a Placement: GPU ids on one node; across nodes, MPI ranks
        (rank 0 the orchestrator) and num_nodes, the GPUs left to each rank's node."""
        if where.multi_node:
            ranks = where.participant_ids()
            ids = {
                "target_gpu_device_ids": "",
                "draft_gpu_device_ids": "",
                "target_participant_ids": ",".join(map(str, ranks["target"])),
                "draft_participant_ids": ",".join(map(str, ranks["draft"])),
                "num_nodes": where.num_nodes,
            }
        else:
            ids = {
                "target_gpu_device_ids": where.gpu_device_ids("target"),
                "draft_gpu_device_ids": where.gpu_device_ids("draft"),
            }
        return cls(target_engine_dir, draft_engine_dir, tokenizer_dir, **{**options, **ids})


def _batching(layout: EngineLayout) -> dict[str, Any]:
    return {
        "preferred_batch_size": [layout.max_batch_size],
        "max_queue_delay_microseconds": layout.max_queue_delay_microseconds,
    }


def preprocessing(layout: EngineLayout) -> dict[str, Any]:
    # model.py indexes parameters['tokenizer_dir'] and ['multimodal_model_path'] (KeyError when absent; "" means
    # none) and looks up every INPUT_ID ... IMAGE_SIZES output config by name at load time.
    return {
        "name": "preprocessing",
        "backend": "python",
        "max_batch_size": layout.max_batch_size,
        "dynamic_batching": _batching(layout),
        "input": tensors(PRE_IN),
        "output": tensors(PRE_OUT),
        "parameters": parameters(
            {
                "tokenizer_dir": layout.tokenizer_dir,
                "add_special_tokens": False,
                "multimodal_model_path": "",
                "gpt_model_path": layout.target_engine_dir,
            }
        ),
        "instance_group": [{"count": layout.instance_count, "kind": "KIND_CPU"}],
    }


def postprocessing(layout: EngineLayout) -> dict[str, Any]:
    # model.py raises for any input but TOKENS_BATCH and SEQUENCE_LENGTH, and returns OUTPUT only.
    return {
        "name": "postprocessing",
        "backend": "python",
        "max_batch_size": layout.max_batch_size,
        "dynamic_batching": {},
        "input": tensors(POST_IN),
        "output": tensors(POST_OUT),
        "parameters": parameters({"tokenizer_dir": layout.tokenizer_dir, "skip_special_tokens": True}),
        "instance_group": [{"count": layout.instance_count, "kind": "KIND_CPU"}],
    }


def tensorrt_llm(layout: EngineLayout, role: str) -> dict[str, Any]:
    """The target's or the draft's tensorrt_llm model: one function, so the two cannot drift apart."""
    return {
        "name": TARGET if role == "target" else DRAFT,
        "backend": "tensorrtllm",
        "max_batch_size": layout.max_batch_size,
        "model_transaction_policy": {"decoupled": layout.decoupled},
        "dynamic_batching": _batching(layout),
        "input": tensors(TRT_IN),
        "output": tensors(TRT_OUT),
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        # Values: the draft-target guide's fill_template call (max_beam_width 1, inflight_fused_batching,
        # exclude_input_in_output, enable_kv_cache_reuse, max_tokens_in_paged_kv_cache, gpu_device_ids); keys left
        # out take the backend's defaults.
        "parameters": parameters(_trt_values(layout, role, template=False)),
    }


def _trt_values(layout: EngineLayout, role: str, template: bool) -> dict[str, Any]:
    """tensorrt_llm parameter values; template=True: keyed by the config template's ${placeholders}."""
    engine_dir = layout.target_engine_dir if role == "target" else layout.draft_engine_dir
    placement = {
        "gpu_device_ids": getattr(layout, f"{role}_gpu_device_ids"),
        "participant_ids": getattr(layout, f"{role}_participant_ids"),
        "num_nodes": layout.num_nodes if layout.num_nodes > 1 else "",
        "max_tokens_in_paged_kv_cache": layout.max_tokens_in_paged_kv_cache or "",
    }
    values = {
        "max_beam_width": 1,
        "batch_scheduler_policy": "guaranteed_no_evict",
        "kv_cache_free_gpu_mem_fraction": layout.kv_cache_free_gpu_mem_fraction,
        "exclude_input_in_output": True,
        "enable_kv_cache_reuse": layout.enable_kv_cache_reuse,
        **{key: value for key, value in placement.items() if value != ""},
    }
    if template:
        return {
            **values,
            "triton_backend": "tensorrtllm",
            "triton_max_batch_size": layout.max_batch_size,
            "decoupled_mode": layout.decoupled,
            "batching_strategy": "inflight_fused_batching",
            "engine_dir": engine_dir,
            "max_queue_delay_microseconds": layout.max_queue_delay_microseconds,
            "logits_datatype": "TYPE_FP32",
        }
    return {
        **values,
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": engine_dir,
    }


def tensorrt_llm_bls(layout: EngineLayout) -> dict[str, Any]:
    return {
        "name": "tensorrt_llm_bls",
        "backend": "python",
        "max_batch_size": layout.max_batch_size,
        "model_transaction_policy": {"decoupled": layout.decoupled},
        "input": tensors(BLS_IN),
        "output": tensors(BLS_OUT),
        "parameters": parameters(
            {"accumulate_tokens": False, "tensorrt_llm_model_name": TARGET, "tensorrt_llm_draft_model_name": DRAFT}
        ),
        "instance_group": [{"count": layout.instance_count, "kind": "KIND_CPU"}],
    }


def ensemble(layout: EngineLayout) -> dict[str, Any]:
    """Target-only text in/text out (the BLS is the speculative entry point); maps checked by check_ensemble."""

    def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> dict[str, Any]:
        return {"model_name": model, "model_version": -1, "input_map": inputs, "output_map": outputs}

    return {
        "name": "ensemble",
        "platform": "ensemble",
        "max_batch_size": layout.max_batch_size,
        "input": [
            tensor("text_input", "TYPE_STRING", [1]),
            tensor("max_tokens", "TYPE_INT32", [1]),
            tensor("end_id", "TYPE_INT32", [1], optional=True),
            tensor("pad_id", "TYPE_INT32", [1], optional=True),
            tensor("temperature", "TYPE_FP32", [1], optional=True),
            tensor("top_k", "TYPE_INT32", [1], optional=True),
            tensor("top_p", "TYPE_FP32", [1], optional=True),
            tensor("seed", "TYPE_UINT64", [1], optional=True),
            tensor("stream", "TYPE_BOOL", [1], optional=True),
        ],
        "output": [tensor("text_output", "TYPE_STRING", [-1])],
        "ensemble_scheduling": {
            "step": [
                step(
                    "preprocessing",
                    {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "END_ID": "end_id", "PAD_ID": "pad_id"},
                    {
                        "INPUT_ID": "_INPUT_ID",
                        "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
                        "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN",
                        "OUT_END_ID": "_END_ID",
                        "OUT_PAD_ID": "_PAD_ID",
                    },
                ),
                step(
                    TARGET,
                    {
                        "input_ids": "_INPUT_ID",
                        "input_lengths": "_REQUEST_INPUT_LEN",
                        "request_output_len": "_REQUEST_OUTPUT_LEN",
                        "end_id": "_END_ID",
                        "pad_id": "_PAD_ID",
                        "temperature": "temperature",
                        "runtime_top_k": "top_k",
                        "runtime_top_p": "top_p",
                        "seed": "seed",
                        "streaming": "stream",
                    },
                    {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"},
                ),
                step(
                    "postprocessing",
                    {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
                    {"OUTPUT": "text_output"},
                ),
            ]
        },
    }


def engine_configs(layout: EngineLayout) -> dict[str, dict[str, Any]]:
    """Model name -> ModelConfig data of the engine-era draft-target repository."""
    configs = [
        preprocessing(layout),
        postprocessing(layout),
        tensorrt_llm(layout, "target"),
        tensorrt_llm(layout, "draft"),
        tensorrt_llm_bls(layout),
        ensemble(layout),
    ]
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
        for side in ("input", "output"):  # each map's tensors exist, and a name means one type throughout
            declared = {t["name"]: t["data_type"] for t in model[side]}
            for key, value in step[f"{side}_map"].items():
                if key not in declared:
                    problems.append(f"{model['name']} has no {side} {key!r}")
                elif value in types and types[value] != declared[key]:
                    problems.append(f"{model['name']}.{key} is {declared[key]}, {value} is {types[value]}")
                types.setdefault(value, declared.get(key, "?"))
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
    where = (
        "The `1/` folders were copied from the upstream folder given."
        if upstream
        else f"Install the `1/` folders of {', '.join(PYTHON_MODELS)} (model.py, and lib/ for the BLS) from "
        "TensorRT-LLM's triton_backend/all_models/inflight_batcher_llm/ of the release your tritonserver "
        "container runs, or regenerate with --upstream-models pointing at that folder. Draftsmith does not "
        "ship upstream's code."
    )
    return (
        "# Draftsmith TensorRT-LLM draft-target repository (engine era)\n\n"
        "Entry point: `tensorrt_llm_bls` (text_input, max_tokens, num_draft_tokens; one sequence per request "
        "when num_draft_tokens > 0; send `stream` too: tensorrt_llm_bls/1/lib/decode.py reads it whenever "
        "num_draft_tokens is set). Its speculative path reads the target's and draft's configs over gRPC at "
        "localhost:8001, which launch.sh keeps. Two tensorrt_llm models need orchestrator mode "
        "(launch_triton_server.py --multi-model), not plain tritonserver.\n" + where + "\n"
    )


# --- engine era from upstream's templates (fill_template.py semantics) -------------------------------------------


def fill_template(text: str, values: dict[str, Any], where: str) -> str:
    """``${key}`` substitution as tools/fill_template.py does it, but strict about our keys.

    Every key given must occur in the template (a template without it is another release's interface: say so);
    placeholders we do not set stay, as upstream leaves them, for the models to read as unset.
    """
    missing = [key for key in values if "${" + key + "}" not in text]
    if missing:
        raise ConfigError(
            f"{where}: the template has no ${{{'}, ${'.join(missing)}}}: it is not the "
            f"inflight_batcher_llm interface this generator fills ({UPSTREAM_HINT})"
        )
    return string.Template(text).safe_substitute({k: _template_text(k, v, where) for k, v in values.items()})


def _template_text(key: str, value: Any, where: str) -> str:
    """A value as it goes into a template's text. Upstream's placeholders sit inside quoted strings, so a value
    with a quote, a backslash or a control character (a newline) could close the string and add fields of its own
    (a bundle path is hostile data): refused, never escaped into meaning something else."""
    text = parameter_text(value)
    bad = [c for c in text if c in '"\\' or ord(c) < 32 or ord(c) == 127]
    if bad:
        raise ConfigError(
            f"{where}: the value for ${{{key}}} ({text[:80]!r}) has {bad[0]!r}, which config.pbtxt "
            "cannot hold inside a string; move the bundle to a path without quotes, backslashes or "
            "control characters"
        )
    return text


def _template_values(layout: EngineLayout) -> dict[str, dict[str, Any]]:
    """Per upstream model: the placeholders we fill (names: each config.pbtxt template; values: the guide's)."""
    return {
        "preprocessing": {
            "triton_max_batch_size": layout.max_batch_size,
            "tokenizer_dir": layout.tokenizer_dir,
            "add_special_tokens": False,
            "multimodal_model_path": "",
            "engine_dir": layout.target_engine_dir,
            "preprocessing_instance_count": layout.instance_count,
        },
        "postprocessing": {
            "triton_max_batch_size": layout.max_batch_size,
            "tokenizer_dir": layout.tokenizer_dir,
            "skip_special_tokens": True,
            "postprocessing_instance_count": layout.instance_count,
        },
        TARGET: _trt_values(layout, "target", template=True),
        DRAFT: _trt_values(layout, "draft", template=True),
        "tensorrt_llm_bls": {
            "triton_max_batch_size": layout.max_batch_size,
            "decoupled_mode": layout.decoupled,
            "bls_instance_count": layout.instance_count,
            "accumulate_tokens": False,
            "tensorrt_llm_model_name": TARGET,
            "tensorrt_llm_draft_model_name": DRAFT,
            "logits_datatype": "TYPE_FP32",
        },
        "ensemble": {"triton_max_batch_size": layout.max_batch_size, "logits_datatype": "TYPE_FP32"},
    }


# Placeholders that only some releases' templates have: filled when present.
_IF_PRESENT = {
    "max_queue_delay_microseconds": 0,
    "max_queue_size": 0,
    "encoder_input_features_data_type": "TYPE_FP16",
    "prompt_embedding_table_data_type": "TYPE_FP16",
}


def upstream_engine_files(layout: EngineLayout, upstream: str | Path) -> dict[str, str]:
    """The repository from upstream's own inflight_batcher_llm folder: templates filled, 1/ files copied."""
    from google.protobuf import text_format

    from triton_repo.pbtxt import parse

    source = upstream_dir(upstream, [f"{m}/config.pbtxt" for m in ENGINE_MODELS])
    files: dict[str, str] = {}
    for name, values in _template_values(layout).items():
        folder = TARGET if name == DRAFT else name
        text = (source / folder / "config.pbtxt").read_text(encoding="utf-8")
        extra = {k: v for k, v in _IF_PRESENT.items() if "${" + k + "}" in text}
        filled = fill_template(text, {**values, **extra}, f"{folder}/config.pbtxt")
        try:
            config = parse(filled)
        except text_format.ParseError as err:
            raise ConfigError(
                f"{folder}/config.pbtxt from {source} does not parse after filling ({err}); "
                f"a placeholder outside a string is not filled by this generator"
            ) from None
        injected = set(config.parameters) - set(re.findall(r'key:\s*"([^"]*)"', text))
        if injected:  # _template_text refuses what could do this; a second check costs nothing
            raise ConfigError(f"{folder}/config.pbtxt: filling it added parameters {sorted(injected)}")
        config.name = name
        files[f"{name}/config.pbtxt"] = text_format.MessageToString(config)
        files.update(copied_version_folder(source / folder, name))
    files["README.md"] = _engine_readme(upstream=True)
    return files


# --- files -----------------------------------------------------------------------------------------------------------


def write_repo(files: dict[str, str], root: str | Path, overwrite: bool = False) -> Path:
    """Write ``files`` under ``root`` (created; it must not exist unless ``overwrite`` and it holds our README)."""
    root = Path(root)
    if root.exists():
        ours = (root / "README.md").is_file() and "Draftsmith TensorRT-LLM" in (root / "README.md").read_text(
            encoding="utf-8", errors="replace"
        )
        if not overwrite or not ours:
            raise ConfigError(
                f"{root} exists; "
                + (
                    "pass overwrite (--force) to replace it"
                    if ours
                    else "it is not a repository this generator wrote: choose another path"
                )
            )
        shutil.rmtree(root)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        if rel.endswith(".sh"):
            path.chmod(0o755)
    return root


def repo_for_bundle(
    bundle: str | Path,
    max_batch_size: int | None = None,
    decoupled: bool = False,
    upstream_models: str | Path | None = None,
    target_devices=None,
    draft_devices=None,
    num_nodes: int = 1,
    **options,
) -> dict[str, str]:
    """The repository files for a tensorrt_llm bundle, chosen by its flavor, with launch.sh.

    upstream_models: a copy of upstream's inflight_batcher_llm (engine flavor) or llmapi (LLM-API flavor) folder to
    fill and copy from. target_devices / draft_devices: GPU ids, tp x pp each (default 0 .. tp*pp-1 for both);
    num_nodes > 1: ranks started up front across nodes (triton_repo/trtllm/launch.py).
    """
    from runtime.bundle import load_manifest

    root = Path(bundle).absolute()
    manifest = load_manifest(root)  # every file against its sha256: the repository points at what was verified
    if manifest.spec.backend != "tensorrt_llm":
        raise ConfigError(f"{root} is a {manifest.spec.backend} bundle; these layouts are for tensorrt_llm bundles")
    batch = max_batch_size or manifest.spec.max_batch_size
    where = placement(manifest.spec.tp_size * manifest.spec.pp_size, target_devices, draft_devices, num_nodes)
    if manifest.spec.trtllm_flavor == "llmapi":
        from runtime.trtllm.llmapi import llm_api_kwargs

        files = llmapi_repo_files(LlmApiLayout(llm_api_kwargs(root, manifest), batch, decoupled), upstream_models)
        args = llmapi_launch_args("$REPO", where.world, num_nodes)
        explicit = target_devices and not where.multi_node
        return _with_launch(files, args, where.gpu_device_ids("target") if explicit else "")
    # The draft-target guide sizes max_tokens_in_paged_kv_cache for its batch; here every sequence of a full batch
    # at full length, plus the draft tokens the target's engine adds to its max_seq_len (builder.py build()).
    tokens = batch * (manifest.max_context + manifest.spec.max_k)
    layout = EngineLayout.placed(
        str(root / manifest.target.engine),
        str(root / manifest.draft.engine),
        str(root / "tokenizer"),
        where,
        max_batch_size=batch,
        decoupled=decoupled,
        max_tokens_in_paged_kv_cache=tokens,
        **options,
    )
    files = upstream_engine_files(layout, upstream_models) if upstream_models else engine_repo_files(layout)
    return _with_launch(files, engine_launch_args("$REPO", where))


def _with_launch(files: dict[str, str], args: list[str], cuda_visible: str = "") -> dict[str, str]:
    """launch.sh, and the command in the README."""
    files = dict(files)
    files["launch.sh"] = launch_script(args, cuda_visible)
    shown = " ".join(args).replace("$REPO", "REPO")
    files["README.md"] += (
        "\n## Start\n\n    ./launch.sh    # python3 .../launch_triton_server.py " + shown + "\n\n"
        "launch.sh finds TensorRT-LLM's launch_triton_server.py in either NVIDIA image "
        "(/app/scripts or /app/tensorrt_llm/triton_backend/scripts; TRTLLM_LAUNCH_SCRIPT "
        "overrides). Multi-node arguments start the ranks up front: run it under your MPI "
        "launcher with one slot per rank.\n"
    )
    return files


def write_trtllm_repository(
    bundle: str | Path, out: str | Path, upstream_models: str | Path | None = None, overwrite: bool = False, **options
) -> Path:
    """repo_for_bundle + write_repo: what ``build-engines --triton-repo`` runs for tensorrt_llm bundles."""
    return write_repo(repo_for_bundle(bundle, upstream_models=upstream_models, **options), out, overwrite)


def parse_all(files: dict[str, str]) -> dict[str, Any]:
    """Every config.pbtxt parsed back into ModelConfig (what the tests check)."""
    from triton_repo.pbtxt import parse

    return {rel: parse(text) for rel, text in files.items() if rel.endswith("config.pbtxt")}


__all__ = [
    "EngineLayout",
    "engine_configs",
    "engine_repo_files",
    "upstream_engine_files",
    "fill_template",
    "repo_for_bundle",
    "write_repo",
    "write_trtllm_repository",
    "check_ensemble",
    "parse_all",
]
