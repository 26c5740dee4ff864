"""scripts/gpu_check.sh on a machine without what it needs: one clear SKIP line per step, and exit status 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def run_check(tmp_path: Path, fake_gpu: bool) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(sys.executable, bin_dir / "python")
    for tool in ("bash", "dirname", "timeout", "mkdir", "seq", "sleep"):
        if shutil.which(tool):
            os.symlink(shutil.which(tool), bin_dir / tool)
    if fake_gpu:  # a driver that lists one GPU; nothing else of the GPU stack is here
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stand-in (UUID: GPU-0)'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {
        "PATH": str(bin_dir),
        "OUT": str(tmp_path / "out"),
        "HOME": str(tmp_path),
        "PYTHONPATH": str(SCRIPT.parents[1]),
    }
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    result = run_check(tmp_path, fake_gpu=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "SKIP everything: no NVIDIA GPU visible" in result.stdout


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_each_missing_part_gets_its_own_skip_line(tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("checks the messages shown when tensorrt_llm is absent")
    result = run_check(tmp_path, fake_gpu=True)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "SKIP TensorRT-LLM: tensorrt_llm is not installed" in result.stdout
    assert "SKIP onnxruntime-cuda: onnxruntime has no CUDAExecutionProvider" in result.stdout


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_the_driver_runs_its_steps_in_order_and_fails_a_crashed_step(tmp_path):
    """A stand-in GPU and tensorrt_llm package metadata (no module): the llmapi build runs (it needs no GPU code),
    the greedy step crashes importing tensorrt_llm and fails the run, and what cannot run is named."""
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("checks the stand-in path")
    site = tmp_path / "site" / "tensorrt_llm-1.2.1.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: 1.2.1\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stand-in (UUID: GPU-0)'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
        "OUT": str(tmp_path / "out"),
        "HOME": str(tmp_path),
        "PYTHONPATH": str(tmp_path / "site"),
        "BUDGET_S": "300",
        "SMOLLM2_GGUF": str(tmp_path / "absent.gguf"),
        "PYTHON": sys.executable,
    }
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=400)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    order = [
        "== preflight",
        "SKIP engine flavor: trtllm-build is not on PATH",
        "== pairs",
        "SKIP SmolLM2 steps",
        "== build llmapi tiny",
        "== greedy llmapi tiny",
        "FAIL greedy llmapi tiny",
        "SKIP triton llmapi tiny: tritonserver is not here",
        "SKIP multi-node launches",
    ]
    positions = [out.index(line) for line in order]
    assert positions == sorted(positions), out
    assert (tmp_path / "out" / "llmapi-tiny" / "llm_api.yaml").is_file()
