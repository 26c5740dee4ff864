"""An engine's ONNX graph, checked before ONNX Runtime sees it: every external-data location stays beside the graph,
every operator is one an engine uses, no constant shape makes the loader allocate without bound. The graph's bytes
and its external data are read once, verified, and handed to the session as bytes (runtime/api.py)."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

import numpy as np

from runtime.engines import gguf_ops
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
CONTRIB_OPS = frozenset(
    {
        "GroupQueryAttention",
        "MatMulNBits",
        "SkipSimplifiedLayerNormalization",
        "SimplifiedLayerNormalization",
        "SkipLayerNormalization",
        "RotaryEmbedding",
        "FastGelu",
        "Gelu",
        "BiasGelu",
        "QuickGelu",
        "MultiHeadAttention",
        "GatherBlockQuantized",
    }
)
# Draftsmith's own operators (runtime.engines.gguf_ops), each checked against its weights before the library sees it
OWN_OPS = {gguf_ops.DOMAIN: frozenset({gguf_ops.OP, gguf_ops.GATHER, gguf_ops.ATTENTION})}
SHAPE_FROM_INPUT_OPS = {"ConstantOfShape": 0, "Expand": 1}  # op -> the input that gives the output's shape
MAX_CONSTANT_ELEMENTS = 1 << 26  # a constant-shaped output ONNX Runtime would fold (allocate) while loading
MAX_FOLLOWED = 1024  # elements of a constant small enough to follow through the shape arithmetic ORT folds


def check_operators(proto, where: str) -> None:
    """BundleError unless every node (graph, subgraphs, functions) is an allowed operator, and no node ONNX Runtime
    folds at load (``folding_problems``) would allocate more than MAX_CONSTANT_ELEMENTS."""
    problems, own = [], False
    for node in _all_nodes(proto):
        domain = node.domain or ""
        if domain in ("", "ai.onnx"):
            if node.op_type in DENIED_ONNX_OPS:
                problems.append(f"node {node.name!r}: {node.op_type} (control flow) is not allowed in an engine")
        elif domain == "com.microsoft":
            if node.op_type not in CONTRIB_OPS:
                problems.append(f"node {node.name!r}: com.microsoft {node.op_type} is not an operator engines use")
        elif node.op_type == gguf_ops.GATHER and domain == gguf_ops.DOMAIN:
            problems += gguf_gather_problems(node, proto.graph)
            own = True
        elif node.op_type == gguf_ops.ATTENTION and domain == gguf_ops.DOMAIN:
            problems += causal_attention_problems(node)
            own = True
        elif node.op_type in OWN_OPS.get(domain, ()):
            problems += gguf_matmul_problems(node, proto.graph)
            own = True
        else:
            problems.append(f"node {node.name!r}: operator domain {domain!r} (custom operators are not allowed)")
    problems += folding_problems(proto)
    reason = gguf_ops.unavailable_reason() if own else None
    if reason is not None:  # a fact of the machine: said once, first, not for each of the graph's nodes
        problems.insert(
            0,
            f"its {gguf_ops.DOMAIN} nodes ({gguf_ops.OP}, {gguf_ops.GATHER}, {gguf_ops.ATTENTION}) need "
            f"Draftsmith's GGUF kernels, but {reason}",
        )
    if problems:
        raise BundleError(f"{where}: refused:\n  " + "\n  ".join(problems[:20]))


def _gguf_attributes(node, kinds: dict[str, str]) -> tuple[dict, str | None]:
    """The values of ``node``'s attributes named in ``kinds`` (name -> "INT" or "INTS"), or the first one present
    with another type: the library refuses such a node too (a float layout 1.0 is neither read as 1 nor as 0)."""
    from onnx import AttributeProto, helper

    given = {a.name: a for a in node.attribute}
    for name, kind in kinds.items():
        attribute = given.get(name)
        if attribute is not None and (
            attribute.ref_attr_name or attribute.type != AttributeProto.AttributeType.Value(kind)
        ):
            found = AttributeProto.AttributeType.Name(attribute.type)
            return {}, f"attribute {name!r} must be {kind}, not {found}"
    return {name: helper.get_attribute_value(given[name]) for name in kinds if name in given}, None


def gguf_matmul_problems(node, graph) -> list[str]:
    """What is wrong with a GgufMatMul node: attributes of the wrong type, past the library's caps, or that do not
    describe its weights (each part an initializer uint8 [rows, K / block values * block bytes] of a type the
    operator knows)."""
    import onnx

    where = f"node {node.name!r}: {gguf_ops.DOMAIN} {gguf_ops.OP}"
    attributes, mistyped = _gguf_attributes(node, {"K": "INT", "types": "INTS", "rows": "INTS", "layout": "INT"})
    if mistyped:
        return [f"{where}: {mistyped}"]
    k, types, rows = attributes.get("K"), list(attributes.get("types", ())), list(attributes.get("rows", ()))
    layout = attributes.get("layout", 0)
    shapes = {t.name: (t.data_type, tuple(t.dims)) for t in graph.initializer}
    names = {v: n for n, v in gguf_ops.GGML_TYPE_IDS.items()}
    if k is None or k <= 0 or not types or len(types) != len(rows) or len(node.input) != len(types) + 1:
        return [f"{where}: attributes K, types and rows do not describe its {len(node.input) - 1} weight inputs"]
    if k > gguf_ops.MAX_K or min(rows) <= 0 or sum(rows) > gguf_ops.MAX_ROWS:
        caps = f"K <= {gguf_ops.MAX_K}, rows >= 1, {gguf_ops.MAX_ROWS} rows in all"
        return [f"{where}: K {k} or rows (in all {sum(rows)}) past the library's caps ({caps})"]
    if layout not in (0, 1) or (layout == 1 and any(n % 16 for n in rows)):
        return [f"{where}: layout {layout!r} is not 0, or 1 with rows in groups of 16"]
    problems = []
    for weight, type_id, count in zip(node.input[1:], types, rows):
        name = names.get(type_id)
        if name is None:
            problems.append(f"{where}: ggml type {type_id} is not one the operator multiplies ({sorted(names)})")
            continue
        values, size = gguf_ops.BLOCK_SHAPES[name]
        want = (onnx.TensorProto.UINT8, (count, k // values * size))
        if k % values or shapes.get(weight) != want:
            problems.append(f"{where}: weight {weight!r} is not an initializer uint8 {list(want[1])} of {name} blocks")
    return problems


def causal_attention_problems(node) -> list[str]:
    """What is wrong with a CausalAttention node: an attribute of the wrong type (the library refuses it too), heads
    that do not group (num_heads a positive multiple of kv_num_heads, at most 1024), do_rotary not 0 or 1, a scale
    that is not finite and >= 0, more than its eight inputs. (Shapes are the call's: the operator checks them on
    every call.)"""
    where = f"node {node.name!r}: {gguf_ops.DOMAIN} {gguf_ops.ATTENTION}"
    kinds = {"num_heads": "INT", "kv_num_heads": "INT", "local_window_size": "INT", "do_rotary": "INT"}
    attributes, mistyped = _gguf_attributes(node, kinds | {"scale": "FLOAT"})
    if mistyped:
        return [f"{where}: {mistyped}"]
    heads, kv_heads = attributes.get("num_heads", 0), attributes.get("kv_num_heads", 0)
    problems = []
    if not (0 < heads <= 1024 and 0 < kv_heads and heads % kv_heads == 0):
        problems.append(f"{where}: num_heads must be a positive multiple of kv_num_heads (at most 1024)")
    if attributes.get("do_rotary", 0) not in (0, 1):
        problems.append(f"{where}: do_rotary must be 0 or 1")
    if not 0.0 <= attributes.get("scale", 0.0) < float("inf"):
        problems.append(f"{where}: scale must be a finite float >= 0")
    if len(node.input) > 8 or len(node.output) != 3:
        problems.append(f"{where}: it takes at most 8 inputs and gives 3 outputs")
    return problems


def gguf_gather_problems(node, graph) -> list[str]:
    """What is wrong with a GgufGather node: attributes of the wrong type or past the library's cap on K, or its
    table not an initializer uint8 [rows, K / block values * block bytes] of a type the operator knows (rows in
    groups of 16 for layout 1)."""
    import onnx

    where = f"node {node.name!r}: {gguf_ops.DOMAIN} {gguf_ops.GATHER}"
    attributes, mistyped = _gguf_attributes(node, {"K": "INT", "type": "INT", "layout": "INT"})
    if mistyped:
        return [f"{where}: {mistyped}"]
    k, type_id, layout = attributes.get("K"), attributes.get("type"), attributes.get("layout", 0)
    name = {v: n for n, v in gguf_ops.GGML_TYPE_IDS.items()}.get(type_id)
    shapes = {t.name: (t.data_type, tuple(t.dims)) for t in graph.initializer}
    if name is None or k is None or not 0 < k <= gguf_ops.MAX_K or len(node.input) != 2 or layout not in (0, 1):
        return [f"{where}: attributes K, type and layout do not describe a GGUF table"]
    values, size = gguf_ops.BLOCK_SHAPES[name]
    kind, dims = shapes.get(node.input[0], (None, ()))
    if k % values or kind != onnx.TensorProto.UINT8 or len(dims) != 2 or dims[1] != k // values * size:
        return [f"{where}: table {node.input[0]!r} is not an initializer uint8 [rows, {k // values * size}]"]
    if layout == 1 and dims[0] % 16:
        return [f"{where}: layout 1 needs rows in groups of 16"]
    return []


def folding_problems(proto) -> list[str]:
    """Nodes whose output size comes from constants past MAX_CONSTANT_ELEMENTS. ONNX Runtime's constant folding
    computes, while it loads the graph, every node whose inputs are constants: a ConstantOfShape or Expand to a
    constant shape, a Tile by constant repeats, a Range of constant bounds, and the shape arithmetic (Concat, Mul,
    Cast, ...) that makes such a shape from smaller constants. Small constants are followed through that
    arithmetic (``_fold``), so a shape built from pieces is measured like a literal one."""
    values, counts = _small_constants(proto.graph)
    problems = []
    for node in proto.graph.node:
        elements = _output_elements(node, values, counts)
        if elements is not None and not elements <= MAX_CONSTANT_ELEMENTS:
            problems.append(
                f"node {node.name!r}: {node.op_type} of {elements:.3g} elements from constants (ONNX "
                f"Runtime would allocate it while loading; the limit is {MAX_CONSTANT_ELEMENTS})"
            )
        folded = _fold(node, values)
        if folded is not None and folded.size <= MAX_FOLLOWED:
            values[node.output[0]] = folded
    return problems


def _small_constants(graph) -> tuple[dict, dict]:
    """(name -> values as float64, for constants of at most MAX_FOLLOWED elements; name -> element count, for every
    initializer and Constant)."""
    import onnx
    from onnx import numpy_helper

    tensors = {t.name: t for t in graph.initializer}
    tensors.update(
        {
            n.output[0]: a.t
            for n in graph.node
            if n.op_type == "Constant"
            for a in n.attribute
            if a.name == "value" and a.HasField("t")
        }
    )
    values, counts = {}, {}
    for name, tensor in tensors.items():
        counts[name] = float(np.prod([max(d, 0) for d in tensor.dims])) if tensor.dims else 1.0
        if tensor.data_location != onnx.TensorProto.EXTERNAL and counts[name] <= MAX_FOLLOWED:
            try:
                values[name] = numpy_helper.to_array(tensor).astype(np.float64)
            except (ValueError, TypeError):
                pass
    return values, counts


def _output_elements(node, values: dict, counts: dict) -> float | None:
    """Elements of ``node``'s output when constants decide it (None: they do not, or not an op that grows)."""
    inputs = list(node.input)
    shape_input = SHAPE_FROM_INPUT_OPS.get(node.op_type)
    if shape_input is not None and len(inputs) > shape_input and inputs[shape_input] in values:
        return float(np.prod(np.maximum(values[inputs[shape_input]].ravel(), 1)))
    if node.op_type == "Tile" and len(inputs) > 1 and inputs[1] in values:
        return float(np.prod(np.maximum(values[inputs[1]].ravel(), 1))) * counts.get(inputs[0], 1.0)
    if node.op_type == "Range" and len(inputs) == 3 and all(name in values for name in inputs):
        start, limit, delta = (float(values[name].ravel()[0]) if values[name].size else 0.0 for name in inputs)
        if delta == 0 or not np.isfinite([start, limit, delta]).all():
            return float("inf")
        return max(0.0, np.ceil((limit - start) / delta))
    return None


def _fold(node, values: dict):
    """The value of a shape-arithmetic node whose inputs are followed constants (None otherwise), as ONNX Runtime
    would fold it; only its elements matter here, not its exact shape."""
    inputs = [values.get(name) for name in node.input if name]
    if not inputs or any(v is None for v in inputs):
        return None
    try:
        with np.errstate(all="ignore"):
            if node.op_type == "Concat":
                return np.concatenate([v.ravel() for v in inputs])
            if node.op_type in ("Identity", "Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten"):
                return inputs[0]
            if node.op_type in ("Mul", "Add", "Sub", "Max", "Min"):
                function = {
                    "Mul": np.multiply,
                    "Add": np.add,
                    "Sub": np.subtract,
                    "Max": np.maximum,
                    "Min": np.minimum,
                }[node.op_type]
                return function(inputs[0], inputs[1]) if len(inputs) == 2 else None
    except ValueError:  # shapes that do not broadcast: ORT refuses the graph itself
        return None
    return None


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
            problems.append(
                f"tensor {tensor.name!r}: external data location {location!r} is not a plain file name beside the graph"
            )
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
    sparse = [attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else []
    for item in sparse + list(attribute.sparse_tensors):
        tensors += [item.values, item.indices]
    for tensor in tensors:
        yield "tensor", owner, tensor
    for graph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
        yield from _graph_tensors(graph)
