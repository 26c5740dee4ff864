"""Draftsmith's CausalAttention (runtime/engines/gguf_ops/src/attention.cpp): GroupQueryAttention's results, and for a
query the same bits whatever call it comes in — alone, among the queries of a verify call, or in a row of a batch —
which is what lets a target of Draftsmith's operators decode exactly without padding; bad shapes and attributes are
refused, never read past."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engines import gguf_ops
from runtime.engines.sessions import make_session

pytestmark = pytest.mark.skipif(not gguf_ops.available(), reason=f"{gguf_ops.unavailable_reason()}")

H, G, D, T = 6, 2, 64, 96  # query heads, kv heads, head dim, cache slots


def _session(op: str, **attributes):
    from onnx import TensorProto as TP
    from onnx import helper

    names = ["qkv", "pk", "pv", "seqlens_k", "total", "cos", "sin", "ql"]
    types = [TP.FLOAT] * 3 + [TP.INT32, TP.INT32, TP.FLOAT, TP.FLOAT, TP.INT32]
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, types)]
    outputs = [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("y", "k", "v")]
    settings = dict(num_heads=H, kv_num_heads=G, do_rotary=1, local_window_size=-1) | attributes
    if op == "gqa":
        wired = ["qkv", "", "", "pk", "pv", "seqlens_k", "total", "cos", "sin"] + [""] * 7 + ["ql"]
        node = helper.make_node("GroupQueryAttention", wired, ["y", "k", "v"], domain="com.microsoft", **settings)
        domain = "com.microsoft"
    else:
        node = helper.make_node(gguf_ops.ATTENTION, names, ["y", "k", "v"], domain=gguf_ops.DOMAIN, **settings)
        domain = gguf_ops.DOMAIN
    graph = helper.make_graph([node], "attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(domain, 1)])
    model.ir_version = 9
    return make_session(model.SerializeToString())  # the process's pool (a default session fails once it exists)


RNG = np.random.default_rng(0)
COS = np.cos(np.arange(T)[:, None] * 0.1 ** np.arange(D // 2)[None]).astype(np.float32)
SIN = np.sin(np.arange(T)[:, None] * 0.1 ** np.arange(D // 2)[None]).astype(np.float32)


def _run(session, qkv, keys, values, past, queries):
    """One call: rows b take queries[b] new tokens after past[b] cached ones."""
    feeds = {
        "qkv": qkv,
        "pk": keys.copy(),
        "pv": values.copy(),
        "seqlens_k": (np.asarray(past) + np.asarray(queries) - 1).astype(np.int32),
        "total": np.array(int(max(p + q for p, q in zip(past, queries))), np.int32),
        "cos": COS,
        "sin": SIN,
        "ql": np.asarray(queries, np.int32),
    }
    return session.run(None, feeds)


def _inputs(batch: int, new: int):
    qkv = RNG.standard_normal((batch, new, (H + 2 * G) * D)).astype(np.float32)
    cache = RNG.standard_normal((2, batch, G, T, D)).astype(np.float32)
    return qkv, cache[0], cache[1]


@pytest.mark.parametrize("window", [-1, 8])
def test_it_computes_what_group_query_attention_computes(window):
    qkv, keys, values = _inputs(2, 5)
    past, queries = [40, 17], [5, 3]
    ours = _run(_session("own", local_window_size=window), qkv, keys, values, past, queries)
    theirs = _run(_session("gqa", local_window_size=window), qkv, keys, values, past, queries)
    for b, (p, q) in enumerate(zip(past, queries)):
        assert np.abs(ours[0][b, :q] - theirs[0][b, :q]).max() <= 1e-5 * np.abs(theirs[0][b, :q]).max()
        assert np.allclose(ours[1][b, :, : p + q], theirs[1][b, :, : p + q], atol=1e-5)  # the keys written, rotated
        assert np.array_equal(ours[2][b, :, : p + q], theirs[2][b, :, : p + q])  # the values as they came
        assert not ours[0][b, q:].any()  # a row's padding positions stay zero


def test_a_query_gets_the_same_bits_alone_in_a_verify_call_and_in_a_batch():
    session = _session("own")
    qkv, keys, values = _inputs(1, 7)
    whole = _run(session, qkv, keys, values, [30], [7])[0]
    one_by_one, k, v = [], keys, values
    for j in range(7):
        y, k, v = _run(session, qkv[:, j : j + 1], k, v, [30 + j], [1])
        one_by_one.append(y)
    assert np.array_equal(np.concatenate(one_by_one, axis=1), whole)
    other_qkv, other_keys, other_values = _inputs(1, 7)
    batched = _run(
        session,
        np.concatenate([other_qkv, qkv]),
        np.concatenate([other_keys, keys]),
        np.concatenate([other_values, values]),
        [11, 30],
        [4, 7],
    )[0]
    assert np.array_equal(batched[1:], whole)


@pytest.mark.parametrize(
    "past, queries",
    [([90], [7]), ([-3], [2]), ([10], [9]), ([10], [-1])],
    ids=["past-the-cache", "negative-past", "more-than-the-call", "negative-queries"],
)
def test_rows_outside_their_call_or_cache_are_refused(past, queries):
    qkv, keys, values = _inputs(1, 7)
    with pytest.raises(Exception, match="CausalAttention"):
        _run(_session("own"), qkv, keys, values, past, queries)


@pytest.mark.parametrize(
    "attributes",
    [{"num_heads": 5}, {"do_rotary": 2}, {"do_rotary": 1.0}, {"scale": -1.0}, {"local_window_size": 2.5}],
    ids=["heads-do-not-group", "rotary-2", "rotary-float", "negative-scale", "window-float"],
)
def test_bad_attributes_are_refused_by_the_library_and_the_graph_check(attributes):
    from onnx import helper

    from runtime.bundle import BundleError
    from runtime.engines import onnx_checks

    with pytest.raises(Exception, match="CausalAttention"):
        _session("own", **attributes)
    node = helper.make_node(
        gguf_ops.ATTENTION,
        ["qkv", "pk", "pv", "seqlens_k"],
        ["y", "k", "v"],
        domain=gguf_ops.DOMAIN,
        name="a",
        **(dict(num_heads=H, kv_num_heads=G) | attributes),
    )
    model = helper.make_model(helper.make_graph([node], "g", [], []))
    with pytest.raises(BundleError, match="CausalAttention"):
        onnx_checks.check_operators(model, "crafted.onnx")
