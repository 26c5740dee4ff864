"""`draftsmith serve`'s defaults: secrets never passed by prefix, and the APIs a serving deployment never needs shut
(shared memory maps client memory; the repository API loads and unloads models)."""

from __future__ import annotations

import pytest

from triton_repo.server import CLOSED_BY_DEFAULT, restricted_by_default, server_env


@pytest.mark.parametrize(
    "name", ["NVIDIA_API_KEY", "NVIDIA_NGC_TOKEN", "CUDA_SECRET", "ORT_AUTH", "OMP_PASSWORD", "LC_CREDENTIALS"]
)
def test_secret_looking_names_are_not_passed_by_prefix(monkeypatch, name):
    monkeypatch.setenv(name, "s3cret")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "0")
    env = server_env()
    assert name not in env and env["NVIDIA_VISIBLE_DEVICES"] == "0"
    assert server_env(pass_env=[name])[name] == "s3cret"  # named by the person running the command: passed


def test_shared_memory_and_the_repository_api_are_closed_by_default():
    specs = restricted_by_default([], "--http-restricted-api")
    assert len(specs) == 1 and specs[0].startswith("shared-memory,model-repository:draftsmith-closed=")
    assert restricted_by_default([], "--http-restricted-api") != specs  # a random key nobody is told


def test_a_callers_own_restriction_is_kept_and_only_the_rest_is_closed():
    mine = "model-repository,statistics:admin-key=abc"
    specs = restricted_by_default([mine], "--grpc-restricted-protocol")
    assert specs[0] == mine and specs[1].startswith("shared-memory:draftsmith-closed=")
    both = [f"{','.join(CLOSED_BY_DEFAULT)}:admin-key=abc"]
    assert restricted_by_default(both, "--http-restricted-api") == both


def test_the_triton_models_tokenizer_comes_from_verified_bytes(tiny_bundle, tmp_path):
    """Pre- and postprocessing read the bundle's tokenizer through its manifest: a swapped file is refused."""
    import shutil

    from runtime.core.loaded import bundle_tokenizer
    from runtime.bundle import BundleError

    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, copy)
    assert bundle_tokenizer(copy / "tokenizer").vocab_size > 0
    path = copy / "tokenizer" / "tokenizer.json"
    path.write_text(path.read_text().replace('"<|endoftext|>"', '"<|evil|>"', 1))
    with pytest.raises(BundleError):
        bundle_tokenizer(copy / "tokenizer")


@pytest.mark.parametrize(
    "path",
    [
        '/b/x"\n  }\n}\nparameters: { key: "EXECUTION_ENV_PATH" value: { string_value: "/tmp/e',
        "/b/a\\\\b",
        "/b/tab\there",
        "/b/\x7f",
    ],
)
def test_a_bundle_path_cannot_add_fields_to_an_upstream_config(path):
    """--upstream-models fills upstream's templates as text: a path with a quote and newlines would close the string
    and add a parameter (here a Python execution environment the model would run)."""
    from triton_repo.pbtxt import ConfigError
    from triton_repo.trtllm.layouts import fill_template

    template = 'parameters: { key: "engine_dir" value: { string_value: "${engine_dir}" } }\n'
    with pytest.raises(ConfigError, match="cannot hold"):
        fill_template(template, {"engine_dir": path}, "tensorrt_llm/config.pbtxt")
    assert "/b/engine" in fill_template(template, {"engine_dir": "/b/engine"}, "tensorrt_llm/config.pbtxt")
