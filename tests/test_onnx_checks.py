"""Every tensor of a graph is checked for where its data lives (runtime/engines/onnx_checks.py): initializers,
sparse initializers, constants, subgraphs and functions; EPContext nodes and graphs that do not parse are refused."""

from __future__ import annotations

import pytest

from runtime.bundle import BundleError


def _tiny_graph_with(tensor_place: str, location: str):
    """A model with one external-data tensor placed in an initializer, a sparse initializer, a Constant node, a
    subgraph or a function; or an EPContext node."""
    from onnx import TensorProto, helper

    tensor = helper.make_tensor("W", TensorProto.FLOAT, [1], [0.0])
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    out = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    graph_in, nodes, inits, sparse, functions = [], [], [], [], []
    if tensor_place == "initializer":
        inits, nodes = [tensor], [helper.make_node("Identity", ["W"], ["Y"])]
    elif tensor_place == "sparse initializer":
        indices = helper.make_tensor("I", TensorProto.INT64, [1], [0])
        sparse = [helper.make_sparse_tensor(tensor, indices, [4])]
        nodes = [helper.make_node("Identity", ["W"], ["Y"])]
    elif tensor_place == "constant":
        nodes = [helper.make_node("Constant", [], ["Y"], value=tensor)]
    elif tensor_place == "subgraph":
        branch = helper.make_graph([helper.make_node("Constant", [], ["Y"], value=tensor)], "branch", [], [out])
        graph_in = [helper.make_tensor_value_info("C", TensorProto.BOOL, [])]
        nodes = [helper.make_node("If", ["C"], ["Y"], then_branch=branch, else_branch=branch)]
    elif tensor_place == "function":
        body = helper.make_node("Constant", [], ["Z"], value=tensor)
        functions = [helper.make_function("local", "F", [], ["Z"], [body], [helper.make_opsetid("", 18)])]
        nodes = [helper.make_node("F", [], ["Y"], domain="local")]
    elif tensor_place == "EPContext":
        nodes = [
            helper.make_node("EPContext", [], ["Y"], domain="com.microsoft", ep_cache_context=location, embed_mode=0)
        ]
    graph = helper.make_graph(nodes, "g", graph_in, [out], inits, sparse_initializer=sparse)
    model = helper.make_model(
        graph, functions=functions, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("local", 1)]
    )
    return model.SerializeToString()


@pytest.mark.parametrize("place", ["initializer", "sparse initializer", "constant", "subgraph", "function"])
@pytest.mark.parametrize("location", ["../x.data", "/etc/passwd", "*/_ORT_MEM_ADDR_/*", "a/../../x", "C:\\x.data"])
def test_every_tensor_of_the_graph_is_checked_for_its_data_location(place, location):
    """Not only initializers: constants, subgraphs and functions can hold external data too; ONNX Runtime's
    in-memory address tag would read raw process memory."""
    from runtime.engines.onnx_checks import external_data_locations

    with pytest.raises(BundleError, match="W.*not a plain file name"):
        external_data_locations(_tiny_graph_with(place, location), "target/model.onnx")
    assert external_data_locations(_tiny_graph_with(place, "model.onnx.data"), "t") == {"model.onnx.data"}


def test_an_epcontext_node_is_refused():
    from runtime.engines.onnx_checks import external_data_locations

    with pytest.raises(BundleError, match="EPContext"):
        external_data_locations(_tiny_graph_with("EPContext", "../engine.bin"), "target/model.onnx")


def test_a_graph_that_does_not_parse_is_a_bundle_error():
    from runtime.engines.onnx_checks import external_data_locations

    with pytest.raises(BundleError, match="not a valid ONNX model"):
        external_data_locations(b"\xff\xff\xff\xff not protobuf", "target/model.onnx")
