"""Conformance: every generated plan and Triton config satisfies the upstream interface recorded in
tests/fixtures/trtllm/ (what each upstream model reads, what the BLS requests, what trtllm-build refuses, which
decoding_type spellings each release line accepts). No GPU and no TensorRT-LLM needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc")

from builder.trtllm import plan as trtllm_plan  # noqa: E402
from runtime.bundle import BuildSpec  # noqa: E402
from triton_repo.trtllm import layouts  # noqa: E402
from triton_repo.trtllm.llmapi_layout import LlmApiLayout, llmapi_repo_files  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "trtllm"
IBL = json.loads((FIXTURES / "inflight_batcher_llm.json").read_text())
LLMAPI = json.loads((FIXTURES / "llmapi.json").read_text())
BUILD = json.loads((FIXTURES / "trtllm_build.json").read_text())
DECODING = json.loads((FIXTURES / "decoding_types.json").read_text())
QUANTIZE = json.loads((FIXTURES / "quantize.json").read_text())

LAYOUT = layouts.EngineLayout("/b/target/engine", "/b/draft/engine", "/b/tokenizer", max_batch_size=4)
INPUTS = trtllm_plan.PlanInputs(
    sources={"target": "/m/t", "draft": "/m/d"},
    architectures={"target": "LlamaForCausalLM", "draft": "LlamaForCausalLM"},
    max_context=2048,
    examples_dir="/x/examples",
)


@pytest.fixture(scope="module")
def engine_repo():
    """Model name -> parsed ModelConfig of the recorded-interface engine repository."""
    return {c.name: c for c in layouts.parse_all(layouts.engine_repo_files(LAYOUT)).values()}


def names(tensors) -> set[str]:
    return {t.name for t in tensors}


# --- the engine-era repository against what each upstream model reads -------------------------------------------


@pytest.mark.parametrize("model", ["preprocessing", "postprocessing"])
def test_every_parameter_a_model_indexes_is_declared(engine_repo, model):
    declared = set(engine_repo[model].parameters)
    assert set(IBL[model]["parameters_required"]) <= declared, IBL[model]["sources"]


@pytest.mark.parametrize("model", ["preprocessing", "postprocessing"])
def test_every_io_config_a_model_looks_up_is_declared(engine_repo, model):
    config = engine_repo[model]
    assert set(IBL[model]["output_configs_looked_up"]) <= names(config.output)
    assert set(IBL[model].get("input_configs_looked_up", [])) <= names(config.input)
    assert set(IBL[model].get("outputs_emitted", IBL[model].get("outputs_emitted_text_only", []))) <= names(
        config.output
    )


def test_postprocessing_declares_only_the_inputs_it_accepts(engine_repo):
    # its execute() raises for any other input tensor, so an optional extra input is a trap for clients
    assert names(engine_repo["postprocessing"].input) == set(IBL["postprocessing"]["inputs_accepted"])


@pytest.mark.parametrize("callee", ["preprocessing", "tensorrt_llm", "postprocessing"])
def test_every_output_the_bls_requests_exists(engine_repo, callee):
    request = IBL["tensorrt_llm_bls"]["requests"][callee]
    targets = ["tensorrt_llm", "tensorrt_llm_draft"] if callee == "tensorrt_llm" else [callee]
    for model in targets:
        assert set(request["outputs_requested"]) - names(engine_repo[model].output) == set(), model
        assert set(request["inputs_sent"]) - names(engine_repo[model].input) == set(), model


def test_bls_declares_what_it_reads_and_emits_and_names_both_engines(engine_repo):
    bls = engine_repo["tensorrt_llm_bls"]
    assert set(IBL["tensorrt_llm_bls"]["inputs_read"]) - names(bls.input) == set()
    assert set(IBL["tensorrt_llm_bls"]["outputs_emitted"]) - names(bls.output) == set()
    assert bls.parameters["tensorrt_llm_model_name"].string_value == "tensorrt_llm"
    assert bls.parameters["tensorrt_llm_draft_model_name"].string_value == "tensorrt_llm_draft"


@pytest.mark.parametrize("model", ["tensorrt_llm", "tensorrt_llm_draft"])
def test_tensorrt_llm_inputs_use_the_current_names_types_and_reshapes(engine_repo, model):
    facts = IBL["tensorrt_llm"]
    inputs = {t.name: t for t in engine_repo[model].input}
    assert not set(facts["removed_input_names"]) & set(inputs), "min_length/random_seed were renamed"
    from tritonclient.grpc import model_config_pb2

    for name, kind in facts["input_types"].items():
        assert model_config_pb2.DataType.Name(inputs[name].data_type) == kind, name
    for name in facts["scalar_inputs_with_reshape"]:
        assert inputs[name].HasField("reshape") and list(inputs[name].reshape.shape) == [], name
    assert set(engine_repo[model].parameters) <= set(facts["parameter_keys"])


def test_every_model_runs_on_the_instance_kind_upstream_uses(engine_repo):
    from tritonclient.grpc import model_config_pb2

    for model in ("preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls"):
        kinds = {model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind) for g in engine_repo[model].instance_group}
        assert kinds == {IBL[model]["instance_kind"]}, model


def test_filling_uses_only_placeholders_upstream_templates_have():
    for model, values in layouts._template_values(LAYOUT).items():
        folder = "tensorrt_llm" if model == "tensorrt_llm_draft" else model
        if folder in IBL:
            assert set(values) <= set(IBL[folder]["template_placeholders"]), model


# --- the LLM-API repository against all_models/llmapi ------------------------------------------------------------


@pytest.fixture(scope="module")
def llmapi_files():
    kwargs = trtllm_plan.llm_api_kwargs(
        BuildSpec(
            target="/m/t",
            draft="/m/d",
            target_quant="fp16",
            draft_quant="fp16",
            k=3,
            max_k=6,
            backend="tensorrt_llm",
            device="cuda",
        ),
        2048,
    )
    kwargs["speculative_config"]["speculative_model"] = "/b/draft/hf"
    return llmapi_repo_files(LlmApiLayout(kwargs, max_batch_size=4))


def test_llmapi_config_leaves_batching_to_model_yaml_and_declares_the_model_io(llmapi_files):
    import yaml
    from tritonclient.grpc import model_config_pb2

    (config,) = layouts.parse_all(llmapi_files).values()
    assert config.max_batch_size == 0 and not config.HasField("model_transaction_policy")
    assert {model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind) for g in config.instance_group} == {
        LLMAPI["instance_kind"]
    }
    assert set(LLMAPI["inputs_read"]) - names(config.input) == set()
    assert set(LLMAPI["outputs_emitted"]) - names(config.output) == set()
    model = yaml.safe_load(llmapi_files["tensorrt_llm/1/model.yaml"])
    assert set(LLMAPI["triton_config_required"]) <= set(model["triton_config"])
    assert model["triton_config"]["max_batch_size"] == 0  # model.py refuses a batched text_input
    assert not set(LLMAPI["model_yaml_code_loading_keys"]) & set(model)


@pytest.mark.parametrize("line", ["1.x", "main"])
def test_decoding_type_is_spelled_as_each_release_line_accepts(llmapi_files, line):
    import yaml

    facts = DECODING["releases"][line]
    accepted = facts.get("from_dict_accepts") or facts["yaml_accepts"]
    speculative = yaml.safe_load(llmapi_files["tensorrt_llm/1/model.yaml"])["speculative_config"]
    assert speculative["decoding_type"] in accepted
    assert DECODING["draft_model_key_accepted_by_every_release_line"] in speculative
    plan_kwargs = trtllm_plan.llm_api_kwargs(
        BuildSpec(
            target="t", draft="d", target_quant="fp16", draft_quant="fp16", backend="tensorrt_llm", device="cuda"
        ),
        512,
    )
    assert plan_kwargs["speculative_config"]["decoding_type"] in accepted


# --- build plans against trtllm-build's and quantize.py's argument checks -----------------------------------------

PLAN_CASES = [(quant, tp) for quant in trtllm_plan.FLAVOR_QUANTS["engine"] for tp in (1, 2)]


def flags_and_values(argv: tuple[str, ...], with_value: set[str]) -> dict[str, str | None]:
    out, i = {}, 0
    while i < len(argv):
        if argv[i] in with_value:
            out[argv[i]] = argv[i + 1]
            i += 2
        else:
            out[argv[i]] = None
            i += 1
    return out


def build_problems(argv: tuple[str, ...]) -> list[str]:
    """What trtllm-build (build.py) would refuse or warn about in ``argv``."""
    with_value, switches = set(BUILD["flags_with_value"]), set(BUILD["flags_switch"])
    given = flags_and_values(argv[1:], with_value)
    problems = [f"unknown flag {flag}" for flag in given if flag not in with_value | switches]
    problems += [
        f"{flag} {given[flag]} not in {choices}"
        for flag, choices in BUILD["choices"].items()
        if flag in given and given[flag] not in choices
    ]
    draft_len = int(given.get("--max_draft_len") or 0)
    for rule in BUILD["refused"]:
        if all(flag in given for flag in rule["when_all"]) and draft_len > 0:
            problems.append(rule["error"])
    problems += [f"deprecated {flag}" for flag in BUILD["deprecated"] if flag in given]
    return problems


def test_the_checker_catches_what_build_py_refuses():
    assert build_problems(("trtllm-build", "--max_draft_len", "4", "--gather_context_logits")) == [
        "Gather context logits is not support with draft len > 0"
    ]
    assert build_problems(("trtllm-build", "--speculative_decoding_mode", "draft_target")) != []


@pytest.mark.parametrize("quant,tp", PLAN_CASES)
def test_no_plan_passes_flags_trtllm_build_rejects(quant, tp):
    spec = BuildSpec(
        target="/m/t",
        draft="/m/d",
        target_quant=quant,
        draft_quant=quant,
        k=4,
        max_k=8,
        backend="tensorrt_llm",
        device="cuda",
        tp_size=tp,
    )
    for step in trtllm_plan.make_plan(spec, "engine", INPUTS):
        if step.name == "build":
            assert build_problems(step.argv) == [], step.render()


@pytest.mark.parametrize("quant", trtllm_plan.QFORMATS)
def test_quantize_steps_use_known_flags_and_a_local_calibration_set(quant):
    spec = BuildSpec(
        target="/m/t", draft="/m/d", target_quant=quant, draft_quant=quant, backend="tensorrt_llm", device="cuda"
    )
    for step in trtllm_plan.make_plan(spec, "engine", INPUTS):
        if step.name == "quantize":
            given = flags_and_values(step.argv[2:], set(QUANTIZE["flags"]))
            assert set(given) <= set(QUANTIZE["flags"]), step.render()
            assert given["--qformat"] in QUANTIZE["qformat_choices"]
            dataset = given["--calib_dataset"]
            assert dataset != QUANTIZE["calib_dataset_default"]
            # a local directory, and no name quantize_by_modelopt would send to the hub instead
            assert not any(word in dataset.lower() for word in ("cnn_dailymail", "scienceqa", "science_qa", "pileval"))


# --- placement, KV-cache sizing and model.yaml keys against the recorded interface ---------------------------------

LLM_ARGS = json.loads((FIXTURES / "llm_args.json").read_text())


@pytest.mark.parametrize("nodes", [1, 2])
def test_placed_layouts_fill_only_placeholders_and_parameters_upstream_has(nodes):
    from triton_repo.trtllm.launch import placement

    layout = layouts.EngineLayout.placed(
        "/b/t", "/b/d", "/b/tok", placement(2, num_nodes=nodes), max_tokens_in_paged_kv_cache=4096
    )
    values = layouts._template_values(layout)
    for model in ("tensorrt_llm", "tensorrt_llm_draft"):
        assert set(values[model]) <= set(IBL["tensorrt_llm"]["template_placeholders"]), model
    for config in layouts.engine_configs(layout).values():
        if config["name"].startswith("tensorrt_llm") and config["name"] != "tensorrt_llm_bls":
            assert set(config["parameters"]) <= set(IBL["tensorrt_llm"]["parameter_keys"]), config["name"]
            assert config["parameters"]["enable_kv_cache_reuse"]["string_value"] == "true"


def test_model_yaml_sets_only_llm_fields_and_kv_cache_fields_upstream_has(llmapi_files):
    import yaml

    model = yaml.safe_load(llmapi_files["tensorrt_llm/1/model.yaml"])
    assert set(model) - {"triton_config"} <= set(LLM_ARGS["llm_fields"])
    assert set(model["kv_cache_config"]) <= set(LLM_ARGS["kv_cache_config_fields"])
    assert model["kv_cache_config"]["enable_block_reuse"] is True
