"""TensorRT-LLM build plans (golden), validation, flavor choice and the fail-fast preflight. No GPU needed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fakes import fake_gpu_runner

from builder.trtllm import build as trtllm
from builder.trtllm import plan as trtllm_plan
from runtime.bundle import BuildSpec, SpecError, load_manifest

GOLDEN = Path(__file__).parent / "golden" / "trtllm"
INPUTS = trtllm_plan.PlanInputs(
    sources={"target": "/models/target", "draft": "/models/draft"},
    architectures={"target": "LlamaForCausalLM", "draft": "LlamaForCausalLM"},
    max_context=2048,
    examples_dir="/opt/TensorRT-LLM/examples",
)
CASES = [(flavor, quant) for flavor in trtllm_plan.FLAVORS for quant in trtllm_plan.FLAVOR_QUANTS[flavor]]


def trt_spec(**overrides) -> BuildSpec:
    fields = dict(
        target="/models/target",
        draft="/models/draft",
        target_quant="fp16",
        draft_quant="int4_awq",
        k=4,
        max_k=8,
        backend="tensorrt_llm",
        device="cuda",
    )
    return BuildSpec(**{**fields, **overrides})


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text, encoding="utf-8")
    assert path.is_file(), f"missing golden file {path}; run with UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text(encoding="utf-8"), f"plan differs from {path} (UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("flavor,quant", CASES)
def test_plan_golden_for_every_quant_and_flavor(flavor, quant):
    spec = trt_spec(target_quant=quant, draft_quant=quant)
    steps = trtllm_plan.make_plan(spec, flavor, INPUTS)
    text = trtllm_plan.render_plan(steps, flavor) + "\n" + trtllm_plan.plan_json(steps, flavor) + "\n"
    check_golden(f"{flavor}-{quant}.txt", text)


@pytest.mark.parametrize("flavor", trtllm_plan.FLAVORS)
def test_plan_golden_multi_gpu_and_lengths(flavor):
    spec = trt_spec(tp_size=2, pp_size=2, max_batch_size=16, max_input_len=1024, max_seq_len=1536, k=6, max_k=10)
    steps = trtllm_plan.make_plan(spec, flavor, INPUTS)
    check_golden(f"{flavor}-tp2-pp2.txt", trtllm_plan.render_plan(steps, flavor))


def test_engine_plan_configures_speculative_decoding_on_the_target_only():
    steps = trtllm_plan.make_plan(trt_spec(k=3, max_k=5), "engine", INPUTS)
    builds = {s.role: s.argv for s in steps if s.name == "build"}
    target, draft = builds["target"], builds["draft"]
    assert target[target.index("--speculative_decoding_mode") + 1] == "draft_tokens_external"
    assert target[target.index("--max_draft_len") + 1] == "5"  # max_k >= k
    assert "--speculative_decoding_mode" not in draft and "--max_draft_len" not in draft
    for argv in (target, draft):
        assert argv[argv.index("--use_paged_context_fmha") + 1] == "enable"
        # build.py refuses --gather_context_logits with a draft length > 0; --gather_generation_logits is deprecated
        assert not [flag for flag in argv if flag.startswith("--gather_")]


@pytest.mark.parametrize("quant", trtllm_plan.QFORMATS)
def test_quantized_engine_plan_calibrates_offline_on_shipped_text(quant, tmp_path):
    steps = trtllm_plan.make_plan(trt_spec(target_quant=quant, draft_quant="fp16"), "engine", INPUTS)
    assert steps[0].name == "calibration"
    argv = next(s.argv for s in steps if s.name == "quantize")
    assert argv[argv.index("--calib_dataset") + 1] == trtllm_plan.CALIB_DIR  # not the hub default cnn_dailymail
    trtllm.run_step(steps[0], tmp_path)
    lines = (tmp_path / trtllm_plan.CALIB_DIR / trtllm_plan.CALIB_FILE).read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    assert len(texts) == int(argv[argv.index("--calib_size") + 1]) >= 32 and all(t.strip() for t in texts)


def test_unquantized_engine_plan_needs_no_calibration():
    steps = trtllm_plan.make_plan(trt_spec(target_quant="fp16", draft_quant="int8"), "engine", INPUTS)
    assert "calibration" not in [s.name for s in steps]


def test_weight_only_uses_convert_checkpoint_and_modelopt_formats_use_quantize_py():
    steps = trtllm_plan.make_plan(trt_spec(target_quant="int8", draft_quant="w4a8_awq"), "engine", INPUTS)
    first = {s.role: s for s in steps if s.name in ("convert", "quantize")}
    assert first["target"].argv[1].endswith("models/core/llama/convert_checkpoint.py")
    assert first["target"].argv[-3:] == ("--use_weight_only", "--weight_only_precision", "int8")
    assert first["draft"].argv[1].endswith("quantization/quantize.py")
    assert first["draft"].argv[first["draft"].argv.index("--qformat") + 1] == "w4a8_awq"


def test_llmapi_plan_records_draft_target_config():
    steps = trtllm_plan.make_plan(trt_spec(k=2, max_k=6), "llmapi", INPUTS)
    llm = steps[-1]
    assert llm.call == "tensorrt_llm.LLM"
    assert llm.kwargs["speculative_config"] == {
        "decoding_type": "DraftTarget",
        "max_draft_len": 6,
        "speculative_model": "draft/hf",
    }
    assert llm.kwargs["disable_overlap_scheduler"] is True
    assert [s.kwargs.get("quant_cfg") for s in steps[:2]] == ["INT4_AWQ_CFG", None]  # draft int4_awq, target fp16


# --- validation ------------------------------------------------------------------------------------------------------


def test_k_above_max_draft_len_is_refused():
    with pytest.raises(SpecError, match=r"max_k: expected an integer >= k \(9\), received 8"):
        trt_spec(k=9, max_k=8)


@pytest.mark.parametrize("quant", ["int8", "int4", "int8_sq"])
def test_quant_unsupported_by_llmapi_flavor(quant):
    with pytest.raises(
        SpecError, match=f"draft_quant: expected one of .* for TensorRT-LLM flavor 'llmapi', received '{quant}'"
    ):
        trtllm_plan.make_plan(trt_spec(draft_quant=quant), "llmapi", INPUTS)


def test_trtllm_formats_refused_by_onnxruntime_and_fp32_by_tensorrt_llm():
    with pytest.raises(SpecError, match="target_quant: expected one of .* for backend onnxruntime"):
        BuildSpec(target="t", target_quant="int4_awq")
    with pytest.raises(SpecError, match="target_quant: expected one of .* for backend tensorrt_llm"):
        trt_spec(target_quant="fp32")


def test_gpu_only_options_on_cpu_are_refused():
    with pytest.raises(SpecError, match="device: expected 'cuda' for backend tensorrt_llm"):
        trt_spec(device="cpu")
    with pytest.raises(SpecError, match="tp_size: expected 1: it applies to backend tensorrt_llm only"):
        BuildSpec(target="t", tp_size=2)
    with pytest.raises(SpecError, match="trtllm_flavor: expected '': it applies"):
        BuildSpec(target="t", trtllm_flavor="engine")


def test_lengths_must_fit_the_pair():
    with pytest.raises(SpecError, match=r"max_seq_len: expected <= the pair's usable context \(2048\)"):
        trtllm_plan.make_plan(trt_spec(max_seq_len=4096), "engine", INPUTS)
    with pytest.raises(SpecError, match="max_input_len: expected < max_seq_len"):
        trt_spec(max_input_len=512, max_seq_len=512)


def test_truncated_self_draft_is_onnx_only():
    with pytest.raises(SpecError, match="a truncated self-draft is an ONNX-only option"):
        trtllm_plan.make_plan(trt_spec(draft="self:layers=1"), "engine", INPUTS)


@pytest.mark.parametrize(
    "version,flavor",
    [
        ("0.21.0", "engine"),
        ("1.2.1", "engine"),
        ("1.3.0rc20", "engine"),
        ("1.3.0rc21", "llmapi"),
        ("1.4.0rc4", "llmapi"),
        (None, "llmapi"),
    ],
)
def test_flavor_follows_the_installed_version(version, flavor):
    assert trtllm.resolve_flavor(trt_spec(), version) == flavor
    assert trtllm.resolve_flavor(trt_spec(trtllm_flavor="engine"), version) == "engine"  # asked for wins


# --- fail fast -------------------------------------------------------------------------------------------------------


def test_real_build_without_gpu_or_tensorrt_llm_fails_fast(tmp_path):
    # The checkpoint does not exist: the preflight must fail before anything looks at it.
    spec = trt_spec(target=str(tmp_path / "no-such-model"), draft="self")
    with pytest.raises(trtllm.TrtllmError) as err:
        trtllm.build(spec, tmp_path / "bundle", version=None, gpus=0, examples_dir=str(tmp_path))
    message = str(err.value)
    assert "pip install 'draftsmith[tensorrt]'" in message
    assert "no NVIDIA GPU is visible" in message
    assert not (tmp_path / "bundle").exists() and not list(tmp_path.glob(".bundle*"))


def test_engine_flavor_on_a_release_without_trtllm_build_fails_fast(tmp_path):
    spec = trt_spec(target=str(tmp_path / "missing"), trtllm_flavor="engine")
    with pytest.raises(trtllm.TrtllmError, match="no TensorRT engine backend .* use --trtllm-flavor llmapi"):
        trtllm.build(spec, tmp_path / "b", version="1.3.0rc21", gpus=1, examples_dir=str(tmp_path))


def test_missing_tools_are_all_named_at_once(tmp_path):
    spec = trt_spec(target=str(tmp_path / "missing"), trtllm_flavor="engine")
    with pytest.raises(trtllm.TrtllmError) as err:
        trtllm.build(
            spec,
            tmp_path / "b",
            version="1.2.1",
            gpus=1,
            examples_dir=str(tmp_path / "none"),
            available=lambda name: False,
        )
    assert "trtllm-build is not on PATH" in str(err.value) and "set TRTLLM_EXAMPLES=" in str(err.value)


def test_more_parallel_ranks_than_gpus_fails_fast(tmp_path):
    spec = trt_spec(target=str(tmp_path / "missing"), tp_size=4, trtllm_flavor="llmapi")
    with pytest.raises(trtllm.TrtllmError, match="tp_size x pp_size = 4 GPUs per engine, but 1 visible"):
        trtllm.build(spec, tmp_path / "b", version="1.4.0rc4", gpus=1, examples_dir=str(tmp_path))


# --- the pipeline, with the GPU steps replaced -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "flavor,quants",
    [
        ("engine", ("int8", "int4")),
        ("engine", ("fp8", "int4_awq")),
        ("llmapi", ("fp16", "fp16")),
        ("llmapi", ("fp8", "int4_awq")),
    ],
)
def test_build_writes_a_verified_bundle_with_the_plan(tiny_pair, tmp_path, flavor, quants):
    target, draft = tiny_pair
    spec = trt_spec(
        target=str(target),
        draft=str(draft),
        target_quant=quants[0],
        draft_quant=quants[1],
        max_context=128,
        trtllm_flavor=flavor,
    )
    stages = []
    manifest = trtllm.build(
        spec,
        tmp_path / "bundle",
        runner=fake_gpu_runner,
        version="1.2.1",
        gpus=1,
        examples_dir=str(tmp_path),
        on_stage=stages.append,
        available=lambda name: True,
    )
    loaded = load_manifest(tmp_path / "bundle")  # every file hashed and verified
    assert loaded == manifest
    assert loaded.spec.backend == "tensorrt_llm" and loaded.spec.trtllm_flavor == flavor
    plan = loaded.report["trtllm"]["plan"]
    assert [s["role"] for s in plan][-1] == ("target" if flavor == "engine" else "bundle")
    assert loaded.max_context == 128 and (tmp_path / "bundle" / "tokenizer" / "tokenizer.json").is_file()
    assert not (tmp_path / "bundle" / "_work").exists()
    if flavor == "llmapi":
        import yaml

        kwargs = yaml.safe_load((tmp_path / "bundle" / "llm_api.yaml").read_text())
        assert kwargs["speculative_config"]["max_draft_len"] == 8
    if quants == ("fp16", "fp16"):  # really copied on CPU
        assert list((tmp_path / "bundle" / "target" / "hf").glob("*.safetensors"))


def test_build_applies_the_onnx_pair_checks(tiny_pair, tmp_path):
    from builder.pairing import PairingError

    target, draft = tiny_pair
    spec = trt_spec(target=str(target), draft=str(draft), max_context=100_000, trtllm_flavor="engine")
    with pytest.raises(PairingError, match="exceeds the pair's usable maximum"):
        trtllm.build(
            spec,
            tmp_path / "b",
            runner=fake_gpu_runner,
            version="1.2.1",
            gpus=1,
            examples_dir=str(tmp_path),
            available=lambda name: True,
        )


def test_cli_dry_run_prints_the_plan(tiny_pair, monkeypatch):
    from click.testing import CliRunner

    from builder.cli import main

    target, draft = tiny_pair
    monkeypatch.setenv("TRTLLM_EXAMPLES", "/opt/TensorRT-LLM/examples")
    result = CliRunner().invoke(
        main,
        [
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--backend",
            "tensorrt_llm",
            "--trtllm-flavor",
            "engine",
            "--draft-quant",
            "int4",
            "--k",
            "3",
            "--max-context",
            "128",
            "--dry-run",
        ],
    )
    assert result.exit_code == 0, result.output
    text = result.output.replace(str(target), "TARGET").replace(str(draft), "DRAFT")
    check_golden("cli-dry-run-engine.txt", text)


def test_cli_dry_run_reports_validation_errors(tiny_pair):
    from click.testing import CliRunner

    from builder.cli import main

    target, _ = tiny_pair
    result = CliRunner().invoke(
        main,
        [
            "--target",
            str(target),
            "--backend",
            "tensorrt_llm",
            "--trtllm-flavor",
            "llmapi",
            "--target-quant",
            "int8_sq",
            "--dry-run",
        ],
    )
    assert result.exit_code != 0
    assert "target_quant: expected one of" in result.output and "'llmapi'" in result.output
