"""The process-wide ONNX Runtime pool: one global spinning pool by default, sized by the first session; per-session
pools (spinning off) with DRAFTSMITH_ORT_POOL=session. Each case runs in a fresh process (the pool is process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, numpy as np
from onnx import TensorProto, helper
from runtime.engines.sessions import make_session, pool_threads
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
outs = [make_session(model, threads).run(None, {"x": np.array([-1.0, 2.0], np.float32)})[0].tolist()
        for threads in (2, 1)]
print(json.dumps({"pool": pool_threads(), "outs": outs}))
"""


@pytest.mark.parametrize("mode,pool", [(None, 2), ("global", 2), ("session", None)])
def test_sessions_share_one_pool_unless_asked_not_to(mode, pool):
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
    assert result == {"pool": pool, "outs": [[0.0, 2.0], [0.0, 2.0]]}  # the first session sized it; both run
