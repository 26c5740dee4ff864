"""More than one GPU: TP=2 plans and repositories for the tiny pair and the SmolLM2 pair, checked against the launch
interface recorded from upstream (tests/fixtures/trtllm/launch_triton_server.json, converters.json,
model_runner_cpp.json): world_size, device ids, participant ids, the launch command. No GPU needed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fakes import fake_gpu_runner

pytest.importorskip("tritonclient.grpc")

from builder.trtllm import build as trtllm  # noqa: E402
from builder.trtllm import plan as trtllm_plan
from runtime.bundle import BuildSpec, BundleError, SpecError  # noqa: E402
from triton_repo.trtllm import launch  # noqa: E402
from triton_repo.trtllm import layouts  # noqa: E402
from triton_repo.pbtxt import ConfigError  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "trtllm"
LAUNCH = json.loads((FIXTURES / "launch_triton_server.json").read_text())
RUNNER = json.loads((FIXTURES / "model_runner_cpp.json").read_text())
# SmolLM2-135M's config (FACTS.md: 30 layers, hidden 576, 9 query / 3 KV heads); the test suite's tiny pair (4 heads).
PAIRS = {
    "smollm2": {"architecture": "LlamaForCausalLM", "heads": 9, "context": 8192},
    "tiny": {"architecture": "LlamaForCausalLM", "heads": 4, "context": 256},
}


def inputs(pair: str) -> trtllm_plan.PlanInputs:
    facts = PAIRS[pair]
    return trtllm_plan.PlanInputs(
        sources={"target": f"/m/{pair}", "draft": f"/m/{pair}"},
        architectures={"target": facts["architecture"], "draft": facts["architecture"]},
        max_context=facts["context"],
        examples_dir="/app/examples",
        heads={"target": facts["heads"], "draft": facts["heads"]},
    )


def spec(**overrides) -> BuildSpec:
    fields = dict(
        target="/m/t",
        draft="self",
        target_quant="fp16",
        draft_quant="int8",
        k=3,
        max_k=6,
        backend="tensorrt_llm",
        device="cuda",
        max_context=256,
    )
    return BuildSpec(**{**fields, **overrides})


def launch_problems(args: list[str], configs: dict, world: int) -> list[str]:
    """What launch_triton_server.py and the tensorrtllm backend would refuse in ``args`` + the two model configs."""
    known = set(LAUNCH["flags_with_value"]) | set(LAUNCH["flags_switch"])
    given = {a.split("=")[0]: (a.split("=", 1)[1] if "=" in a else None) for a in args}
    problems = [f"unknown flag {flag}" for flag in given if flag not in known]
    world_size = int(given.get("--world_size") or 1)
    params = {
        name: {k: v["string_value"] for k, v in configs[name]["parameters"].items()}
        for name in ("tensorrt_llm", "tensorrt_llm_draft")
    }
    if "--multi-model" in given and "--disable-spawn-processes" not in given and world_size != 1:
        problems.append("--multi-model without --disable-spawn-processes needs --world_size 1")
    if "--disable-spawn-processes" in given:
        ranks = [int(r) for p in params.values() for r in p.get("participant_ids", "").split(",") if r]
        if not all(p.get("participant_ids") for p in params.values()):
            problems.append("participant IDs missing with spawning disabled")
        if 0 in ranks or len(set(ranks)) != len(ranks) or world_size != 1 + len(ranks):
            problems.append(f"ranks {ranks} do not fill world_size {world_size} after the orchestrator's rank 0")
    else:
        for name, p in params.items():
            ids = p.get("gpu_device_ids", "").split(",")
            if len(ids) != world:
                problems.append(f"{name}: {len(ids)} device ids for {world} ranks")
    return problems


# --- plans ------------------------------------------------------------------------------------------------------------


def test_tiny_pair_tp2_plan_carries_tp_to_every_command():
    steps = trtllm_plan.make_plan(spec(tp_size=2), "engine", inputs("tiny"))
    converts = [s.argv for s in steps if s.name == "convert"]
    assert len(converts) == 2 and all(a[a.index("--tp_size") + 1] == "2" for a in converts)
    kwargs = trtllm_plan.make_plan(spec(tp_size=2, draft_quant="fp16"), "llmapi", inputs("tiny"))[-1].kwargs
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["pipeline_parallel_size"] == 1


def test_smollm2_tp2_is_refused_with_the_tp_sizes_its_9_heads_allow():
    with pytest.raises(SpecError, match=r"divisor of the 9 attention heads \[1, 3, 9\].*received 2"):
        trtllm_plan.make_plan(spec(tp_size=2), "engine", inputs("smollm2"))
    steps = trtllm_plan.make_plan(spec(tp_size=3, max_context=2048), "engine", inputs("smollm2"))
    assert {s.argv[s.argv.index("--tp_size") + 1] for s in steps if s.name == "convert"} == {"3"}


# --- repositories -----------------------------------------------------------------------------------------------------


def _tp2_bundle(flavor: str, tiny_pair, factory) -> Path:
    target, draft = tiny_pair
    built = spec(
        target=str(target), draft=str(draft), draft_quant="fp16", max_context=128, tp_size=2, trtllm_flavor=flavor
    )
    out = factory.mktemp(f"tp2-{flavor}") / "bundle"
    trtllm.build(
        built,
        out,
        runner=fake_gpu_runner,
        version="1.2.1",
        gpus=2,
        examples_dir=str(out.parent),
        available=lambda name: True,
    )
    return out


@pytest.fixture(scope="module")
def engine_tp2(tiny_pair, tmp_path_factory):
    return _tp2_bundle("engine", tiny_pair, tmp_path_factory)


@pytest.fixture(scope="module")
def llmapi_tp2(tiny_pair, tmp_path_factory):
    return _tp2_bundle("llmapi", tiny_pair, tmp_path_factory)


def engine_configs(files: dict) -> dict:
    from google.protobuf import json_format

    return {
        c.name: json_format.MessageToDict(c, preserving_proto_field_name=True)
        for c in layouts.parse_all(files).values()
    }


def launch_args(files: dict) -> list[str]:
    line = next(line for line in files["launch.sh"].splitlines() if line.startswith("exec python3"))
    return [a.replace('"', "") for a in line.split()[3:-1]]


def test_tp2_engine_repository_on_one_node(engine_tp2):
    files = layouts.repo_for_bundle(engine_tp2, target_devices=[0, 1], draft_devices=[2, 3])
    configs = engine_configs(files)
    assert configs["tensorrt_llm"]["parameters"]["gpu_device_ids"]["string_value"] == "0,1"
    assert configs["tensorrt_llm_draft"]["parameters"]["gpu_device_ids"]["string_value"] == "2,3"
    args = launch_args(files)
    assert args[:3] == ["--model_repo=$REPO", "--multi-model", "--world_size=1"]
    assert launch_problems(args, configs, world=2) == []
    assert "launch_triton_server.py --model_repo=REPO --multi-model --world_size=1" in files["README.md"]


def test_tp2_engine_repository_across_nodes(engine_tp2):
    files = layouts.repo_for_bundle(engine_tp2, num_nodes=2)
    configs = engine_configs(files)
    draft, target = (configs[m]["parameters"] for m in ("tensorrt_llm_draft", "tensorrt_llm"))
    assert draft["participant_ids"]["string_value"] == "1,2" and target["participant_ids"]["string_value"] == "3,4"
    assert target["num_nodes"]["string_value"] == "2" and "gpu_device_ids" not in target
    args = launch_args(files)
    assert "--disable-spawn-processes" in args and "--world_size=5" in args
    assert launch_problems(args, configs, world=2) == []


def test_the_launch_checker_catches_what_upstream_refuses(engine_tp2):
    files = layouts.repo_for_bundle(engine_tp2)
    configs = engine_configs(files)
    assert launch_problems(["--model_repo=r", "--multi-model", "--world_size=2"], configs, 2) != []
    assert launch_problems(
        ["--model_repo=r", "--multi-model", "--disable-spawn-processes", "--world_size=5"], configs, 2
    ) == [
        "participant IDs missing with spawning disabled",
        "ranks [] do not fill world_size 5 after the orchestrator's rank 0",
    ]
    assert launch_problems(["--model_repo=r", "--multi-model", "--world_size=1"], configs, 4) != []


def test_tp2_llmapi_repository_and_launch(llmapi_tp2):
    import yaml

    files = layouts.repo_for_bundle(llmapi_tp2)
    model = yaml.safe_load(files["tensorrt_llm/1/model.yaml"])
    assert model["tensor_parallel_size"] == 2 and model["kv_cache_config"]["enable_block_reuse"] is True
    assert launch_args(files) == [
        "--model_repo=$REPO",
        "--http_port=8000",
        "--grpc_port=8001",
        "--metrics_port=8002",
    ]  # one rank: the LLM starts its own TP workers
    across = launch_args(layouts.repo_for_bundle(llmapi_tp2, num_nodes=2))
    assert "--world_size=2" in across and "--trtllm_llmapi_launch" in across  # one MPI process per model rank
    assert {a.split("=")[0] for a in across} <= set(LAUNCH["flags_with_value"]) | set(LAUNCH["flags_switch"])


def test_smollm2_tp3_engine_repository(tmp_path):
    placed = launch.placement(3, target_devices=[0, 1, 2], draft_devices=[3, 4, 5])
    layout = layouts.EngineLayout.placed("/b/target/engine", "/b/draft/engine", "/b/tokenizer", placed)
    configs = {name: config for name, config in layouts.engine_configs(layout).items()}
    assert launch_problems(launch.engine_launch_args("/b/repo", placed), configs, world=3) == []
    with pytest.raises(ConfigError, match="expected 3 GPU ids"):
        launch.placement(3, target_devices=[0, 1], draft_devices=[3, 4])


def test_device_lists_are_validated():
    with pytest.raises(ConfigError, match="distinct GPU ids"):
        launch.placement(2, target_devices=[0, 0])
    with pytest.raises(ConfigError, match="draft_devices: expected 2 ids"):
        launch.Placement((0, 1), (2,))


# --- the in-process runtime ----------------------------------------------------------------------------------------


def test_tp2_engine_bundle_opens_both_runners_on_their_devices(engine_tp2, monkeypatch):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_trtllm_mismatches import FakeRunner, install_fake_trtllm

    install_fake_trtllm(monkeypatch)
    from runtime.trtllm.engine import open_generator

    open_generator(engine_tp2, target_devices=[0, 1], draft_devices=[2, 3])
    devices = {Path(c["engine_dir"]).parent.name: c["device_ids"] for c in FakeRunner.calls}
    assert devices == {"target": [0, 1], "draft": [2, 3]}
    assert all(c["is_orchestrator_mode"] is True for c in FakeRunner.calls)
    assert len(devices["target"]) == 2  # RUNNER["dtm_device_list_rule"]: one id per rank of the engine
    with pytest.raises(BundleError, match="expected 2 distinct GPU ids"):
        open_generator(engine_tp2, target_devices=[0])
    assert RUNNER["dtm_device_list_rule"]


def test_launch_sh_runs_the_launcher_it_finds_with_the_repository_path(engine_tp2, tmp_path):
    import shutil
    import subprocess

    if shutil.which("python3") is None:
        pytest.skip("launch.sh runs python3")
    repo = layouts.write_trtllm_repository(engine_tp2, tmp_path / "repo with space")
    fake = tmp_path / "launch_triton_server.py"
    fake.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    result = subprocess.run(
        ["bash", str(repo / "launch.sh"), "--log"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "TRTLLM_LAUNCH_SCRIPT": str(fake)},
    )
    assert result.returncode == 0, result.stderr
    args = json.loads(result.stdout)
    assert args[0] == f"--model_repo={repo.resolve()}" and args[1:3] == ["--multi-model", "--world_size=1"]
    assert args[-1] == "--log"  # extra arguments pass through
    if not any(Path(path).exists() for path in launch.LAUNCH_SCRIPTS):  # outside NVIDIA's images
        missing = subprocess.run(
            ["bash", str(repo / "launch.sh")], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}
        )
        assert missing.returncode == 2 and "launch_triton_server.py not found" in missing.stderr
