"""The LLM-API Triton repository (all_models/llmapi): config.pbtxt and model.yaml for an llmapi bundle."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_repo.pbtxt import render
from triton_repo.trtllm.interface import LLMAPI_IN, LLMAPI_OUT, copied_version_folder, upstream_dir, tensors


@dataclass(frozen=True)
class LlmApiLayout:
    llm_kwargs: dict  # LLM(...) keywords with absolute paths (runtime/trtllm_llmapi.llm_api_kwargs, checked)
    max_batch_size: int = 8  # the LLM's own batching (LLM(max_batch_size=...)); Triton's stays 0
    decoupled: bool = False


def llmapi_config(layout: LlmApiLayout) -> dict[str, Any]:
    # No max_batch_size and no model_transaction_policy here: upstream's config.pbtxt says they belong in
    # model.yaml's triton_config, which model.py's auto_complete_config applies.
    return {
        "name": "tensorrt_llm",
        "backend": "python",
        "input": tensors(LLMAPI_IN),
        "output": tensors(LLMAPI_OUT),
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
    }


def llmapi_model_yaml(layout: LlmApiLayout) -> dict[str, Any]:
    """model.yaml: LLM keywords plus triton_config. speculative_config as from_dict reads it in every release line:
    decoding_type "DraftTarget", the draft under speculative_model_dir (1.0-1.2's field; current main reads it as
    an alias: AliasChoices("speculative_model", "speculative_model_dir"))."""
    from runtime.trtllm.common import DECODING_TYPE

    kwargs = dict(layout.llm_kwargs)
    speculative = dict(kwargs.pop("speculative_config"))
    return {
        **kwargs,
        "backend": "pytorch",
        "speculative_config": {
            "decoding_type": DECODING_TYPE,
            "max_draft_len": speculative["max_draft_len"],
            "speculative_model_dir": speculative["speculative_model"],
        },
        "triton_config": {"max_batch_size": 0, "decoupled": layout.decoupled},
    }


def llmapi_repo_files(layout: LlmApiLayout, upstream: str | Path | None = None) -> dict[str, str]:
    import yaml

    files = {"tensorrt_llm/1/model.yaml": yaml.safe_dump(llmapi_model_yaml(layout), sort_keys=False)}
    if upstream is None:
        files["tensorrt_llm/config.pbtxt"] = render(llmapi_config(layout))
        files["README.md"] = (
            "# Draftsmith TensorRT-LLM repository (LLM API)\n\nInstall `tensorrt_llm/1/model.py` "
            "and `helpers.py` from TensorRT-LLM's triton_backend/all_models/llmapi/ (same release as "
            "the container), or regenerate with --upstream-models pointing at that folder.\n"
        )
        return files
    source = upstream_dir(upstream, ["tensorrt_llm/config.pbtxt", "tensorrt_llm/1/model.py"])
    files["tensorrt_llm/config.pbtxt"] = (source / "tensorrt_llm" / "config.pbtxt").read_text(encoding="utf-8")
    copied = copied_version_folder(source / "tensorrt_llm", "tensorrt_llm")
    copied.pop("tensorrt_llm/1/model.yaml", None)  # upstream's example; ours replaces it
    files.update(copied)
    files["README.md"] = (
        "# Draftsmith TensorRT-LLM repository (LLM API)\n\nModel files copied from the upstream folder.\n"
    )
    return files
