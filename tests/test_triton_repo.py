"""The generated Triton repository, without a server: golden configs, ModelConfig parsing, names, layout, CLI."""

from __future__ import annotations

import os
import shutil
import types
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc")

from triton_repo import pbtxt  # noqa: E402
from triton_repo.generate import (
    ENSEMBLE,
    POSTPROCESSING,
    PREPROCESSING,
    SPECULATIVE,
    RepoOptions,  # noqa: E402
    RepositoryError,
    check_name,
    ensemble_config,
    postprocessing_config,
    preprocessing_config,
    speculative_config,
    write_repository,
    _inside,
)

GOLDEN = Path(__file__).parent / "golden" / "triton_repo"
MODELS = (ENSEMBLE, PREPROCESSING, SPECULATIVE, POSTPROCESSING)

# tensorrtllm_backend's ensemble (all_models/inflight_batcher_llm/ensemble/config.pbtxt, 2025): name -> (dtype, dims)
TRTLLM_INPUTS = {
    "text_input": ("TYPE_STRING", [1]),
    "max_tokens": ("TYPE_INT32", [1]),
    "stop_words": ("TYPE_STRING", [-1]),
    "end_id": ("TYPE_INT32", [1]),
    "top_k": ("TYPE_INT32", [1]),
    "top_p": ("TYPE_FP32", [1]),
    "temperature": ("TYPE_FP32", [1]),
    "seed": ("TYPE_UINT64", [1]),
    "stream": ("TYPE_BOOL", [1]),
    "num_draft_tokens": ("TYPE_INT32", [1]),
}
TRTLLM_OUTPUTS = {
    "text_output": ("TYPE_STRING", [-1]),
    "acceptance_rate": ("TYPE_FP32", [1]),
    "total_accepted_draft_tokens": ("TYPE_INT32", [1]),
    "total_draft_tokens": ("TYPE_INT32", [1]),
}


def _golden_configs() -> dict[str, str]:
    options = RepoOptions(instances=2, threads=3, max_batch_size=8)
    manifest = types.SimpleNamespace(max_context=256, spec=types.SimpleNamespace(device="cpu"))
    return {
        ENSEMBLE: pbtxt.render(ensemble_config(options)),
        PREPROCESSING: pbtxt.render(preprocessing_config(options, manifest, "../speculative/bundle/tokenizer")),
        SPECULATIVE: pbtxt.render(speculative_config(options, manifest, "bundle")),
        POSTPROCESSING: pbtxt.render(postprocessing_config(options, manifest, "../speculative/bundle/tokenizer")),
    }


@pytest.mark.parametrize("name", MODELS)
def test_config_matches_golden_file(name):
    """Regenerate with DRAFTSMITH_UPDATE_GOLDEN=1 after a deliberate change, and review the diff."""
    text = _golden_configs()[name]
    path = GOLDEN / f"{name}.pbtxt"
    if os.environ.get("DRAFTSMITH_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), f"{name} config changed; see {path}"
    config = pbtxt.parse(path.read_text(encoding="utf-8"))
    assert config.name == name


def _io(config, which):
    from tritonclient.grpc import model_config_pb2 as pb

    return {t.name: (pb.DataType.Name(t.data_type), list(t.dims)) for t in getattr(config, which)}


def test_ensemble_speaks_tensorrtllm_backend_names():
    config = pbtxt.parse(_golden_configs()[ENSEMBLE])
    inputs, outputs = _io(config, "input"), _io(config, "output")
    for name, want in TRTLLM_INPUTS.items():
        assert inputs[name] == want, name
    assert outputs == TRTLLM_OUTPUTS
    optional = {t.name for t in config.input if t.optional}
    assert optional == set(inputs) - {"text_input", "max_tokens"}
    steps = [s.model_name for s in config.ensemble_scheduling.step]
    assert steps == [PREPROCESSING, SPECULATIVE]


def test_speculative_is_decoupled_and_batched():
    config = pbtxt.parse(_golden_configs()[SPECULATIVE])
    assert config.model_transaction_policy.decoupled
    assert config.max_batch_size == 8 and config.HasField("dynamic_batching")
    assert config.instance_group[0].count == 2
    assert config.parameters["threads"].string_value == "3"
    assert _io(config, "output") == TRTLLM_OUTPUTS


def test_render_refuses_missing_and_unknown_values():
    config = ensemble_config(RepoOptions())
    with pytest.raises(pbtxt.ConfigError, match="max_batch_size"):
        pbtxt.render({**config, "max_batch_size": None})
    with pytest.raises(pbtxt.ConfigError, match="unfilled"):
        pbtxt.render({**config, "name": "${model_name}"})
    with pytest.raises(pbtxt.ConfigError):
        pbtxt.render({**config, "max_batchsize": 4})


@pytest.mark.parametrize("name", ["ensemble", "speculative", "my-model_1.v2", "A9"])
def test_check_name_accepts(name):
    assert check_name(name) == name


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../x", "a/../b", "/abs", "a/b", "a\\b", "a b", "-dash", "ü", "x" * 65, "a..b", "model\n"]
)
def test_check_name_rejects(name):
    with pytest.raises(RepositoryError):
        check_name(name)


@pytest.mark.parametrize("rel", ["../out", "/etc/passwd", "a/../../b"])
def test_paths_stay_inside(tmp_path, rel):
    with pytest.raises(RepositoryError, match="escapes"):
        _inside(tmp_path, rel)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"instances": 0}, "instances"),
        ({"threads": -1}, "threads"),
        ({"max_batch_size": True}, "max_batch_size"),
        ({"bundle_mount": "models/x", "copy_bundle": False}, "bundle_mount"),
        ({"bundle_mount": "/models/../x", "copy_bundle": False}, "bundle_mount"),
        ({"bundle_mount": "/models/x"}, "copy_bundle"),
    ],
)
def test_options_validated(kwargs, field):
    with pytest.raises(RepositoryError, match=field):
        RepoOptions(**kwargs)


def test_repository_layout_is_relocatable(tiny_bundle, tmp_path):
    repo = write_repository(tiny_bundle, tmp_path / "repo", RepoOptions(instances=2, threads=1, max_batch_size=4))
    for name in MODELS:
        text = (repo / name / "config.pbtxt").read_text(encoding="utf-8")
        assert "${" not in text
        config = pbtxt.parse(text)
        assert config.name == name and (repo / name / "1").is_dir()
        if config.backend == "python":
            assert (repo / name / "1" / "model.py").is_file()
    spec = pbtxt.parse((repo / SPECULATIVE / "config.pbtxt").read_text())
    assert spec.parameters["bundle"].string_value == "bundle"
    assert spec.instance_group[0].count == 2 and spec.max_batch_size == 4
    moved = shutil.move(str(repo), str(tmp_path / "elsewhere"))  # a relocated repository still finds its bundle
    from runtime.bundle import load_manifest

    assert load_manifest(Path(moved) / SPECULATIVE / "bundle").default_k >= 1
    pre = pbtxt.parse((Path(moved) / PREPROCESSING / "config.pbtxt").read_text())
    assert (Path(moved) / PREPROCESSING / pre.parameters["tokenizer"].string_value / "tokenizer.json").is_file()


def test_repository_with_mounted_bundle(tiny_bundle, tmp_path):
    repo = write_repository(
        tiny_bundle, tmp_path / "repo", RepoOptions(bundle_mount="/bundles/tiny", copy_bundle=False)
    )
    assert not (repo / SPECULATIVE / "bundle").exists()
    spec = pbtxt.parse((repo / SPECULATIVE / "config.pbtxt").read_text())
    assert spec.parameters["bundle"].string_value == "/bundles/tiny"
    pre = pbtxt.parse((repo / PREPROCESSING / "config.pbtxt").read_text())
    assert pre.parameters["tokenizer"].string_value == "/bundles/tiny/tokenizer"


def test_repository_refuses_non_empty_out_and_bad_limits(tiny_bundle, tmp_path):
    out = tmp_path / "repo"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(RepositoryError, match="not empty"):
        write_repository(tiny_bundle, out)
    with pytest.raises(RepositoryError, match="max_tokens_limit"):
        write_repository(tiny_bundle, tmp_path / "other", RepoOptions(max_tokens_limit=10_000))
    with pytest.raises(RepositoryError, match="not a repository written by draftsmith"):
        write_repository(tiny_bundle, out, overwrite=True)  # --overwrite replaces only a repository we wrote
    assert (out / "keep.txt").read_text() == "x"
    (out / "keep.txt").unlink()
    write_repository(tiny_bundle, out)
    (out / "stale.txt").write_text("x")
    write_repository(tiny_bundle, out, RepoOptions(streaming=False), overwrite=True)
    assert not (out / "stale.txt").exists()
    assert not pbtxt.parse((out / SPECULATIVE / "config.pbtxt").read_text()).model_transaction_policy.decoupled


def test_cli_writes_repository(tiny_bundle, tmp_path):
    from click.testing import CliRunner
    from runtime.cli import main

    out = tmp_path / "repo"
    result = CliRunner().invoke(
        main, ["triton-repo", str(tiny_bundle), str(out), "--instances", "3", "--threads", "2", "--max-batch-size", "5"]
    )
    assert result.exit_code == 0, result.output
    spec = pbtxt.parse((out / SPECULATIVE / "config.pbtxt").read_text())
    assert (spec.instance_group[0].count, spec.parameters["threads"].string_value, spec.max_batch_size) == (3, "2", 5)
    again = CliRunner().invoke(main, ["triton-repo", str(tiny_bundle), str(out)])
    assert again.exit_code != 0 and "not empty" in again.output
