"""An engine's ONNX graph, checked before ONNX Runtime sees it: every external-data location stays beside the graph,
every operator is one an engine uses, no constant shape makes the loader allocate without bound. The graph's bytes
and its external data are read once, verified, and handed to the session as bytes (runtime/api.py)."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

import numpy as np

from runtime.engines.attention_classes import attention_settings
from runtime.bundle import BundleError, Manifest, path_problem, read_verified

# An external-data location names a file beside the graph; this charset keeps ONNX Runtime's in-memory address tag
# ("*/_ORT_MEM_ADDR_/*": data at a raw pointer) and anything shell- or platform-special out.
_LOCATION_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


def read_onnx(root: Path, manifest: Manifest, rel: str, verify: bool = True) -> tuple[bytes, dict[str, bytes], tuple]:
    """An ONNX engine's graph and its external-data files by the location the graph names, each read once and
    checked (``read_verified``), and its attention settings (runtime.engines.attention_classes). Every location must
    be a
    file the bundle lists, beside or below the graph."""
    model = read_verified(root, manifest, rel, verify)
    external = {}
    proto = parse_onnx(model, rel)
    check_operators(proto, rel)
    for location in external_data_locations(proto, rel):
        external[location] = read_verified(root, manifest, posixpath.join(posixpath.dirname(rel), location), verify)
    return model, external, attention_settings(proto)


def parse_onnx(model: bytes, where: str):
    import onnx
    from google.protobuf.message import DecodeError
    try:
        return onnx.ModelProto.FromString(model)
    except (DecodeError, RecursionError, ValueError) as err:
        raise BundleError(f"{where}: not a valid ONNX model ({err}); rebuild the bundle") from None


# Operators an engine may use. Standard ONNX operators are allowed but for control flow (a Loop or Scan runs for as
# long as its graph says); of ONNX Runtime's contrib operators, those decoder graphs are made of.
DENIED_ONNX_OPS = frozenset({"Loop", "Scan", "If", "SequenceMap"})
CONTRIB_OPS = frozenset({"GroupQueryAttention", "MatMulNBits", "SkipSimplifiedLayerNormalization",
                         "SimplifiedLayerNormalization", "SkipLayerNormalization", "RotaryEmbedding", "FastGelu",
                         "Gelu", "BiasGelu", "QuickGelu", "MultiHeadAttention", "GatherBlockQuantized"})
SHAPE_FROM_INPUT_OPS = {"ConstantOfShape": 0, "Expand": 1}  # op -> the input that gives the output's shape
MAX_CONSTANT_ELEMENTS = 1 << 26  # a constant-shaped output ONNX Runtime would fold (allocate) while loading


def check_operators(proto, where: str) -> None:
    """BundleError unless every node (graph, subgraphs, functions) is an allowed operator, and no constant shape
    makes ONNX Runtime allocate more than MAX_CONSTANT_ELEMENTS while it folds constants at load."""
    import onnx
    from onnx import numpy_helper
    constants = {t.name: t for t in proto.graph.initializer}
    constants.update({n.output[0]: a.t for n in proto.graph.node if n.op_type == "Constant"
                      for a in n.attribute if a.name == "value" and a.HasField("t")})
    problems = []
    for node in _all_nodes(proto):
        domain = node.domain or ""
        if domain in ("", "ai.onnx"):
            if node.op_type in DENIED_ONNX_OPS:
                problems.append(f"node {node.name!r}: {node.op_type} (control flow) is not allowed in an engine")
        elif domain == "com.microsoft":
            if node.op_type not in CONTRIB_OPS:
                problems.append(f"node {node.name!r}: com.microsoft {node.op_type} is not an operator engines use")
        else:
            problems.append(f"node {node.name!r}: operator domain {domain!r} (custom operators are not allowed)")
        shape_input = SHAPE_FROM_INPUT_OPS.get(node.op_type)
        if shape_input is not None and len(node.input) > shape_input and node.input[shape_input] in constants:
            tensor = constants[node.input[shape_input]]
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                dims = numpy_helper.to_array(tensor).astype(np.float64).ravel()
                if dims.size and float(np.prod(np.maximum(dims, 1))) > MAX_CONSTANT_ELEMENTS:
                    problems.append(f"node {node.name!r}: {node.op_type} to a constant shape of "
                                    f"{float(np.prod(dims)):.3g} elements")
    if problems:
        raise BundleError(f"{where}: refused:\n  " + "\n  ".join(problems[:20]))


def _all_nodes(proto):
    def graph_nodes(graph):
        for node in graph.node:
            yield node
            for attribute in node.attribute:
                for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                    yield from graph_nodes(sub)
    yield from graph_nodes(proto.graph)
    for function in proto.functions:
        for node in function.node:
            yield node


def external_data_locations(model, where: str) -> set[str]:
    """The external-data locations an ONNX graph (bytes or a parsed ModelProto) names, in every tensor it holds
    (initializers, sparse ones, constants in node attributes, subgraphs, functions and their default attributes);
    BundleError for one that could leave the graph's folder.

    Checked here, not left to ONNX Runtime: older releases follow '..' and absolute locations.
    """
    import onnx
    proto = parse_onnx(model, where) if isinstance(model, bytes) else model
    locations, problems = set(), []
    for kind, owner, tensor in _model_tensors(proto):
        if kind == "node":
            problems.append(f"{owner}: an EPContext node (it loads a compiled binary by a path of its own)")
            continue
        entries = {e.key: e.value for e in tensor.external_data}
        if tensor.data_location != onnx.TensorProto.EXTERNAL and "location" not in entries:
            continue
        location = entries.get("location", "")
        if path_problem(location) or not all(_LOCATION_PART.fullmatch(p) for p in location.split("/")):
            problems.append(f"tensor {tensor.name!r}: external data location {location!r} is not a plain file name "
                            "beside the graph")
        else:
            locations.add(location)
    if problems:
        raise BundleError(f"{where}: refused, its data would come from outside the bundle:\n  " + "\n  ".join(problems))
    return locations


def _model_tensors(model):
    """(kind, owner, tensor) for every tensor of the model; ("node", name, None) for an EPContext node."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)
        for attribute in function.attribute_proto:  # a function's default attribute values can hold tensors too
            yield from _attribute_tensors(attribute, function.name)
    for info in model.training_info:
        yield from _graph_tensors(info.initialization)
        yield from _graph_tensors(info.algorithm)


def _graph_tensors(graph):
    for tensor in graph.initializer:
        yield "tensor", graph.name, tensor
    for sparse in graph.sparse_initializer:
        yield "tensor", graph.name, sparse.values
        yield "tensor", graph.name, sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node):
    if node.op_type == "EPContext":
        yield "node", node.name or node.op_type, None
    for attribute in node.attribute:
        yield from _attribute_tensors(attribute, node.name)


def _attribute_tensors(attribute, owner: str):
    tensors = [attribute.t] if attribute.HasField("t") else []
    tensors += list(attribute.tensors)
    sparse = ([attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else [])
    for item in sparse + list(attribute.sparse_tensors):
        tensors += [item.values, item.indices]
    for tensor in tensors:
        yield "tensor", owner, tensor
    for graph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
        yield from _graph_tensors(graph)
