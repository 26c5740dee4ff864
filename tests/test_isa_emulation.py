"""The exactness checks under CPUs this machine is not: AVX2 Intel (Haswell) and AVX2 AMD (EPYC-Rome), emulated by
qemu-user (its TCG runs AVX2 and FMA, not AVX-512, and reports the vendor, which MLAS's kernel choice follows).
A suite run on an AVX-512 machine thereby also shows that an AVX2 machine's tests would pass, and the other way
round. Skipped where qemu-x86_64 is missing (setup.sh installs Debian's qemu-user) or the machine is no x86_64."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

QEMU = shutil.which("qemu-x86_64")
pytestmark = pytest.mark.skipif(
    QEMU is None or platform.machine() != "x86_64",
    reason="needs qemu-user's qemu-x86_64 on an x86_64 machine (apt-get install qemu-user)",
)
CPUS = ["Haswell", "EPYC-Rome"]


@pytest.fixture(scope="module")
def emulated(wide_head_int4, tmp_path_factory):
    """Both emulated CPUs' runs of tests/isa_check.py, started together: each is one single-threaded qemu process of
    minutes, so on a machine of two or more cores the pair takes the time of one. {cpu: (process, stdout, stderr)}."""
    path, info = wide_head_int4
    folder = tmp_path_factory.mktemp("isa")
    described = folder / "info.json"
    described.write_text(
        json.dumps(
            {
                "num_layers": info.num_layers,
                "num_kv_heads": info.num_kv_heads,
                "head_dim": info.head_dim,
                "vocab_size": info.vocab_size,
            }
        )
    )
    script = Path(__file__).with_name("isa_check.py")
    graphs = [str(path.with_name(f"{quant}.onnx")) for quant in ("fp32", "int8", "int4")]
    runs = {}
    for cpu in CPUS:
        out, err = folder / f"{cpu}.out", folder / f"{cpu}.err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            process = subprocess.Popen(
                [QEMU, "-cpu", cpu, sys.executable, str(script), str(described), *graphs],
                stdout=stdout,
                stderr=stderr,
                # qemu-user shows the host's /proc/cpuinfo, which keys the kept points: keep none
                env={**os.environ, "DRAFTSMITH_CACHE_DIR": "off"},
            )
        runs[cpu] = (process, out, err)
    yield runs
    for process, _, _ in runs.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("cpu", CPUS)
def test_the_exactness_checks_hold_on_an_emulated_avx2_cpu(cpu, emulated):
    process, out, err = emulated[cpu]
    try:
        returncode = process.wait(timeout=900)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert returncode == 0, err.read_text(errors="replace")[-3000:]
    result = json.loads(out.read_text().strip().splitlines()[-1])
    assert result["failures"] == [], (cpu, result)
