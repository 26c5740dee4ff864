"""The process-wide ONNX Runtime pool: one global spinning pool by default, sized by the first session; per-session
pools (spinning off) with DRAFTSMITH_ORT_POOL=session. Each case runs in a fresh process (the pool is process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, os, numpy as np
from onnx import TensorProto, helper
from runtime.engines.sessions import make_session
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
threads, sessions = [len(os.listdir("/proc/self/task"))], []
for asked in (2, 3):
    sessions.append(make_session(model, asked))
    threads.append(len(os.listdir("/proc/self/task")))  # the process's native threads: ORT's pools are among them
outs = [s.run(None, {"x": np.array([-1.0, 2.0], np.float32)})[0].tolist() for s in sessions]
print(json.dumps({"threads": threads, "outs": outs}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc")
@pytest.mark.parametrize("mode,shared", [(None, True), ("global", True), ("session", False)])
def test_sessions_share_one_pool_unless_asked_not_to(mode, shared):
    """Two sessions asking 2 then 3 threads: with the shared pool the first one starts the process's pool threads
    and the second, although it asks more, starts none (the pool is the first session's size); with per-session
    pools the second starts its own."""
    env = {k: v for k, v in os.environ.items() if k != "DRAFTSMITH_ORT_POOL"}
    if mode:
        env["DRAFTSMITH_ORT_POOL"] = mode
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    before, first, second = result["threads"]
    assert first > before  # the first session's pool threads
    assert (second == first) if shared else (second > first)
    assert result["outs"] == [[0.0, 2.0], [0.0, 2.0]]  # both run
