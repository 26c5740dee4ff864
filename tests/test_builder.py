"""build-engines: export numerics, quantization, the bundle, atomicity, and every bad input's error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from builder.architectures import REGISTRY
from builder.build import build
from builder.cli import main as cli
from conftest import EVAL_TOKENS, make_disjoint_tokenizer, make_model, tiny_config
from runtime.bundle import BuildSpec, BundleError, Manifest, SpecError, load_manifest

# One tiny-model case per registered architecture (optimum's completeness guard): add one with every new entry.
TINY_MODELS = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {"sliding_window": 4096},
    "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": {},
    "Phi3ForCausalLM": {},  # longrope, partial rotary (the registry's tiny_config)
    "Gemma2ForCausalLM": {},  # sliding window 4 < the 12 checked tokens, softcaps, eager attention
    "Gemma3ForCausalLM": {},
    "SmolLM3ForCausalLM": {},
    "GraniteForCausalLM": {},
    "Olmo2ForCausalLM": {},
}


def test_every_registered_architecture_has_a_tiny_model_test():
    assert set(TINY_MODELS) == set(REGISTRY), "add a TINY_MODELS entry for each registered architecture"


@pytest.mark.parametrize("architecture", sorted(TINY_MODELS))
def test_export_matches_torch(architecture, tmp_path):
    """Prefill, a verify pass over rolled-back slots and a left-padded batch, against transformers."""
    from builder.export import check_against_torch, export_decoder

    model = make_model(tmp_path / "m", tiny_config(architecture, **TINY_MODELS[architecture]), seed=5).eval()
    info = export_decoder(model, tmp_path / "model.onnx")
    report = check_against_torch(model, tmp_path / "model.onnx", info, REGISTRY[architecture].tolerance)
    assert set(report) == {"prefill", "verify_after_rollback", "left_padded_batch"}
    assert max(report.values()) < 1e-3
    fused = _op_types(tmp_path / "model.onnx")
    assert "SkipSimplifiedLayerNormalization" in fused and "ReduceMean" not in fused  # RMSNorm was fused


def test_export_check_catches_a_wrong_graph(tmp_path):
    """The numeric check is not a formality: a graph of another model must fail it."""
    from builder.export import ExportError, check_against_torch, export_decoder

    model = make_model(tmp_path / "a", tiny_config(), seed=5).eval()
    other = make_model(tmp_path / "b", tiny_config(), seed=6).eval()
    info = export_decoder(other, tmp_path / "other.onnx")
    with pytest.raises(ExportError, match="disagrees with torch"):
        check_against_torch(model, tmp_path / "other.onnx", info, 1e-3)


def test_manifest_round_trip_and_strictness(tiny_bundle):
    manifest = load_manifest(tiny_bundle)
    again = Manifest.from_json(manifest.to_json())
    assert again == manifest
    data = json.loads(manifest.to_json())
    data["spec"]["surprise"] = 1
    with pytest.raises(BundleError, match="unknown keys \\['surprise'\\]"):
        Manifest.from_json(json.dumps(data))
    data = json.loads(manifest.to_json())
    data["schema_version"] = 99
    with pytest.raises(BundleError, match="schema_version 99"):
        Manifest.from_json(json.dumps(data))
    with pytest.raises(BundleError, match="not valid JSON"):
        Manifest.from_json("{ not json")


def test_bundle_contents(tiny_bundle):
    manifest = load_manifest(tiny_bundle)
    assert manifest.spec.target_quant == "fp32" and manifest.default_k == 4
    assert {"target/model.onnx", "draft/model.onnx", "tokenizer/tokenizer.json"} <= set(manifest.files)
    assert manifest.target.graph == manifest.draft.graph == "fused"  # the CPU default
    assert manifest.target.input_names[:3] == ("input_ids", "seqlens_k", "total_sequence_length")
    assert manifest.eos_token_ids == (2,)
    assert manifest.max_context == 128
    assert {"torch", "onnxruntime", "transformers"} <= set(manifest.tools)
    assert not any(p.name.startswith(".") for p in tiny_bundle.parent.iterdir())  # no temporary leftovers


@pytest.mark.parametrize("damage", ["missing file", "no manifest", "flipped byte"])
def test_damaged_bundles_are_refused(tiny_bundle, tmp_path, damage):
    copy = tmp_path / "b"
    shutil.copytree(tiny_bundle, copy)
    if damage == "missing file":
        (copy / "tokenizer" / "tokenizer.json").unlink()
        expected = "tokenizer/tokenizer.json: missing"
    elif damage == "no manifest":
        (copy / "manifest.json").unlink()
        expected = "no manifest.json"
    else:
        path = copy / "target" / "model.onnx"
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
        expected = "target/model.onnx: sha256 differs"
    with pytest.raises(BundleError, match=expected):
        load_manifest(copy)
    result = CliRunner().invoke(cli, ["inspect", str(copy)])
    assert result.exit_code != 0 and expected in result.output


@pytest.mark.parametrize(
    "stage",
    [
        "pair",
        "export target",
        "quantize target",
        "export draft",
        "quantize draft",
        "time draft",
        "evaluate",
        "tokenizer",
        "manifest",
    ],
)
def test_interrupted_build_leaves_no_bundle(tiny_pair, tmp_path, stage):
    target, draft = tiny_pair
    out = tmp_path / "out"

    def explode(name):
        if name == stage:
            raise KeyboardInterrupt(f"killed at {name}")

    spec = BuildSpec(target=str(target), draft=str(draft), draft_quant="fp32", eval_tokens=EVAL_TOKENS)
    with pytest.raises(KeyboardInterrupt):
        build(spec, out, on_stage=explode)
    assert list(tmp_path.iterdir()) == []  # neither the bundle nor a temporary directory


def test_failed_forced_rebuild_keeps_the_old_bundle(tiny_bundle, tiny_pair, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(tiny_bundle, copy)

    def explode(name):
        if name == "quantize target":
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        build(BuildSpec(target=str(tiny_pair[0]), draft="self"), copy, force=True, on_stage=explode)
    load_manifest(copy)  # still the old, complete bundle


def test_quantized_self_draft_bundle(tiny_pair, tmp_path):
    """int8 target, int4 self-draft: quantization costs a little agreement, reported per engine."""
    out = tmp_path / "q"
    manifest = build(
        BuildSpec(target=str(tiny_pair[0]), draft="self", target_quant="int8", draft_quant="int4", block_size=16), out
    )
    report = manifest.report
    assert report["target"]["top1_agreement_vs_fp32"] >= 0.8
    assert 0.3 <= report["draft"]["top1_agreement_vs_fp32"] <= 1.0
    assert report["draft"]["perplexity"] > 0 and report["target"]["fp32_perplexity"] > 0
    assert manifest.draft.size_bytes < manifest.target.size_bytes
    from runtime.api import SpeculativeGenerator

    generator = SpeculativeGenerator.from_bundle(out, threads=1)
    spec = generator.generate("The quick brown", max_new_tokens=30)
    assert spec.token_ids == generator.generate("The quick brown", max_new_tokens=30, mode="target").token_ids
    ops = _op_types(out / "draft" / "model.onnx")
    assert "MatMulNBits" in ops


def test_self_layers_draft(tiny_pair, tmp_path):
    spec = BuildSpec(target=str(tiny_pair[0]), draft="self:layers=1", draft_quant="fp32", eval_tokens=EVAL_TOKENS)
    manifest = build(spec, tmp_path / "l")
    assert manifest.draft.num_layers == 1 and manifest.target.num_layers == 2


def _op_types(path: Path) -> set[str]:
    import onnx

    return {node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node}


# --- bad input ----------------------------------------------------------------------------------------------------


def run_cli(*args):
    return CliRunner().invoke(cli, list(args))


def test_missing_path(tmp_path):
    result = run_cli("--target", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert result.exit_code != 0 and "no such file or folder" in result.output


def test_not_a_model_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_cli("--target", str(tmp_path / "empty"), "--out", str(tmp_path / "o"))
    assert result.exit_code != 0 and "not a model folder (no config.json)" in result.output


def test_unsupported_architecture(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (folder / "model.safetensors").write_bytes(b"")
    result = run_cli("--target", str(folder), "--out", str(tmp_path / "o"))
    assert result.exit_code != 0
    assert "unsupported architecture 'GPT2LMHeadModel'" in result.output and "LlamaForCausalLM" in result.output


def test_tokenizers_sharing_no_tokens_are_refused(tiny_pair, tmp_path):
    """A draft with another tokenizer pairs only where enough tokens are shared (tests/test_cross_pairing.py)."""
    other = tmp_path / "other"
    make_disjoint_tokenizer(other)
    make_model(other, tiny_config(vocab_size=320), seed=3)
    result = run_cli("--target", str(tiny_pair[0]), "--draft", str(other), "--out", str(tmp_path / "o"))
    assert result.exit_code != 0
    assert "tokenizers differ" in result.output and "target id" in result.output
    assert "share 0 tokens" in result.output
    assert not (tmp_path / "o").exists()


def test_pickled_weights_need_the_flag(tmp_path, tiny_pair):
    folder = tmp_path / "pickled"
    shutil.copytree(tiny_pair[0], folder)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not even loaded")
    result = run_cli("--target", str(folder), "--out", str(tmp_path / "o"))
    assert result.exit_code != 0 and "pickled" in result.output and "--allow-pickle" in result.output


def test_remote_code_needs_the_flag(tmp_path, tiny_pair):
    folder = tmp_path / "remote"
    shutil.copytree(tiny_pair[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Model"}
    (folder / "config.json").write_text(json.dumps(config))
    result = run_cli("--target", str(folder), "--out", str(tmp_path / "o"))
    assert result.exit_code != 0 and "--trust-remote-code" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target-quant", "int3"], "Invalid value for '--target-quant'"),
        (["--k", "0"], "k: expected an integer >= 1, received 0"),
        (["--k", "-2"], "k: expected an integer >= 1"),
    ],
)
def test_out_of_range_options(tiny_pair, tmp_path, args, message):
    result = run_cli("--target", str(tiny_pair[0]), "--out", str(tmp_path / "o"), *args)
    assert result.exit_code != 0 and message in result.output


def test_unknown_quantization_in_a_config_file(tiny_pair, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"target: {tiny_pair[0]}\ndraft_quant: int3\n")
    result = run_cli("--config", str(config), "--out", str(tmp_path / "o"))
    assert result.exit_code != 0 and "draft_quant: expected one of" in result.output


def test_unknown_key_in_a_config_file(tiny_pair, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"target: {tiny_pair[0]}\ntarget_quantization: int8\n")
    result = run_cli("--config", str(config), "--out", str(tmp_path / "o"))
    assert result.exit_code != 0 and "unknown keys ['target_quantization']" in result.output


def test_output_exists(tiny_bundle, tiny_pair):
    result = run_cli("--target", str(tiny_pair[0]), "--out", str(tiny_bundle))
    assert result.exit_code != 0 and "already exists; pass --force" in result.output
    load_manifest(tiny_bundle)


def test_spec_validation_names_field_expected_and_received():
    with pytest.raises(SpecError, match="block_size: expected 16, 32, 64, 128 or 256, received 7"):
        BuildSpec(target="t", block_size=7)


def test_validation_is_strict_frozen_and_collects_every_failure(tiny_bundle):
    """pydantic dataclasses (runtime/bundle.py): no coercion, no assignment, unknown keys refused, and every bad field
    named in one error with what it expected and what it received."""
    import dataclasses

    with pytest.raises(SpecError, match="k: expected a valid integer, received str '4'"):
        BuildSpec(target="t", k="4")
    with pytest.raises(SpecError, match="symmetric: expected a valid boolean, received int 1"):
        BuildSpec(target="t", symmetric=1)
    spec = BuildSpec(target="t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.k = 8
    with pytest.raises(SpecError, match="max_k: expected an integer >= k"):
        dataclasses.replace(spec, k=20)  # replace validates too
    manifest = load_manifest(tiny_bundle)
    with pytest.raises(ValueError, match="input_names: expected a valid tuple, received list"):
        dataclasses.replace(manifest.target, input_names=list(manifest.target.input_names))
    data = json.loads(manifest.to_json())
    data["spec"]["k"] = "4"
    data["target"]["num_layers"] = 2.5
    data["draft"]["role"] = None
    data["eos_token_ids"] = [2, "x"]
    with pytest.raises(BundleError) as caught:
        Manifest.from_json(json.dumps(data))
    message = str(caught.value)
    for expected in (
        "spec.k: expected a valid integer, received str '4'",
        "target.num_layers: expected a valid integer, received float 2.5",
        "draft.role: expected a valid string, received NoneType None",
        "eos_token_ids.1: expected a valid integer, received str 'x'",
    ):
        assert expected in message
    del data["target"]["engine"]
    with pytest.raises(BundleError, match="target.engine: missing"):
        Manifest.from_json(json.dumps(data))


@pytest.mark.parametrize(
    "text, message",
    [
        ("out: 3\n", "out: expected a valid string, received int 3"),
        ("schema_version: 2\n", "schema_version: expected 1, received int 2"),
        ("distill: [1]\n", "distill: expected a valid dictionary"),
        ("k: 4.0\n", "k: expected a valid integer, received float 4.0"),
        ("- a list\n", "must be a YAML mapping"),
    ],
)
def test_presets_are_validated_as_strictly(tiny_pair, tmp_path, text, message):
    config = tmp_path / "c.yaml"
    config.write_text(f"target: {tiny_pair[0]}\n" + text if not text.startswith("-") else text)
    result = run_cli("--config", str(config), "--out", str(tmp_path / "o"))
    assert result.exit_code != 0 and message in result.output, result.output


def test_a_preset_may_state_its_schema_version(tmp_path):
    from runtime.presets import load_preset

    config = tmp_path / "c.yaml"
    config.write_text("schema_version: 1\ntarget: t\nout: b/\n")
    assert load_preset(config) == {"target": "t", "out": "b/"}


def test_cli_json_summary_and_inspect(tiny_pair, tmp_path):
    out = tmp_path / "b"
    result = run_cli(
        "--target",
        str(tiny_pair[0]),
        "--draft",
        "self",
        "--draft-quant",
        "int8",
        "--k",
        "3",
        "--eval-tokens",
        str(EVAL_TOKENS),
        "--out",
        str(out),
        "--json",
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{") :])
    assert summary["default_k"] == 3 and summary["engines"]["draft"]["quant"] == "int8"
    assert 0 <= summary["report"]["draft"]["top1_agreement_vs_fp32"] <= 1
    inspected = run_cli("inspect", str(out))
    assert inspected.exit_code == 0 and "verified" in inspected.output and "OK" in inspected.output
    assert np.isfinite(summary["report"]["target"]["perplexity"])


def test_build_with_triton_repo(tiny_pair, tmp_path):
    pytest.importorskip("tritonclient")
    from triton_repo.pbtxt import parse

    result = run_cli(
        "--target",
        str(tiny_pair[0]),
        "--draft",
        "self",
        "--draft-quant",
        "int8",
        "--eval-tokens",
        str(EVAL_TOKENS),
        "--out",
        str(tmp_path / "b"),
        "--triton-repo",
        str(tmp_path / "repo"),
    )
    assert result.exit_code == 0, result.output
    configs = sorted((tmp_path / "repo").glob("*/config.pbtxt"))
    assert {c.parent.name for c in configs} >= {"ensemble", "preprocessing", "postprocessing"}
    for config in configs:
        assert parse(config.read_text()).name == config.parent.name


def test_no_build_machine_paths_leak_into_the_bundle(tiny_bundle, tiny_pair):
    """Only what the user chose (the source paths in the manifest) may name this machine's folders."""
    import os

    home_markers = [str(Path(__file__).resolve().parents[1]), os.path.expanduser("~"), str(tiny_pair[0].parent)]
    for path in tiny_bundle.rglob("*"):
        if path.is_file() and path.name != "manifest.json":
            data = path.read_bytes()
            for marker in home_markers:
                assert marker.encode() not in data, f"{path.relative_to(tiny_bundle)} contains {marker}"
