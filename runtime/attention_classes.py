"""Where GroupQueryAttention's CPU arithmetic changes with a call's length, so that a verify call scores each token
exactly as target-only decoding does.

A row's scores q·k are one SGEMM with K = head dim and N = the row's total length (its ``seqlens_k`` + 1). MLAS's SGEMM
(onnxruntime/core/mlas/lib/sgemm.cpp, ``MlasSgemmOperation``; onnxruntime 1.32) sums K in passes of ``StrideK`` = 128,
widened when N is small, and adds each pass into the output: with head dim <= 128 a dot product is one pass at every
length, above it the number of passes, so the rounding of every score, changes at some totals (head dim 256: 64,
320, 576, ...; 512: 32, 64, 160, 192, ...; 192: 64, 401). A token scored in a call whose total lies across such a
point from the total target-only decoding gives it is ~1e-7 off, and int8 activation rounding grows that to ~0.2 of a
logit over Gemma 3 270M's 18 layers: enough to flip a near tie (tests/test_attention_classes.py).

The points are measured here, not derived from MLAS's rules: one GroupQueryAttention node with the engine's head dim
scores the same query at totals t and t + 1 for every t up to the context, and a point is a t where the two differ.
Within two consecutive points every total gives bit-identical results (the test checks it).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

SINGLE_PASS_HEAD_DIM = 128  # MLAS_SGEMM_STRIDEK on x64 and arm64: up to it, a score is one pass at every length


ATTENTION_ATTRIBUTES = ("num_heads", "kv_num_heads", "do_rotary", "rotary_interleaved", "local_window_size", "scale",
                        "softcap")
SEEDS = (0,)  # random data: the draw that showed every point of the Gemma 3 settings (a second added none)


def attention_settings(proto) -> tuple[tuple, ...]:
    """The distinct GroupQueryAttention attribute sets of a graph, as sorted (name, value) pairs."""
    from onnx import helper
    found = set()
    for node in proto.graph.node:
        if node.op_type == "GroupQueryAttention":
            found.add(tuple(sorted((a.name, helper.get_attribute_value(a)) for a in node.attribute
                                   if a.name in ATTENTION_ATTRIBUTES)))
    return tuple(sorted(found))


@lru_cache(maxsize=8)
def class_points(settings: tuple[tuple, ...], head_dim: int, max_total: int) -> tuple[int, ...]:
    """Totals t (2 <= t <= max_total) at which some layer scores a query with total t + 1 otherwise than with t."""
    if head_dim <= SINGLE_PASS_HEAD_DIM:
        return ()
    return tuple(sorted({t for attributes in settings for seed in SEEDS
                         for t in _measure(dict(attributes), head_dim, max_total, seed)}))


def _measure(attributes: dict, head_dim: int, max_total: int, seed: int) -> list[int]:
    import onnxruntime as ort

    from runtime.sessions import make_session
    heads, kv_heads = int(attributes.get("num_heads", 1)), int(attributes.get("kv_num_heads", 1))
    session = make_session(_probe_model(attributes, head_dim, max_total + 3))  # the points do not follow threads
    rng = np.random.default_rng(seed)
    slots = max_total + 3
    past_key = rng.standard_normal((1, kv_heads, slots, head_dim)).astype(np.float32)
    past_value = rng.standard_normal((1, kv_heads, slots, head_dim)).astype(np.float32)
    query = rng.standard_normal((1, 3, heads * head_dim)).astype(np.float32)
    new = rng.standard_normal((1, 3, kv_heads * head_dim)).astype(np.float32)
    binding = session.io_binding()
    binding.bind_output("output", "cpu")  # first: get_outputs()[0]
    for name, buffer in (("past_key", past_key), ("past_value", past_value)):
        value = ort.OrtValue.ortvalue_from_numpy(buffer)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(name.replace("past", "present"), value)
    points = []
    for total in range(2, max_total + 1):
        first, second = (_score(session, binding, query, new, total - 2, width) for width in (2, 3))
        if not np.array_equal(first, second):
            points.append(total)
    return points


def _score(session, binding, query, new, past: int, width: int) -> np.ndarray:
    """The output of the first of ``width`` new tokens after ``past`` slots (past and present share the buffers, as
    in runtime.engine.FusedEngine)."""
    binding.bind_cpu_input("query", np.ascontiguousarray(query[:, :width]))
    binding.bind_cpu_input("key", np.ascontiguousarray(new[:, :width]))
    binding.bind_cpu_input("value", np.ascontiguousarray(new[:, :width]))
    binding.bind_cpu_input("seqlens_k", np.array([past + width - 1], np.int32))
    binding.bind_cpu_input("total_sequence_length", np.array(past + width, np.int32))
    binding.bind_output("output", "cpu")  # rebound: its shape follows the width
    session.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()[0, 0].copy()


def _probe_model(attributes: dict, head_dim: int, positions: int) -> bytes:
    """One GroupQueryAttention node with the graph's attributes (rotary tables of base 10000 where it rotates)."""
    from onnx import TensorProto, helper, numpy_helper
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    tables = []
    if attributes.get("do_rotary"):
        angles = np.arange(positions)[:, None] * (10000.0 ** (-np.arange(0, head_dim, 2) / head_dim))[None]
        tables = [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
                  numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")]
        names += ["cos", "sin"]
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                            domain="com.microsoft", **attributes)
    f = TensorProto.FLOAT
    heads, kv_heads = int(attributes.get("num_heads", 1)), int(attributes.get("kv_num_heads", 1))
    inputs = [helper.make_tensor_value_info("query", f, [1, "s", heads * head_dim])]
    inputs += [helper.make_tensor_value_info(n, f, [1, "s", kv_heads * head_dim]) for n in ("key", "value")]
    inputs += [helper.make_tensor_value_info(n, f, [1, kv_heads, "t", head_dim]) for n in ("past_key", "past_value")]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
               helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("output", "present_key", "present_value")]
    model = helper.make_model(helper.make_graph([node], "probe", inputs, outputs, tables),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return model.SerializeToString()
