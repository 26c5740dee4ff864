"""TensorRT-LLM checkpoint converters per architecture, held to the upstream files recorded in
tests/fixtures/trtllm/converters.json: the right script, only flags its argparse has, its parallelism limits, and a
clear refusal for a family without a converter or a rope scaling without a kernel. No GPU needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.trtllm import plan as trtllm_plan
from builder.trtllm.converters import CONVERTERS, ROPE_SCALING_TYPES, rope_type_of
from runtime.bundle import BuildSpec, SpecError

FACTS = json.loads((Path(__file__).parent / "fixtures" / "trtllm" / "converters.json").read_text())


def plan(architecture: str, quant: str = "fp16", tp: int = 1, pp: int = 1, heads: int = 8, rope: str | None = None):
    spec = BuildSpec(
        target="/m/t",
        draft="/m/d",
        target_quant=quant,
        draft_quant=quant,
        k=2,
        max_k=4,
        backend="tensorrt_llm",
        device="cuda",
        tp_size=tp,
        pp_size=pp,
    )
    inputs = trtllm_plan.PlanInputs(
        sources={"target": "/m/t", "draft": "/m/d"},
        architectures={"target": architecture, "draft": architecture},
        max_context=4096,
        examples_dir="/app/examples",
        heads={"target": heads, "draft": heads},
        rope_types={"target": rope, "draft": rope},
    )
    return trtllm_plan.make_plan(spec, "engine", inputs)


def given_flags(argv: tuple[str, ...], script: dict) -> dict[str, str | None]:
    with_value, out, i = set(script["flags_with_value"]), {}, 2
    while i < len(argv):
        out[argv[i]] = argv[i + 1] if argv[i] in with_value else None
        i += 2 if argv[i] in with_value else 1
    return out


@pytest.mark.parametrize("architecture", sorted(CONVERTERS))
@pytest.mark.parametrize("quant", ["fp16", "int8", "int4"])
def test_each_family_uses_its_own_converter_with_flags_it_has(architecture, quant):
    assert architecture in FACTS["model_map"]["entries"]  # TensorRT-LLM builds this class
    for step in plan(architecture, quant):
        if step.name != "convert":
            continue
        script_key = step.argv[1].split("examples/", 1)[1]
        script = FACTS["scripts"][script_key]
        assert script_key == CONVERTERS[architecture].script
        flags = given_flags(step.argv, script)
        assert set(flags) <= set(script["flags_with_value"]) | set(script["flags_switch"]), step.render()
        assert flags.get("--dtype") in script["dtype_choices"]
        if quant in ("int8", "int4"):
            assert flags["--weight_only_precision"] in script["weight_only_precision"]
        if script_key.endswith("gemma/convert_checkpoint.py"):
            assert flags["--ckpt-type"] in script["ckpt_type_choices"] and "--world-size" in flags


@pytest.mark.parametrize("architecture", sorted(CONVERTERS))
def test_pipeline_parallelism_only_where_the_converter_takes_it(architecture):
    script = FACTS["scripts"][CONVERTERS[architecture].script]
    if script["pipeline_parallel"]:
        assert plan(architecture, pp=2)
    else:
        with pytest.raises(SpecError, match=f"pp_size expected 1 for {architecture}"):
            plan(architecture, pp=2)


def test_a_family_without_a_converter_is_refused_naming_those_that_exist():
    with pytest.raises(SpecError) as err:
        plan("FalconForCausalLM")
    for name in CONVERTERS:
        assert name in str(err.value)


def test_rope_scaling_types_are_those_the_runtime_implements():
    assert set(ROPE_SCALING_TYPES) <= set(FACTS["rotary_scaling"]["supported"])
    assert plan("LlamaForCausalLM", rope="llama3")  # Llama 3.x
    with pytest.raises(SpecError, match="rope scaling TensorRT-LLM implements"):
        plan("LlamaForCausalLM", rope="su-weird")


def test_rope_type_is_read_from_either_config_spelling():
    class Config:
        rope_scaling = {"rope_type": "llama3", "factor": 8.0}

    assert rope_type_of(Config()) == "llama3"
    Config.rope_scaling = {"type": "linear"}
    assert rope_type_of(Config()) == "linear"
    Config.rope_scaling = None
    assert rope_type_of(Config()) is None
