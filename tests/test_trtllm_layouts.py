"""Triton repositories for tensorrt_llm bundles: every config parses into ModelConfig; golden files; consistency."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc")

from triton_repo import trtllm_layouts as layouts  # noqa: E402
from triton_repo.pbtxt import ConfigError  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "triton_trtllm"
ENGINE = layouts.EngineLayout("/bundle/target/engine", "/bundle/draft/engine", "/bundle/tokenizer",
                              max_batch_size=4, target_gpu_device_ids="1")
LLM_KWARGS = {"model": "/bundle/target/hf", "tokenizer": "/bundle/tokenizer", "dtype": "float16",
              "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "max_batch_size": 4, "max_seq_len": 2048,
              "speculative_config": {"decoding_type": "Draft_Target", "max_draft_len": 8,
                                     "speculative_model": "/bundle/draft/hf"}}


def check_golden(files: dict[str, str], folder: str) -> None:
    root = GOLDEN / folder
    if os.environ.get("UPDATE_GOLDEN"):
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text, encoding="utf-8")
    stored = {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in root.rglob("*") if p.is_file()}
    assert stored == files, f"repository differs from {root} (UPDATE_GOLDEN=1 to accept)"


def test_engine_layout_golden_and_parses():
    files = layouts.engine_repo_files(ENGINE)
    parsed = layouts.parse_all(files)
    assert sorted(c.name for c in parsed.values()) == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm",
                                                       "tensorrt_llm_bls", "tensorrt_llm_draft"]
    check_golden(files, "engine")


def test_llmapi_layout_golden_and_parses():
    import yaml
    files = layouts.llmapi_repo_files(layouts.LlmApiLayout(LLM_KWARGS, max_batch_size=4))
    (config,) = layouts.parse_all(files).values()
    assert config.backend == "python" and config.max_batch_size == 4
    model = yaml.safe_load(files["tensorrt_llm/1/model.yaml"])
    assert model["speculative_config"] == {"decoding_type": "Draft_Target", "max_draft_len": 8,
                                           "speculative_model_dir": "/bundle/draft/hf"}
    assert model["triton_config"] == {"max_batch_size": 4, "decoupled": False}
    check_golden(files, "llmapi")


def test_draft_and_target_models_differ_only_where_they_must():
    configs = layouts.engine_configs(ENGINE)
    target, draft = configs["tensorrt_llm"], configs["tensorrt_llm_draft"]
    differing = {k for k in target if target[k] != draft[k]}
    assert differing == {"name", "parameters"}
    params = {k for k in target["parameters"] if target["parameters"][k] != draft["parameters"][k]}
    assert params == {"gpt_model_path", "gpu_device_ids"}
    bls = configs["tensorrt_llm_bls"]["parameters"]
    assert bls["tensorrt_llm_model_name"]["string_value"] == "tensorrt_llm"
    assert bls["tensorrt_llm_draft_model_name"]["string_value"] == "tensorrt_llm_draft"


def test_ensemble_check_catches_a_type_mismatch_and_a_missing_tensor():
    configs = layouts.engine_configs(ENGINE)
    layouts.check_ensemble(configs)
    configs["postprocessing"]["input"][0]["data_type"] = "TYPE_INT64"
    configs["ensemble"]["ensemble_scheduling"]["step"][1]["input_map"]["no_such_input"] = "top_k"
    with pytest.raises(ConfigError) as err:
        layouts.check_ensemble(configs)
    assert "TOKENS_BATCH is TYPE_INT64" in str(err.value) and "no input 'no_such_input'" in str(err.value)


def test_misspelt_field_is_an_error_at_generation_time():
    config = layouts.engine_configs(ENGINE)["preprocessing"]
    config["instance_groups"] = config.pop("instance_group")
    with pytest.raises(ConfigError):
        layouts.model_config(config)


def test_write_repo_links_python_models(tmp_path):
    source = tmp_path / "all_models"
    (source / "preprocessing" / "1").mkdir(parents=True)
    (source / "preprocessing" / "1" / "model.py").write_text("# tensorrtllm_backend's\n")
    root = layouts.write_repo(layouts.engine_repo_files(ENGINE), tmp_path / "repo", python_models_from=source)
    assert (root / "preprocessing" / "1" / "model.py").is_symlink()
    assert (root / "tensorrt_llm" / "config.pbtxt").is_file()
