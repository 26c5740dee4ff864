"""Each mismatch a second reading against upstream found, pinned by its fixture in tests/fixtures/trtllm/.

Every test here failed on the code before the fix: block reuse could be turned off for the target, the BLS request
had no ``stream``, the runners opened in leader mode without device ids, the executor was read as ``runner.session``
only, container paths knew one image layout, and scripts/gpu_check.sh needed the network and had no dry run.
No GPU and no TensorRT-LLM needed: a stand-in ``tensorrt_llm`` module records what the adapter passes.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from triton_repo.pbtxt import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "trtllm"
ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = [ROOT / "scripts" / name for name in ("gpu_check.sh", "gpu_check.py", "gpu_check_tasks.py")]


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


class FakeRunner:
    """ModelRunnerCpp.from_dir stand-in: records its keywords; holds an executor as the stored version names it."""

    calls: list[dict] = []

    def __init__(self, executor):
        self.executor = executor

    @classmethod
    def from_dir(cls, **kwargs):
        cls.calls.append(kwargs)
        return cls(FakeExecutor())


class FakeExecutor:
    """Answers every request with its draft tokens (all accepted) plus token 7, or 7s up to max_tokens."""

    def __init__(self):
        self.pending = []

    def enqueue_requests(self, requests):
        self.pending = requests
        return list(range(len(requests)))

    def await_responses(self):
        responses = []
        for i, request in enumerate(self.pending):
            draft = request.external_draft_tokens_config.tokens if request.external_draft_tokens_config else []
            tokens = (list(draft) + [7])[: request.max_tokens] if draft else [7] * request.max_tokens
            result = types.SimpleNamespace(is_final=True, output_token_ids=[tokens])
            responses.append(types.SimpleNamespace(has_error=lambda: False, result=result, request_id=i))
        return responses


@pytest.fixture
def fake_trtllm(monkeypatch):
    return install_fake_trtllm(monkeypatch)


SAMPLING = fixture("sampling_params.json")


class FakeSamplingParams:
    """``tensorrt_llm.SamplingParams`` as upstream defines it (sampling_params.json): keyword-only, only its fields
    (anything else is a TypeError, as from the dataclass), checked as the later release's ``_validate`` checks them.
    ``greedy`` is whether both releases decode the values greedily, and it refuses values they decode apart
    (temperature alone: sampled in the later one, greedy in 1.0.0rc4's C++ runtime)."""

    def __init__(self, *args, **fields):
        if args:
            raise TypeError("SamplingParams.__init__() takes keyword arguments only (kw_only=True)")
        unknown = sorted(set(fields) - set(SAMPLING["sampling_params_fields"]))
        if unknown:
            raise TypeError(f"SamplingParams.__init__() got an unexpected keyword argument {unknown[0]!r}")
        for name in SAMPLING["sampling_params_fields"]:
            setattr(self, name, fields.get(name))
        self.max_tokens = fields.get("max_tokens", SAMPLING["max_tokens_default"])
        self.given = fields
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")

    @property
    def greedy(self) -> bool:
        t, p, k = self.temperature, self.top_p, self.top_k
        later = (t is None and p is None and k is None) or k == 1 or p == 0.0 or t == 0
        rc4 = ((k or 0) == 0 and (p or 0.0) == 0.0) or k == 1  # the runtime's defaults, regularizeTopKTopP
        if later != rc4:
            raise ValueError(f"the pinned releases decode {self.given} apart: greedy {rc4} in 1.0.0rc4, {later} later")
        return later


def executor_sampling_config(beam_width: int = 1, **keywords):
    """``bindings.executor.SamplingConfig``: beam_width, then its keyword-only arguments by upstream's names."""
    unknown = sorted(set(keywords) - set(SAMPLING["executor_sampling_config_keywords"]))
    if unknown:
        raise TypeError(f"SamplingConfig(): incompatible function arguments: {unknown}")
    return types.SimpleNamespace(beam_width=beam_width, **keywords)


def install_fake_trtllm(monkeypatch):
    """A tensorrt_llm stand-in: SamplingParams, runtime.ModelRunnerCpp and bindings.executor's request types."""
    FakeRunner.calls = []
    package = types.ModuleType("tensorrt_llm")
    package.SamplingParams = FakeSamplingParams
    runtime = types.ModuleType("tensorrt_llm.runtime")
    runtime.ModelRunnerCpp = FakeRunner
    bindings = types.ModuleType("tensorrt_llm.bindings")
    executor = types.ModuleType("tensorrt_llm.bindings.executor")
    executor.Request = lambda **kw: types.SimpleNamespace(**kw)
    executor.SamplingConfig = executor_sampling_config
    executor.OutputConfig = lambda **kw: types.SimpleNamespace(**kw)
    executor.ExternalDraftTokensConfig = lambda tokens: types.SimpleNamespace(tokens=list(tokens))
    package.runtime, package.bindings, bindings.executor = runtime, bindings, executor
    for name, module in {
        "tensorrt_llm": package,
        "tensorrt_llm.runtime": runtime,
        "tensorrt_llm.bindings": bindings,
        "tensorrt_llm.bindings.executor": executor,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    return FakeRunner


# --- 1. the target runs with KV-cache block reuse on ----------------------------------------------------------------


def test_target_block_reuse_cannot_be_turned_off_anywhere(fake_trtllm, tmp_path):
    from runtime.trtllm.engine import open_generator, open_runner
    from triton_repo.trtllm import layouts

    facts = fixture("batch_manager.json")["draft_tokens_external_requires"]
    assert facts["kv_cache_enable_block_reuse"] is True
    with pytest.raises(ConfigError, match=facts["error"]):
        layouts.EngineLayout("/t", "/d", "/tok", enable_kv_cache_reuse=False)
    configs = layouts.engine_configs(layouts.EngineLayout("/t", "/d", "/tok"))
    for model in ("tensorrt_llm", "tensorrt_llm_draft"):
        assert configs[model]["parameters"]["enable_kv_cache_reuse"] == {"string_value": "true"}
    open_runner(tmp_path)
    assert fake_trtllm.calls[-1]["kv_cache_enable_block_reuse"] is True
    assert "block_reuse" not in inspect.signature(open_generator).parameters  # no way to open a target without it
    for path in GPU_CHECK:
        text = path.read_text()
        assert "block_reuse=False" not in text and 'enable_kv_cache_reuse": False' not in text, path


# --- 2. the speculative BLS request carries stream --------------------------------------------------------------------


def test_speculative_bls_request_carries_stream_false():
    from triton_repo.trtllm.launch import bls_request

    facts = fixture("bls_decode.json")
    body = bls_request("hi", 16, num_draft_tokens=3)
    assert set(facts["required_with_num_draft_tokens"]) <= set(body)
    assert body["stream"] is facts["stream_value_with_num_draft_tokens"]
    assert set(body) <= set(facts["upstream_example_body"])  # only inputs upstream's own example sends
    tasks = (ROOT / "scripts" / "gpu_check_tasks.py").read_text()
    assert "bls_request(" in tasks and '"num_draft_tokens":' not in tasks  # no hand-written body left


# --- 3. engines open in orchestrator mode with device ids; Triton starts through the launcher ----------------------


def test_runners_open_as_upstreams_draft_target_runner_does(fake_trtllm, tmp_path):
    from runtime.trtllm.engine import open_runner

    facts = fixture("model_runner_cpp.json")
    open_runner(tmp_path, 4, devices=[2, 3])
    kwargs = fake_trtllm.calls[-1]
    assert set(kwargs) <= set(facts["from_dir_keywords"])
    assert kwargs["is_orchestrator_mode"] is facts["dtm_runner_keywords"]["is_orchestrator_mode"]
    assert kwargs["device_ids"] == [2, 3] and kwargs["max_batch_size"] == 4


def test_two_tensorrt_llm_models_start_in_orchestrator_mode():
    from triton_repo.trtllm.launch import engine_launch_args, placement

    facts = fixture("launch_triton_server.json")
    args = engine_launch_args("/repo", placement(1))
    assert "--multi-model" in args and "--world_size=1" in args  # the draft-target guide's launch
    flags = {a.split("=")[0] for a in args}
    assert flags <= set(facts["flags_with_value"]) | set(facts["flags_switch"])
    assert all(a in args for a in facts["draft_target_guide_launch"] if "TRITON_MODEL_REPO" not in a and a != "--log")


# --- 4. the runner's executor attribute ------------------------------------------------------------------------------


def test_executor_session_reads_runner_executor(fake_trtllm):
    from runtime.trtllm.engine import ExecutorSession

    facts = fixture("model_runner_cpp.json")
    runner = FakeRunner(FakeExecutor())
    assert hasattr(runner, facts["executor_attribute"]) and not hasattr(runner, "session")
    session = ExecutorSession(runner, end_id=2, pad_id=2)
    assert session.generate([[1, 2, 3], [4]], [3, 2], drafts=[[5, 6], []]) == [[5, 6, 7], [7, 7]]
    old = types.SimpleNamespace(session=FakeExecutor())  # older releases: runner.session
    assert ExecutorSession(old, end_id=2, pad_id=2).generate([[1]], [1]) == [[7]]


# --- 5. container paths: both NVIDIA image layouts --------------------------------------------------------------------


@pytest.mark.parametrize("image", ["tensorrt_llm release", "tritonserver trtllm-python-py3"])
def test_examples_models_and_launcher_are_found_in_either_image(image, tmp_path, monkeypatch):
    from runtime.trtllm import paths as trtllm_paths

    for name in ("TRTLLM_EXAMPLES", "TRTLLM_TRITON_MODELS", "TRTLLM_LAUNCH_SCRIPT"):
        monkeypatch.delenv(name, raising=False)
    layout = fixture("container_layouts.json")[image]
    for kind in ("examples", "triton_models", "launch_script"):
        target = tmp_path / layout[kind].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.mkdir() if kind != "launch_script" else target.write_text("#")
    for kind in ("examples", "triton_models", "launch_script"):
        assert trtllm_paths.find(kind, root=tmp_path) == layout[kind], kind
    from triton_repo.trtllm.launch import LAUNCH_SCRIPTS, launch_script

    assert layout["launch_script"] in LAUNCH_SCRIPTS and layout["launch_script"] in launch_script(["--model_repo=x"])


def test_no_single_image_path_is_hard_coded_in_the_gpu_check():
    for path in GPU_CHECK:
        text = path.read_text()
        assert "/app/tensorrt_llm/examples" not in text and "triton_backend/all_models" not in text, path


# --- 6. gpu_check.sh: offline, every step with its limit, a dry run -------------------------------------------------


def test_gpu_check_needs_no_network():
    for path in GPU_CHECK:
        text = path.read_text()
        for banned in ("pip install", "git clone", "huggingface.co", "hf_hub_download", "snapshot_download"):
            assert banned not in text, (path, banned)
    assert '"HF_HUB_OFFLINE": "1"' in GPU_CHECK[1].read_text()


def test_gpu_check_dry_run_lists_every_step_with_its_limit_and_exits_0():
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    result = subprocess.run(["bash", str(GPU_CHECK[0]), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for name, limit, _, _ in gpu_check.STEPS:
        assert f"{name:24s} limit {limit:3d} s" in result.stdout, name
    assert gpu_check.BUDGET_S <= 480  # the whole run fits in 8 minutes
    assert "never run by this script" in result.stdout and "multi-node" in result.stdout
    tiny_build = dict((s[0], s[1]) for s in gpu_check.STEPS)["build engine tiny"]
    assert tiny_build >= 120  # four processes (two converts, two trtllm-build runs); 60 s was too little


def test_greedy_comparison_reports_the_first_divergence(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check_tasks as tasks

    assert tasks.first_divergence([1, 2, 3], [1, 2, 4]) == 2 and tasks.first_divergence([1], [1]) is None
    assert tasks.first_divergence([1, 2], [1]) == 1
    rows = [types.SimpleNamespace(token_ids=ids) for ids in ([1, 2, 3], [4, 5], [6], [7])]
    other = [types.SimpleNamespace(token_ids=ids) for ids in ([1, 2, 9], [4, 5], [6], [7])]
    monkeypatch.setattr(tasks, "generate_both", lambda bundle, n: (rows, other))
    assert tasks.greedy("b", "8", "report") == 0  # a random tiny pair may part on a near-tie: reported
    assert "first divergence at token 2" in capsys.readouterr().out
    assert tasks.greedy("b", "8", "strict") == 1  # SmolLM2: any divergence fails
