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


@pytest.mark.parametrize("cpu", ["Haswell", "EPYC-Rome"])
def test_the_exactness_checks_hold_on_an_emulated_avx2_cpu(cpu, wide_head_int4, tmp_path):
    path, info = wide_head_int4
    described = tmp_path / "info.json"
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
    done = subprocess.run(
        [QEMU, "-cpu", cpu, sys.executable, str(script), str(described), *graphs],
        capture_output=True,
        text=True,
        timeout=900,
        # qemu-user shows the host's /proc/cpuinfo, which keys the kept points: keep none
        env={**os.environ, "DRAFTSMITH_CACHE_DIR": "off"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failures"] == [], (cpu, result)
