"""--kv-cache-dtype fp8: quantize.py's --kv_cache_dtype (engine) and kv_cache_config.dtype (LLM API), with the
paged-context-FMHA guard at plan time (tests/fixtures/trtllm/paged_context_fmha.json) and the KV-cache sizing the
bundle writes. No GPU needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.trtllm import build as trtllm
from builder.trtllm import plan as trtllm_plan
from runtime.bundle import BuildSpec, SpecError

FIXTURES = Path(__file__).parent / "fixtures" / "trtllm"
FMHA = json.loads((FIXTURES / "paged_context_fmha.json").read_text())
QUANTIZE = json.loads((FIXTURES / "quantize.json").read_text())
LLM_ARGS = json.loads((FIXTURES / "llm_args.json").read_text())
INPUTS = trtllm_plan.PlanInputs(
    sources={"target": "/m/t", "draft": "/m/d"},
    architectures={"target": "LlamaForCausalLM", "draft": "LlamaForCausalLM"},
    max_context=2048,
    examples_dir="/app/examples",
)


def spec(**overrides) -> BuildSpec:
    fields = dict(
        target="/m/t",
        draft="/m/d",
        target_quant="fp8",
        draft_quant="w4a8_awq",
        k=3,
        max_k=6,
        backend="tensorrt_llm",
        device="cuda",
        kv_cache_dtype="fp8",
    )
    return BuildSpec(**{**fields, **overrides})


def test_engine_fp8_kv_cache_goes_to_quantize_py():
    steps = trtllm_plan.make_plan(spec(), "engine", INPUTS)
    quantize = [s.argv for s in steps if s.name == "quantize"]
    assert len(quantize) == 2
    for argv in quantize:
        assert argv[argv.index("--kv_cache_dtype") + 1] in QUANTIZE["kv_cache_dtype_choices"]
        assert "--kv_cache_dtype" in QUANTIZE["flags"]


@pytest.mark.parametrize("quant", ["fp16", "bf16", "int8", "int4", "int4_awq", "int8_sq"])
def test_a_format_that_loses_paged_context_fmha_is_refused(quant):
    assert quant not in FMHA["allowed_with_fp8_kv_cache"]
    algo = FMHA["draftsmith_qformat_to_quant_algo"].get(quant)
    assert algo not in FMHA["fp8_context_fmha_quant_algos"]  # builder.py would drop paged context FMHA
    with pytest.raises(SpecError, match="target_quant: expected one of .*paged context FMHA"):
        trtllm_plan.make_plan(spec(target_quant=quant), "engine", INPUTS)


def test_the_allowed_formats_are_exactly_upstreams_fp8_context_fmha_workflows():
    mapping = FMHA["draftsmith_qformat_to_quant_algo"]
    allowed = {q for q, algo in mapping.items() if algo in FMHA["fp8_context_fmha_quant_algos"]}
    assert allowed == set(trtllm_plan.FP8_KV_QUANTS) == set(FMHA["allowed_with_fp8_kv_cache"])


def test_preflight_refuses_fp8_kv_below_sm89(tmp_path):
    with pytest.raises(trtllm.TrtllmError, match="compute capability >= 8.9"):
        trtllm.preflight(spec(), "engine", "1.2.1", 1, str(tmp_path), available=lambda name: True, capability=8.0)
    trtllm.preflight(spec(), "engine", "1.2.1", 1, str(tmp_path), available=lambda name: True, capability=9.0)


def test_llmapi_fp8_kv_cache_and_sizing_in_the_yaml():
    kwargs = trtllm_plan.make_plan(spec(target_quant="fp16", draft_quant="fp16"), "llmapi", INPUTS)[-1].kwargs
    kv = kwargs["kv_cache_config"]
    assert set(kv) <= set(LLM_ARGS["kv_cache_config_fields"]) and "kv_cache_config" in LLM_ARGS["llm_fields"]
    assert kv == {"enable_block_reuse": True, "max_tokens": 8 * 2048, "dtype": "fp8"}


def test_onnxruntime_refuses_a_kv_cache_dtype():
    with pytest.raises(SpecError, match="kv_cache_dtype: expected ''"):
        BuildSpec(target="t", kv_cache_dtype="fp8")
    with pytest.raises(SpecError, match="kv_cache_dtype: expected '' .* or 'fp8'"):
        spec(kv_cache_dtype="int4")


HOSTILE_KV = [
    ({"dtype": "int4"}, "kv_cache_config.dtype: expected one of"),
    ({"use_uvm": True}, "kv_cache_config.use_uvm: not a key a bundle may set"),
    ({"free_gpu_memory_fraction": 3}, "kv_cache_config.free_gpu_memory_fraction: expected a number in"),
    ({"max_tokens": -5}, "kv_cache_config.max_tokens: expected an integer >= 1"),
]


@pytest.mark.parametrize("change,message", HOSTILE_KV)
def test_a_bundles_kv_cache_config_passes_the_allow_list_only(tiny_pair, tmp_path, change, message):
    import yaml

    from runtime.bundle import BundleError, load_manifest
    from runtime.trtllm.llmapi import llm_api_kwargs

    target, draft = tiny_pair
    built = spec(
        target=str(target),
        draft=str(draft),
        target_quant="fp16",
        draft_quant="fp16",
        max_context=128,
        trtllm_flavor="llmapi",
    )
    trtllm.build(
        built,
        tmp_path / "b",
        runner=trtllm.run_step,
        version="1.2.1",
        gpus=1,
        examples_dir=str(tmp_path),
        available=lambda name: True,
    )
    manifest = load_manifest(tmp_path / "b")
    good = llm_api_kwargs(tmp_path / "b", manifest)
    assert good["kv_cache_config"]["dtype"] == "fp8"
    data = yaml.safe_load((tmp_path / "b" / "llm_api.yaml").read_text())
    data["kv_cache_config"].update(change)
    (tmp_path / "b" / "llm_api.yaml").write_text(yaml.safe_dump(data))
    import dataclasses
    import hashlib

    digest = hashlib.sha256((tmp_path / "b" / "llm_api.yaml").read_bytes()).hexdigest()
    forged = dataclasses.replace(manifest, files={**manifest.files, "llm_api.yaml": digest})  # hashes kept consistent
    with pytest.raises(BundleError, match="llm_api.yaml is refused") as err:
        llm_api_kwargs(tmp_path / "b", forged)
    assert message in str(err.value)


def test_cli_dry_run_takes_kv_cache_dtype(tiny_pair):
    from click.testing import CliRunner

    from builder.cli import main

    target, draft = tiny_pair
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
            "--target-quant",
            "fp8",
            "--draft-quant",
            "fp8",
            "--kv-cache-dtype",
            "fp8",
            "--max-context",
            "128",
            "--dry-run",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "--kv_cache_dtype fp8" in result.output
