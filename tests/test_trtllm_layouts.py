"""Triton repositories for tensorrt_llm bundles: every config parses into ModelConfig; golden files; consistency."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc")

from triton_repo.trtllm import layouts  # noqa: E402
from triton_repo.pbtxt import ConfigError, model_config  # noqa: E402
from triton_repo.trtllm.llmapi_layout import LlmApiLayout, llmapi_repo_files  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "triton_trtllm"
ENGINE = layouts.EngineLayout(
    "/bundle/target/engine", "/bundle/draft/engine", "/bundle/tokenizer", max_batch_size=4, target_gpu_device_ids="1"
)
LLM_KWARGS = {
    "model": "/bundle/target/hf",
    "tokenizer": "/bundle/tokenizer",
    "dtype": "float16",
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "max_batch_size": 4,
    "max_seq_len": 2048,
    "disable_overlap_scheduler": True,
    "speculative_config": {"decoding_type": "DraftTarget", "max_draft_len": 8, "speculative_model": "/bundle/draft/hf"},
}


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
    assert sorted(c.name for c in parsed.values()) == [
        "ensemble",
        "postprocessing",
        "preprocessing",
        "tensorrt_llm",
        "tensorrt_llm_bls",
        "tensorrt_llm_draft",
    ]
    check_golden(files, "engine")


def test_llmapi_layout_golden_and_parses():
    import yaml

    files = llmapi_repo_files(LlmApiLayout(LLM_KWARGS, max_batch_size=4))
    (config,) = layouts.parse_all(files).values()
    # upstream's model.py refuses batched text_input; batching settings live in model.yaml only
    assert config.backend == "python" and config.max_batch_size == 0
    assert not config.HasField("model_transaction_policy")
    assert [g.kind for g in config.instance_group] == [config.instance_group[0].KIND_CPU]
    model = yaml.safe_load(files["tensorrt_llm/1/model.yaml"])
    assert model["speculative_config"] == {
        "decoding_type": "DraftTarget",
        "max_draft_len": 8,
        "speculative_model_dir": "/bundle/draft/hf",
    }
    assert model["triton_config"] == {"max_batch_size": 0, "decoupled": False}
    assert model["max_batch_size"] == 4 and model["disable_overlap_scheduler"] is True
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
        model_config(config)


def make_upstream(root: Path, drop: str = "") -> Path:
    """A stand-in for upstream's inflight_batcher_llm folder: config templates carrying every ${placeholder} the
    generator fills (as strings, numbers and enum values, where upstream's templates have them), plus one more it
    must leave alone, and a 1/ folder with a model file."""
    ints, enums = (
        {
            "triton_max_batch_size",
            "preprocessing_instance_count",
            "postprocessing_instance_count",
            "bls_instance_count",
        },
        {"logits_datatype"},
    )
    for name, values in layouts._template_values(layouts.EngineLayout("e", "d", "t")).items():
        if name == layouts.DRAFT:
            continue
        keys = [k for k in values if k != drop]
        lines = [f'name: "{name}"', 'backend: "python"']
        lines += [f"max_batch_size: ${{{k}}}" for k in keys if k == "triton_max_batch_size"]
        lines += [
            f"instance_group {{ count: ${{{k}}} kind: KIND_CPU }}"
            for k in keys
            if k in ints and k != "triton_max_batch_size"
        ]
        lines += [f'output {{ name: "logits" data_type: ${{{k}}} dims: [ -1 ] }}' for k in keys if k in enums]
        lines += [
            f'parameters {{ key: "{k}" value {{ string_value: "${{{k}}}" }} }}' for k in keys if k not in ints | enums
        ] + ['parameters { key: "later" value { string_value: "${later}" } }']
        folder = root / name
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (folder / "1" / "model.py").write_text(f"# {name} model file\n", encoding="utf-8")
    return root


def test_upstream_templates_are_filled_the_draft_is_the_target_renamed(tmp_path):
    files = layouts.upstream_engine_files(ENGINE, make_upstream(tmp_path / "upstream"))
    parsed = {c.name: c for c in layouts.parse_all(files).values()}
    assert sorted(parsed) == [
        "ensemble",
        "postprocessing",
        "preprocessing",
        "tensorrt_llm",
        "tensorrt_llm_bls",
        "tensorrt_llm_draft",
    ]
    target, draft = parsed["tensorrt_llm"], parsed["tensorrt_llm_draft"]
    assert target.parameters["engine_dir"].string_value == "/bundle/target/engine"
    assert draft.parameters["engine_dir"].string_value == "/bundle/draft/engine"
    assert draft.parameters["gpu_device_ids"].string_value == "0" and target.max_batch_size == 4
    assert target.parameters["later"].string_value == "${later}"  # not ours to set: left as upstream leaves it
    assert files["tensorrt_llm_bls/1/model.py"] == "# tensorrt_llm_bls model file\n"
    assert files["tensorrt_llm_draft/1/model.py"] == "# tensorrt_llm model file\n"


def test_upstream_template_without_a_key_we_set_is_refused_by_name(tmp_path):
    missing = r"tensorrt_llm/config.pbtxt: the template has no \$\{enable_kv_cache_reuse\}"
    with pytest.raises(ConfigError, match=missing):
        layouts.upstream_engine_files(ENGINE, make_upstream(tmp_path / "upstream", drop="enable_kv_cache_reuse"))
    with pytest.raises(ConfigError, match="missing preprocessing/config.pbtxt"):
        layouts.upstream_engine_files(ENGINE, tmp_path / "empty")


def test_write_repo_replaces_only_its_own_repository(tmp_path):
    files = layouts.engine_repo_files(ENGINE)
    root = layouts.write_repo(files, tmp_path / "repo")
    layouts.write_repo(files, root, overwrite=True)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a repository this generator wrote"):
        layouts.write_repo(files, tmp_path / "work", overwrite=True)
    assert (tmp_path / "work" / "notes.txt").read_text() == "mine"


def test_upstream_llmapi_files_are_copied_and_our_model_yaml_replaces_theirs(tmp_path):
    import yaml

    source = tmp_path / "llmapi" / "tensorrt_llm"
    (source / "1").mkdir(parents=True)
    (source / "config.pbtxt").write_text('name: "tensorrt_llm"\nbackend: "python"\n')
    (source / "1" / "model.py").write_text("# upstream model\n")
    (source / "1" / "helpers.py").write_text("# upstream helpers\n")
    (source / "1" / "model.yaml").write_text("model: TinyLlama/TinyLlama-1.1B-Chat-v1.0\n")
    files = llmapi_repo_files(LlmApiLayout(LLM_KWARGS), tmp_path / "llmapi")
    assert files["tensorrt_llm/1/helpers.py"] == "# upstream helpers\n"
    assert yaml.safe_load(files["tensorrt_llm/1/model.yaml"])["model"] == "/bundle/target/hf"
