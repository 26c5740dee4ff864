"""The GGUF operator library (runtime/engines/gguf_ops) against crafted nodes: attributes of every wrong kind
(values, types, sizes that overflow int64 arithmetic, layouts, ids) and weights fed at run time that do not match.
Each is a clean error -- at session creation for what the attributes say, at run time for what the inputs hold --
never an allocation without bound or a read past a tensor; the graph check (onnx_checks.check_operators) refuses the
same attributes before the library sees them. tests/test_gguf_ops_sanitized.py runs this file again against the
library built with AddressSanitizer and UBSan."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from runtime.bundle import BundleError
from runtime.engines import gguf_ops, onnx_checks
from runtime.engines.sessions import make_session

pytestmark = pytest.mark.skipif(not gguf_ops.available(), reason=f"{gguf_ops.unavailable_reason()}")

Q4_K, Q8_0 = gguf_ops.GGML_TYPE_IDS["Q4_K"], gguf_ops.GGML_TYPE_IDS["Q8_0"]
MATMUL = dict(K=256, types=[Q4_K], rows=[16])  # a Q4_K part of 16 rows: weight uint8 [16, 144]
GATHER = dict(K=256, type=Q4_K)
INT64_MAX = 2**63 - 1


def _model(op: str, attributes: dict, reads: list[str], inputs: list, initializers: list):
    """A graph of one ``op`` node reading ``reads`` (names among ``inputs`` and ``initializers``), output rank 2."""
    node = helper.make_node(op, reads, ["y"], domain=gguf_ops.DOMAIN, **attributes)
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["d0", "d1"])
    model = helper.make_model(
        helper.make_graph([node], "crafted", inputs, [output], initializers),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(gguf_ops.DOMAIN, 1)],
    )
    model.ir_version = 9
    return model


def _weights(names: list[str], fed: bool) -> tuple[list, list]:
    """(inputs, initializers) for uint8 weights ``names``: zero Q4_K [16, 144] initializers, or inputs of any shape
    where ``fed``."""
    if fed:
        return [helper.make_tensor_value_info(n, TensorProto.UINT8, ["n", "b"]) for n in names], []
    return [], [numpy_helper.from_array(np.zeros((16, 144), np.uint8), n) for n in names]


def _matmul(attributes: dict, parts: int = 1, fed: bool = False):
    """A GgufMatMul of ``attributes`` over ``parts`` weights, x float [m, k]."""
    names = [f"w{p}" for p in range(parts)]
    inputs, initializers = _weights(names, fed)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", "k"])
    return _model(gguf_ops.OP, attributes, ["x", *names], [x, *inputs], initializers)


def _gather(attributes: dict, fed: bool = False):
    """A GgufGather of ``attributes`` over a table of 16 Q4_K rows, ids int64 [s]."""
    inputs, initializers = _weights(["w"], fed)
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["s"])
    return _model(gguf_ops.GATHER, attributes, ["w", "ids"], [*inputs, ids], initializers)


def _refused_at_creation(model, message: str) -> None:
    with pytest.raises(Exception, match=message):
        make_session(model.SerializeToString(), 1)


# (change to MATMUL's attributes, what the library's refusal says); None for an attribute removed
MATMUL_CASES = {
    "K-zero": ({"K": 0}, "K must be a positive multiple of 32"),
    "K-negative": ({"K": -256}, "K must be a positive multiple of 32"),
    "K-not-32s": ({"K": 48}, "K must be a positive multiple of 32"),
    "K-past-cap": ({"K": 2 * gguf_ops.MAX_K}, "at most 1048576"),
    "K-2^62": ({"K": 2**62}, "at most 1048576"),
    "K-int64-max": ({"K": INT64_MAX}, "K must be a positive multiple of 32"),
    "K-float": ({"K": 256.0}, "attribute 'K' must be an int"),
    "K-list": ({"K": [256]}, "attribute 'K' must be an int"),
    "K-missing": ({"K": None}, "attribute 'K' must be given"),
    "K-one-superblock-short": ({"K": 224}, "part 0 has K not a whole number of blocks"),
    "types-missing": ({"types": None}, "'types' must be a non-empty list of ints"),
    "types-empty": (
        {"types": helper.make_attribute("types", [], attr_type=AttributeProto.INTS)},
        "'types' must be a non-empty list of ints",
    ),
    "types-floats": ({"types": [float(Q4_K)]}, "'types' must be a non-empty list of ints"),
    "types-one-int": ({"types": Q4_K}, "'types' must be a non-empty list of ints"),
    "types-more-than-rows": ({"types": [Q4_K, Q4_K]}, "same, non-zero number of parts"),
    "type-unknown": ({"types": [99]}, "unsupported ggml type 99"),
    "type-negative": ({"types": [-1]}, "unsupported ggml type -1"),
    "type-wraps-to-q4_k": ({"types": [2**32 + Q4_K]}, "unsupported ggml type 4294967308"),
    "type-q5_1-unsupported": ({"types": [7]}, "unsupported ggml type 7"),
    "rows-one-int": ({"rows": 16}, "'rows' must be a non-empty list of ints"),
    "rows-zero": ({"rows": [0]}, "part 0 has"),
    "rows-negative": ({"rows": [-16]}, "part 0 has"),
    "rows-2^40": ({"rows": [2**40]}, "over 16777216 rows"),
    "rows-int64-max": ({"rows": [INT64_MAX]}, "over 16777216 rows"),
    "rows-wrap-to-zero": ({"K": 32, "types": [Q8_0] * 4, "rows": [2**62] * 4}, "over 16777216 rows"),
    "rows-total-past-cap": ({"types": [Q4_K] * 2, "rows": [gguf_ops.MAX_ROWS, 16]}, "rows total over 16777216"),
    "layout-2": ({"layout": 2}, "layout must be 0 or 1"),
    "layout-negative": ({"layout": -1}, "layout must be 0 or 1"),
    "layout-wraps-to-1": ({"layout": 2**32 + 1}, "layout must be 0 or 1"),
    "layout-float": ({"layout": 1.0}, "attribute 'layout' must be an int"),
    "layout-string": ({"layout": "1"}, "attribute 'layout' must be an int"),
    "layout-list": ({"layout": [1]}, "attribute 'layout' must be an int"),
    "layout-1-rows-not-16s": ({"layout": 1, "rows": [8]}, "rows not a multiple of 16"),
}
GATHER_CASES = {
    "gather-type-unknown": ({"type": 99}, "GgufGather: K, type and layout"),
    "gather-type-wraps-to-q4_k": ({"type": 2**32 + Q4_K}, "GgufGather: K, type and layout"),
    "gather-type-float": ({"type": float(Q4_K)}, "attribute 'type' must be an int"),
    "gather-type-missing": ({"type": None}, "attribute 'type' must be given"),
    "gather-K-zero": ({"K": 0}, "GgufGather: K, type and layout"),
    "gather-K-not-blocks": ({"K": 48}, "GgufGather: K, type and layout"),
    "gather-K-2^62": ({"K": 2**62}, "GgufGather: K, type and layout"),
    "gather-K-float": ({"K": 256.0}, "attribute 'K' must be an int"),
    "gather-layout-3": ({"layout": 3}, "GgufGather: K, type and layout"),
    "gather-layout-float": ({"layout": 1.0}, "attribute 'layout' must be an int"),
}


def _changed(base: dict, change: dict) -> dict:
    """``base`` with ``change`` applied (None removes an attribute; an AttributeProto is kept as it is)."""
    out = {**base, **change}
    return {name: value for name, value in out.items() if value is not None}


def _node_with(model, attributes: dict):
    """``model`` with its node's attributes replaced (AttributeProtos where helper.make_node cannot say the type)."""
    node = model.graph.node[0]
    del node.attribute[:]
    node.attribute.extend(
        v if isinstance(v, AttributeProto) else helper.make_attribute(n, v) for n, v in attributes.items()
    )
    return model


@pytest.mark.parametrize("change, message", MATMUL_CASES.values(), ids=MATMUL_CASES.keys())
def test_a_crafted_matmul_node_is_refused_by_the_library_and_by_the_graph_check(change, message):
    attributes = _changed(MATMUL, change)
    parts = len(types) if isinstance(types := attributes.get("types"), list) else 1
    model = _node_with(_matmul(MATMUL, parts), attributes)
    _refused_at_creation(model, message)
    with pytest.raises(BundleError, match="GgufMatMul"):
        onnx_checks.check_operators(model, "crafted.onnx")


@pytest.mark.parametrize("change, message", GATHER_CASES.values(), ids=GATHER_CASES.keys())
def test_a_crafted_gather_node_is_refused_by_the_library_and_by_the_graph_check(change, message):
    model = _node_with(_gather(GATHER), _changed(GATHER, change))
    _refused_at_creation(model, message)
    with pytest.raises(BundleError, match="GgufGather"):
        onnx_checks.check_operators(model, "crafted.onnx")


def test_a_mistyped_attribute_is_named_by_the_graph_check():
    """A float layout 1.0 is neither read as 1 (Python's equality) nor as 0 (an int getter failing)."""
    for model in (_node_with(_matmul(MATMUL), {**MATMUL, "layout": 1.0}), _gather({**GATHER, "layout": 1.0})):
        with pytest.raises(BundleError, match="attribute 'layout' must be INT, not FLOAT"):
            onnx_checks.check_operators(model, "crafted.onnx")


def test_the_unchanged_nodes_pass_both():
    for model in (_matmul(MATMUL), _gather(GATHER)):
        onnx_checks.check_operators(model, "crafted.onnx")
        make_session(model.SerializeToString(), 1)


# --- inputs that do not match, fed at run time (past the graph check, which wants initializers) ------------------


@pytest.mark.parametrize("shape", [(16, 143), (15, 144), (16, 288), (0, 0), (1, 1)])
def test_a_fed_weight_of_another_shape_is_an_error(shape):
    session = make_session(_matmul(MATMUL, fed=True).SerializeToString(), 1)
    with pytest.raises(Exception, match=r"weight part 0 must be uint8 \[16, 144\]"):
        session.run(None, {"x": np.ones((2, 256), np.float32), "w0": np.zeros(shape, np.uint8)})


def test_activations_of_another_width_and_a_missing_part_are_errors():
    session = make_session(_matmul(MATMUL, fed=True).SerializeToString(), 1)
    with pytest.raises(Exception, match="A's last dimension is not K"):
        session.run(None, {"x": np.ones((2, 128), np.float32), "w0": np.zeros((16, 144), np.uint8)})
    short = make_session(_matmul({**MATMUL, "types": [Q4_K] * 2, "rows": [16, 16]}).SerializeToString(), 1)
    with pytest.raises(Exception, match="expected 3 inputs"):
        short.run(None, {"x": np.ones((2, 256), np.float32)})


@pytest.mark.parametrize("bad", [-1, 16, 2**40, INT64_MAX, -(2**63)])
def test_an_id_outside_the_table_is_an_error(bad):
    session = make_session(_gather(GATHER).SerializeToString(), 1)
    with pytest.raises(Exception, match="is not a row of the table"):
        session.run(None, {"ids": np.array([0, bad], np.int64)})


@pytest.mark.parametrize("shape, layout", [((16, 143), 0), ((15, 144), 1), ((16, 288), 0)])
def test_a_fed_table_of_another_shape_is_an_error(shape, layout):
    session = make_session(_gather({**GATHER, "layout": layout}, fed=True).SerializeToString(), 1)
    with pytest.raises(Exception, match=r"W must be uint8 \[rows, 144\]"):
        session.run(None, {"w": np.zeros(shape, np.uint8), "ids": np.array([0], np.int64)})


def test_empty_calls_keep_their_shape():
    matmul = make_session(_matmul(MATMUL).SerializeToString(), 1)
    assert matmul.run(None, {"x": np.zeros((0, 256), np.float32)})[0].shape == (0, 16)
    gather = make_session(_gather(GATHER).SerializeToString(), 1)
    assert gather.run(None, {"ids": np.zeros(0, np.int64)})[0].shape == (0, 256)
