"""Hostile bundles the loader must refuse with a BundleError, before any work: deep JSON, huge manifests, operators
an engine does not use, constant shapes that would be allocated while loading, tensors in functions' defaults."""

from __future__ import annotations

import pytest

from runtime.bundle import BundleError, Manifest
from runtime.engines.onnx_checks import check_operators, external_data_locations, parse_onnx


@pytest.mark.parametrize(
    "text",
    [
        '{"a": ' * 100_000 + "1" + "}" * 100_000,
        "[" * 200_000 + "]" * 200_000,
        '{"schema_version": ' + "[" * 5000 + "]" * 5000 + "}",
        " " * (1 << 24) + "{}",
    ],
)
def test_deep_or_huge_manifests_are_bundle_errors(text):
    with pytest.raises(BundleError):
        Manifest.from_json(text)


def _model(nodes, inits=(), domains=(("", 18),), functions=()):
    from onnx import TensorProto, helper

    out = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [], [out], list(inits))
    model = helper.make_model(
        graph, functions=list(functions), opset_imports=[helper.make_opsetid(d, v) for d, v in domains]
    )
    return model.SerializeToString()


def _loop():
    from onnx import TensorProto, helper

    body_out = helper.make_tensor_value_info("c_out", TensorProto.BOOL, [])
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [body_out],
    )
    trips = helper.make_tensor("M", TensorProto.INT64, [], [1 << 62])
    return _model(
        [
            helper.make_node("Loop", ["M", ""], [], body=body),
            helper.make_node("Constant", [], ["Y"], value=helper.make_tensor("y", TensorProto.FLOAT, [1], [0.0])),
        ],
        [trips],
    )


def _constant_of_shape(dims):
    from onnx import TensorProto, helper

    shape = helper.make_tensor("S", TensorProto.INT64, [len(dims)], dims)
    return _model([helper.make_node("ConstantOfShape", ["S"], ["Y"])], [shape])


def _contrib(op):
    from onnx import helper

    return _model([helper.make_node(op, [], ["Y"], domain="com.microsoft")], domains=(("", 18), ("com.microsoft", 1)))


def _custom():
    from onnx import helper

    return _model([helper.make_node("Evil", [], ["Y"], domain="my.ops")], domains=(("", 18), ("my.ops", 1)))


@pytest.mark.parametrize(
    "model,message",
    [
        (_loop, "Loop"),
        (lambda: _constant_of_shape([1 << 20, 1 << 20]), "ConstantOfShape"),
        (lambda: _constant_of_shape([1 << 14] * 4), "ConstantOfShape"),
        (lambda: _contrib("QAttention"), "QAttention"),
        (lambda: _contrib("CDist"), "CDist"),
        (_custom, "custom operators"),
    ],
    ids=["loop", "constant-of-shape-2d", "constant-of-shape-4d", "contrib", "contrib-2", "custom-domain"],
)
def test_operators_engines_do_not_use_are_refused(model, message):
    with pytest.raises(BundleError, match=message):
        check_operators(parse_onnx(model(), "target/model.onnx"), "target/model.onnx")


def test_the_operators_of_our_own_engines_pass(tiny_bundle, tiny_int4_bundle):
    for bundle in (tiny_bundle, tiny_int4_bundle):
        for path in bundle.glob("*/*.onnx"):
            check_operators(parse_onnx(path.read_bytes(), str(path)), str(path))
    check_operators(parse_onnx(_constant_of_shape([4, 4]), "small"), "small")


@pytest.mark.parametrize("location", ["../x.data", "/etc/passwd", "*/_ORT_MEM_ADDR_/*"])
def test_a_tensor_in_a_functions_default_attribute_is_checked(location):
    from onnx import TensorProto, helper

    tensor = helper.make_tensor("W", TensorProto.FLOAT, [1], [0.0])
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    function = helper.make_function(
        "local",
        "F",
        [],
        ["Z"],
        [helper.make_node("Constant", [], ["Z"], value_float=1.0)],
        [helper.make_opsetid("", 18)],
        attributes=[],
    )
    function.attribute_proto.append(helper.make_attribute("value", tensor))
    model = _model(
        [helper.make_node("F", [], ["Y"], domain="local")], domains=(("", 18), ("local", 1)), functions=[function]
    )
    with pytest.raises(BundleError, match="not a plain file name"):
        external_data_locations(model, "target/model.onnx")


# ONNX Runtime folds every node whose inputs are constants while it loads the graph, so a shape that is *computed* from
# constants (a Concat, a Mul, a Cast...) or a Tile or Range of constants is allocated at load too.
def _ints(name, values, dims=None):
    from onnx import TensorProto, helper

    return helper.make_tensor(name, TensorProto.INT64, [len(values)] if dims is None else dims, values)


def _hostile_folding():
    from onnx import TensorProto, helper

    n = helper.make_node
    big, half = 1 << 20, 1 << 15
    scalar = dict(dims=[])
    return {
        "ConstantOfShape(Concat)": (
            [n("Concat", ["a", "b"], ["s"], axis=0), n("ConstantOfShape", ["s"], ["Y"])],
            [_ints("a", [big]), _ints("b", [big])],
        ),
        "ConstantOfShape(Concat(Constant))": (
            [
                n("Constant", [], ["a"], value=_ints("av", [big])),
                n("Concat", ["a", "a", "a"], ["s"], axis=0),
                n("ConstantOfShape", ["s"], ["Y"]),
            ],
            [],
        ),
        "ConstantOfShape(Mul)": (
            [n("Mul", ["a", "a"], ["s"]), n("ConstantOfShape", ["s"], ["Y"])],
            [_ints("a", [half])],
        ),
        "ConstantOfShape(Add)": (
            [n("Add", ["a", "a"], ["s"]), n("ConstantOfShape", ["s"], ["Y"])],
            [_ints("a", [1 << 29])],
        ),
        "ConstantOfShape(Cast(float))": (
            [n("Cast", ["f"], ["s"], to=TensorProto.INT64), n("ConstantOfShape", ["s"], ["Y"])],
            [helper.make_tensor("f", TensorProto.FLOAT, [2], [65536.0, 65536.0])],
        ),
        "ConstantOfShape(Reshape(Concat))": (
            [
                n("Concat", ["a", "a"], ["c"], axis=0),
                n("Reshape", ["c", "r"], ["s"]),
                n("ConstantOfShape", ["s"], ["Y"]),
            ],
            [_ints("a", [big]), _ints("r", [2])],
        ),
        "ConstantOfShape(Squeeze(Unsqueeze))": (
            [
                n("Unsqueeze", ["a", "ax"], ["u"]),
                n("Squeeze", ["u", "ax"], ["v"]),
                n("Identity", ["v"], ["s"]),
                n("ConstantOfShape", ["s"], ["Y"]),
            ],
            [_ints("a", [big, big]), _ints("ax", [0])],
        ),
        "Expand(Concat)": (
            [n("Concat", ["a", "a"], ["s"], axis=0), n("Expand", ["x", "s"], ["Y"])],
            [_ints("a", [big]), _ints("x", [1])],
        ),
        "Tile(repeats)": ([n("Tile", ["x", "r"], ["Y"])], [_ints("x", [1]), _ints("r", [1 << 30])]),
        "Tile(big input)": ([n("Tile", ["x", "r"], ["Y"])], [_ints("x", [0] * 1024), _ints("r", [1 << 17])]),
        "Tile(Concat repeats)": (
            [n("Concat", ["a", "a"], ["r"], axis=0), n("Tile", ["x", "r"], ["Y"])],
            [_ints("a", [big]), _ints("x", [1, 1], dims=[1, 2])],
        ),
        "Range(int)": (
            [n("Range", ["s", "l", "d"], ["Y"])],
            [_ints("s", [0], **scalar), _ints("l", [1 << 40], **scalar), _ints("d", [1], **scalar)],
        ),
        "Range(float)": (
            [n("Range", ["s", "l", "d"], ["Y"])],
            [helper.make_tensor(k, TensorProto.FLOAT, [], [v]) for k, v in (("s", 0.0), ("l", 1e12), ("d", 1.0))],
        ),
        "Range(tiny delta)": (
            [n("Range", ["s", "l", "d"], ["Y"])],
            [helper.make_tensor(k, TensorProto.DOUBLE, [], [v]) for k, v in (("s", 0.0), ("l", 1.0), ("d", 1e-12))],
        ),
        "Range(Mul limit)": (
            [n("Mul", ["a", "a"], ["l"]), n("Range", ["s", "l", "d"], ["Y"])],
            [_ints("s", [0], **scalar), _ints("a", [1 << 20], **scalar), _ints("d", [1], **scalar)],
        ),
        "ConstantOfShape(negative product)": ([n("ConstantOfShape", ["s"], ["Y"])], [_ints("s", [-1, 1 << 40])]),
    }


HOSTILE_FOLDING = _hostile_folding()


@pytest.mark.parametrize("name", sorted(HOSTILE_FOLDING))
def test_a_graph_whose_constant_folding_would_allocate_without_bound_is_refused(name):
    nodes, inits = HOSTILE_FOLDING[name]
    with pytest.raises(BundleError, match="elements"):
        check_operators(parse_onnx(_model(nodes, inits), "target/model.onnx"), "target/model.onnx")


def test_small_folded_shapes_pass():
    from onnx import helper

    n = helper.make_node
    for nodes, inits in [
        ([n("Concat", ["a", "a"], ["s"], axis=0), n("ConstantOfShape", ["s"], ["Y"])], [_ints("a", [64])]),
        ([n("Tile", ["x", "r"], ["Y"])], [_ints("x", [1, 2]), _ints("r", [8])]),
        ([n("Range", ["s", "l", "d"], ["Y"])], [_ints(k, [v], dims=[]) for k, v in (("s", 0), ("l", 4096), ("d", 1))]),
    ]:
        check_operators(parse_onnx(_model(nodes, inits), "small"), "small")
