"""Draftsmith's GGUF-block matmul (runtime/engines/gguf_ops): every block type against the file's dequantized weights,
row independence (a row's result does not depend on the call's rows or its place in a tile), each instruction set
this CPU runs and an emulated AVX2 one, the builder's native engines, and what happens without the library.

The activations are quantized to int8 the way ggml does (per 256 values for the K-quants, per 32 otherwise), so
against float activations the product is exact only up to that rounding: |x - d q| <= d / 2 for each value, hence
|y - w.x| <= sum_i |w_i| d(i) / 2 (``rounding_bound``). Against the same activations dequantized (``d * q``) the
integer products are exact and only float summation order remains (relative 1e-5)."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from builder import graph
from builder.decoder import from_transformers
from builder.gguf import weights as gguf_weights
from builder.gguf.header import open_gguf
from conftest import make_model
from runtime.engines import gguf_ops
from builder.gguf.weights import interleave16
from test_gguf_types import Q4_K_M, _dequantize, _engine, _ops, _wide_config, _write_gguf, random_blocks

pytestmark = pytest.mark.skipif(not gguf_ops.available(), reason=f"{gguf_ops.unavailable_reason()}")

TYPES = tuple(gguf_ops.GGML_TYPE_IDS)
ISAS = ("avx512-vnni", "avx2", "scalar")


def _library():
    library = ctypes.CDLL(str(gguf_ops.library_path()))
    library.DraftsmithGgufDot.restype = ctypes.c_int
    return library


def _dot(isa: str, kind: str, raw: np.ndarray, k: int, x: np.ndarray, layout: int = 0) -> np.ndarray | None:
    """y [M, N] from one instruction set's kernels called directly (None where this CPU lacks it); ``raw``: the
    file's rows, regrouped here for layout 1."""
    x = np.ascontiguousarray(x, np.float32)
    raw = np.ascontiguousarray(interleave16(kind, raw) if layout else raw)
    y = np.zeros((len(x), len(raw)), np.float32)
    pointer = ctypes.c_void_p
    code = _library().DraftsmithGgufDot(
        isa.encode(),
        gguf_ops.GGML_TYPE_IDS[kind],
        layout,
        raw.ctypes.data_as(pointer),
        ctypes.c_int64(len(raw)),
        ctypes.c_int64(k),
        x.ctypes.data_as(pointer),
        ctypes.c_int64(len(x)),
        y.ctypes.data_as(pointer),
    )
    assert code in (0, 2), code
    return y if code == 0 else None


def _span(kind: str) -> int:
    return 256 if kind.endswith("_K") else 32


def _quantized(x: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """The activations as the kernels quantize them (float32 arithmetic, round half to even), dequantized, and each
    value's scale d."""
    blocks = x.astype(np.float32).reshape(len(x), -1, span)
    amax = np.abs(blocks).max(-1, keepdims=True)
    d = amax / np.float32(127)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(blocks * inverse)
    return (q * d).reshape(x.shape).astype(np.float64), np.broadcast_to(d, blocks.shape).reshape(x.shape)


def rounding_bound(w: np.ndarray, d: np.ndarray) -> np.ndarray:
    """[M, N]: sum_i |w[n, i]| d[m, i] / 2, the most int8 activations can move each product."""
    return (d.astype(np.float64) / 2) @ np.abs(w.astype(np.float64)).T


@pytest.mark.parametrize("layout", [0, 1], ids=["rows", "columns16"])
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_every_block_type_is_the_files_weights_times_int8_activations(kind, isa, layout):
    rng = np.random.default_rng(TYPES.index(kind))
    k = 512 if kind.endswith("_K") else 224  # 224: an odd number of 32-blocks (the row kernels' pair tail)
    rows = 48 if layout else 37
    raw = random_blocks(kind, rows, k, rng)
    w = _dequantize(raw, kind, (rows, k))
    x = rng.standard_normal((7, k)).astype(np.float32)
    y = _dot(isa, kind, raw, k, x, layout)
    if y is None:
        pytest.skip(f"this CPU does not run the {isa} kernels")
    dequantized, d = _quantized(x, _span(kind))
    same_activations = dequantized @ w.T.astype(np.float64)
    assert np.abs(y - same_activations).max() <= 1e-5 * np.abs(same_activations).max()
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    assert (np.abs(y - exact) <= rounding_bound(w, d) * (1 + 1e-4) + 1e-6).all()


@pytest.mark.parametrize("layout", [0, 1], ids=["rows", "columns16"])
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_result_does_not_depend_on_the_calls_rows(kind, isa, layout):
    """Bit for bit: each row alone, and inside calls of 2..9 rows (tiles of 4 and their remainders)."""
    rng = np.random.default_rng(7)
    k = 256 if kind.endswith("_K") else 96
    raw = random_blocks(kind, 32 if layout else 21, k, rng)
    x = rng.standard_normal((9, k)).astype(np.float32)
    alone = [_dot(isa, kind, raw, k, x[i : i + 1], layout) for i in range(9)]
    if alone[0] is None:
        pytest.skip(f"this CPU does not run the {isa} kernels")
    alone = np.concatenate(alone)
    for rows in range(2, 10):
        for start in range(0, 9 - rows + 1, 3):
            together = _dot(isa, kind, raw, k, x[start : start + rows], layout)
            assert np.array_equal(together, alone[start : start + rows]), (rows, start)


@pytest.mark.parametrize("kind", TYPES)
def test_the_column_layout_is_the_file_regrouped_and_every_cpu_computes_it_alike(kind):
    """interleave16 moves bytes only (Q5_0's high bits: bits), the column kernels give the row
    kernels' values up to summation order (the portable ones read the layout back into rows: exactly theirs), and
    the AVX2 and AVX-512 column kernels agree bit for bit (exact integer sums, the same float steps in each lane)."""
    rng = np.random.default_rng(3)
    k = 512 if kind.endswith("_K") else 128
    raw = random_blocks(kind, 32, k, rng)
    regrouped = interleave16(kind, raw)
    assert regrouped.shape == raw.shape
    if kind == "Q5_0":  # its high bits move one by one
        assert np.unpackbits(regrouped).sum() == np.unpackbits(raw).sum()
    else:
        assert np.array_equal(np.sort(regrouped, None), np.sort(raw, None))
    x = rng.standard_normal((3, k)).astype(np.float32)
    rows = _dot("scalar", kind, raw, k, x)
    columns = {isa: _dot(isa, kind, raw, k, x, 1) for isa in ISAS}
    assert np.array_equal(columns["scalar"], rows)
    simd = [y for isa, y in columns.items() if isa != "scalar" and y is not None]
    assert all(np.abs(y - rows).max() <= 1e-5 * np.abs(rows).max() for y in simd)
    assert all(np.array_equal(y, simd[0]) for y in simd)


def _op_session(parts: list[tuple[str, np.ndarray]], k: int, threads: int = 2):
    """A session of one GgufMatMul over ``parts`` (as the fused graph writes it), x [1, M, K]."""
    from onnx import TensorProto, helper

    from builder.decoder import GgufBlocks, Linear
    from runtime.engines.sessions import make_session

    g = graph._Graph()
    graph._linear(g, "linear", "x", Linear(gguf=GgufBlocks(k, tuple(parts))), out="y")
    n = sum(len(data) for _, data in parts)
    model = helper.make_model(
        helper.make_graph(
            g.nodes,
            "linear",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "m", k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "m", n])],
            g.inits,
        ),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(gguf_ops.DOMAIN, 1)],
    )
    model.ir_version = 9
    return make_session(model.SerializeToString(), threads)


def test_a_fused_projection_of_three_types_in_one_operator_is_each_part_side_by_side():
    """Q4_K_M's q|k|v (Q4_K, Q4_K, Q6_K) as one node on ONNX Runtime's pool: the parts' outputs side by side, each
    the same as that part alone, and rows independent of the call."""
    rng = np.random.default_rng(1)
    k = 512
    parts = [("Q4_K", random_blocks("Q4_K", 40, k, rng)), ("Q4_K", random_blocks("Q4_K", 8, k, rng))]
    parts.append(("Q6_K", random_blocks("Q6_K", 8, k, rng)))
    x = rng.standard_normal((1, 6, k)).astype(np.float32)
    fused = _op_session(parts, k).run(None, {"x": x})[0][0]
    alone = np.concatenate([_op_session([part], k).run(None, {"x": x})[0][0] for part in parts], axis=1)
    assert np.array_equal(fused, alone)
    one_by_one = np.concatenate([_op_session(parts, k).run(None, {"x": x[:, i : i + 1]})[0][0] for i in range(6)])
    assert np.array_equal(one_by_one, fused)
    w = np.concatenate([_dequantize(data, kind, (len(data), k)) for kind, data in parts])
    dequantized, d = _quantized(x[0], 256)
    assert (np.abs(fused - x[0].astype(np.float64) @ w.T) <= rounding_bound(w, d) * (1 + 1e-4) + 1e-6).all()


def test_an_empty_call_and_a_batch_of_rows_keep_their_shape():
    rng = np.random.default_rng(2)
    session = _op_session([("Q8_0", random_blocks("Q8_0", 5, 64, rng))], 64)
    assert session.run(None, {"x": np.zeros((1, 0, 64), np.float32)})[0].shape == (1, 0, 5)
    assert session.run(None, {"x": np.ones((1, 3, 64), np.float32)})[0].shape == (1, 3, 5)


# --- the builder's native engines -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "types",
    [
        Q4_K_M,
        {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_0"}
        | {"ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0"},
    ],
    ids=["q4_k_m", "q5_0+q8_0+q4"],
)
def test_native_engines_are_the_file_at_its_own_size(tmp_path, types):
    """Every linear layer and the head as GgufMatMul over the file's own bytes (no MatMulNBits left), the weights
    stored at the file's size, and logits as close to the model the file holds as MatMulNBits' int8 activations
    bring them (on these random tiny models int8 activations move logits by several units through the layers;
    ggml's per-256 activation scales of the K-quants by up to ~1.3x MLAS's per-32 ones)."""
    import torch

    model = make_model(tmp_path / "m", _wide_config(), seed=3).eval()
    _write_gguf(model, tmp_path / "m.gguf", types)
    decoder = gguf_weights.apply(from_transformers(model), open_gguf(tmp_path / "m.gguf"), native=True)
    assert all(layer.qkv.gguf and layer.o.gguf and layer.gate_up.gguf and layer.down.gguf for layer in decoder.layers)
    assert decoder.head.gguf is not None and decoder.embedding_gguf is decoder.head.gguf  # tied: one table, shared
    graph.build(decoder, tmp_path / "g.onnx")
    ops = _ops(tmp_path / "g.onnx")
    assert ops[gguf_ops.OP] == 4 * len(decoder.layers) + 1 and ops["MatMulNBits"] == 0
    assert ops[gguf_ops.GATHER] == 1 and ops["GatherBlockQuantized"] == 0
    uint8 = _uint8_initializer_bytes(tmp_path / "g.onnx")
    assert uint8 == sum(t.nbytes for t in _tensors(tmp_path / "m.gguf").values() if t.kind != "F32")  # the file's
    stored = sum(data.nbytes for layer in decoder.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
                 for _, data in lin.gguf.parts)  # fmt: skip
    file_bytes = sum(t.nbytes for name, t in _tensors(tmp_path / "m.gguf").items() if name.startswith("blk."))
    assert stored == file_bytes
    ids = np.random.default_rng(0).integers(0, decoder.vocab, (1, 16))
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()[0]
    errors, agreement = [], []
    for path, blocks in ((tmp_path / "g.onnx", decoder), (tmp_path / "nbits.onnx", None)):
        if blocks is None:  # MatMulNBits with int8 activations (accuracy level 4), the same file
            blocks = gguf_weights.apply(from_transformers(model), open_gguf(tmp_path / "m.gguf"))
            graph.build(blocks, path)
        engine = _engine(path, blocks)
        got = engine.forward(engine.new_cache(1), ids)[0]
        errors.append(np.abs(got - want).max())
        agreement.append((got.argmax(-1) == want.argmax(-1)).mean())
    assert errors[0] <= 2 * errors[1] and agreement[0] >= agreement[1] - 1 / 16, (errors, agreement)


def _uint8_initializer_bytes(path) -> int:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.data_type == onnx.TensorProto.UINT8)


def _tensors(path):
    from builder.gguf import header

    return header.read(path)


def test_a_type_the_operator_lacks_keeps_matmulnbits_for_that_projection(tmp_path):
    types = dict(Q4_K_M, ffn_gate="Q5_K", ffn_up="Q5_K")
    model = make_model(tmp_path / "m", _wide_config(), seed=3).eval()
    _write_gguf(model, tmp_path / "m.gguf", types)
    decoder = gguf_weights.apply(from_transformers(model), open_gguf(tmp_path / "m.gguf"), native=True)
    layer = decoder.layers[0]
    assert layer.gate_up.gguf is None and layer.gate_up.quant is not None
    assert layer.qkv.gguf is not None and layer.down.gguf is not None


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("layout", [0, 1], ids=["rows", "columns16"])
def test_the_gather_reads_each_row_as_the_file_holds_it(kind, layout):
    """GgufGather (an embedding from the file's bytes) returns the gguf package's dequantized rows (float32 products
    of the same numbers: within 1e-6 of the largest), for ids in any shape, and refuses an id outside the table."""
    from onnx import TensorProto, helper, numpy_helper

    from runtime.engines.sessions import make_session

    rng = np.random.default_rng(5)
    k = 512 if kind.endswith("_K") else 96
    raw = random_blocks(kind, 32, k, rng)
    table = interleave16(kind, raw) if layout else raw
    node = helper.make_node(
        gguf_ops.GATHER,
        ["w", "ids"],
        ["y"],
        domain=gguf_ops.DOMAIN,
        K=k,
        type=gguf_ops.GGML_TYPE_IDS[kind],
        layout=layout,
    )
    model = helper.make_model(
        helper.make_graph(
            [node],
            "g",
            [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", k])],
            [numpy_helper.from_array(table, "w")],
        ),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(gguf_ops.DOMAIN, 1)],
    )
    model.ir_version = 9
    session = make_session(model.SerializeToString(), 1)
    ids = np.array([[0, 31, 5], [17, 17, 2]], np.int64)
    got = session.run(None, {"ids": ids})[0]
    want = _dequantize(raw, kind, (32, k))[ids]
    assert got.shape == (2, 3, k) and np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    for bad in (32, -1, 2**40):
        with pytest.raises(Exception, match="not a row of the table"):
            session.run(None, {"ids": np.array([[bad]], np.int64)})


# --- without the library ------------------------------------------------------------------------------------------


def test_without_the_library_a_build_falls_back_by_name_and_a_native_bundle_is_refused(tmp_path, monkeypatch):
    from builder import build, quantize
    from builder.errors import BuildError
    from runtime.bundle import BuildSpec, BundleError
    from runtime.engines import onnx_checks

    model = make_model(tmp_path / "m", _wide_config(), seed=3).eval()
    _write_gguf(model, tmp_path / "m.gguf", Q4_K_M)
    decoder = gguf_weights.apply(from_transformers(model), open_gguf(tmp_path / "m.gguf"), native=True)
    graph.build(decoder, tmp_path / "native.onnx")
    proto = onnx_checks.parse_onnx((tmp_path / "native.onnx").read_bytes(), "native.onnx")
    onnx_checks.check_operators(proto, "native.onnx")  # with the library: fine

    monkeypatch.setenv(gguf_ops.LIBRARY_ENV, str(tmp_path / "missing.so"))
    spec = BuildSpec(target=str(tmp_path / "m.gguf"), draft="self", target_quant="gguf", draft_quant="gguf")
    assert not quantize.native_gguf(spec)
    (note,) = quantize._kernel_notes(spec, False)
    assert "MatMulNBits" in note and "not built" in note and "setup.sh" in note
    with pytest.raises(BuildError, match="--gguf-kernel native: the GGUF kernel library is not built"):
        build.build(BuildSpec(**{**spec.__dict__, "gguf_kernel": "native"}), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(BundleError, match="GgufMatMul.*not built.*setup.sh") as refused:
        onnx_checks.check_operators(proto, "native.onnx")
    assert str(refused.value).count("not built") == 1  # a fact of the machine, not of each of the graph's nodes


def test_a_library_named_by_a_bare_name_is_the_file_in_the_working_folder(tmp_path, monkeypatch):
    """DRAFTSMITH_GGUF_OPS=libdraftsmith_gguf_ops.so beside the working folder: that file is checked, loaded and
    registered, by one absolute path resolved once (dlopen given the bare name would search LD_LIBRARY_PATH)."""
    shutil.copy2(gguf_ops.library_path(), tmp_path / gguf_ops.LIBRARY_NAME)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(gguf_ops.LIBRARY_ENV, gguf_ops.LIBRARY_NAME)
    assert gguf_ops.library_path() == tmp_path.resolve() / gguf_ops.LIBRARY_NAME
    assert gguf_ops.unavailable_reason() is None
    session = _op_session([("Q8_0", random_blocks("Q8_0", 5, 64, np.random.default_rng(2)))], 64)
    assert session.run(None, {"x": np.ones((1, 3, 64), np.float32)})[0].shape == (1, 3, 5)
    monkeypatch.chdir(tmp_path.parent)
    assert gguf_ops.library_path() == tmp_path.resolve() / gguf_ops.LIBRARY_NAME


def test_a_library_that_does_not_load_is_refused_once_by_its_variable_and_path(tmp_path, monkeypatch):
    from runtime.bundle import BundleError
    from runtime.engines import onnx_checks

    (tmp_path / "broken.so").write_bytes(b"not a shared library")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(gguf_ops.LIBRARY_ENV, "broken.so")
    model = _op_graph([("Q4_K", random_blocks("Q4_K", 8, 256, np.random.default_rng(0)))], 256)
    twin = model.graph.node.add()
    twin.CopyFrom(model.graph.node[0])
    twin.output[0] = "y2"
    with pytest.raises(BundleError, match="does not load") as refused:
        onnx_checks.check_operators(model, "engine.onnx")
    message = str(refused.value)
    assert message.count("does not load") == 1
    assert f"{tmp_path.resolve() / 'broken.so'} (from {gguf_ops.LIBRARY_ENV}=broken.so)" in message
    assert f"point {gguf_ops.LIBRARY_ENV} at one built here or unset it" in message  # rebuilding would not help


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(types=[99]), "ggml type 99"),
        (lambda a: a.update(rows=[a["rows"][0] + 1]), "is not an initializer uint8"),
        (lambda a: a.update(K=a["K"] * 2), "is not an initializer uint8"),
        (lambda a: a.update(types=[12, 12]), "do not describe"),
        (lambda a: a.update(K=-256), "do not describe"),
    ],
    ids=["unknown-type", "rows", "K", "parts", "negative-K"],
)
def test_a_gguf_matmul_node_that_does_not_describe_its_weights_is_refused(tmp_path, change, message):
    from onnx import helper

    from runtime.bundle import BundleError
    from runtime.engines import onnx_checks

    rng = np.random.default_rng(0)
    session_graph = _op_graph([("Q4_K", random_blocks("Q4_K", 8, 256, rng))], 256)
    node = session_graph.graph.node[0]
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    change(attributes)
    del node.attribute[:]
    node.attribute.extend(helper.make_attribute(name, value) for name, value in attributes.items())
    with pytest.raises(BundleError, match=message):
        onnx_checks.check_operators(session_graph, "engine.onnx")


def test_the_kernel_itself_refuses_weights_that_do_not_match_and_never_reads_past_them():
    """Past the graph check (a weight fed at run time): an error from the session, not a crash."""
    from onnx import TensorProto, helper

    from runtime.engines.sessions import make_session

    node = helper.make_node("GgufMatMul", ["x", "w"], ["y"], domain=gguf_ops.DOMAIN, K=256, types=[12], rows=[8])
    model = helper.make_model(
        helper.make_graph(
            [node],
            "g",
            [
                helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256]),
                helper.make_tensor_value_info("w", TensorProto.UINT8, ["n", "b"]),
            ],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        ),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(gguf_ops.DOMAIN, 1)],
    )
    model.ir_version = 9
    session = make_session(model.SerializeToString(), 1)
    for shape in ((8, 143), (7, 144), (8, 10)):
        with pytest.raises(Exception, match=r"weight part 0 must be uint8 \[8, 144\]"):
            session.run(None, {"x": np.ones((1, 256), np.float32), "w": np.zeros(shape, np.uint8)})


def _op_graph(parts, k: int):
    from onnx import TensorProto, helper

    from builder.decoder import GgufBlocks, Linear

    g = graph._Graph()
    graph._linear(g, "linear", "x", Linear(gguf=GgufBlocks(k, tuple(parts))), out="y")
    model = helper.make_model(
        helper.make_graph(
            g.nodes,
            "linear",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "m", k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "m", 8])],
            g.inits,
        ),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(gguf_ops.DOMAIN, 1)],
    )
    model.ir_version = 9
    return model


# --- an emulated AVX2 CPU -----------------------------------------------------------------------------------------

QEMU = shutil.which("qemu-x86_64")


@pytest.mark.skipif(QEMU is None or platform.machine() != "x86_64", reason="needs qemu-user's qemu-x86_64")
def test_an_emulated_avx2_cpu_picks_the_avx2_kernels_and_they_hold(tmp_path):
    """Under qemu's Haswell (AVX2 and FMA, no AVX-512) the library chooses its AVX2 kernels by itself, and every type
    agrees with the oracle and is row independent there."""
    script = tmp_path / "check.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parent.parent)!r}]\n"
        "import numpy as np\n"
        "import test_gguf_kernels as t\n"
        "from runtime.engines import gguf_ops\n"
        "failures = []\n"
        "for kind in t.TYPES:\n"
        "    for layout in (0, 1):\n"
        "        for check in (t.test_every_block_type_is_the_files_weights_times_int8_activations,\n"
        "                      t.test_a_rows_result_does_not_depend_on_the_calls_rows):\n"
        "            try:\n"
        "                check(kind, 'avx2', layout)\n"
        "            except AssertionError as err:\n"
        "                failures.append(f'{kind} {layout} {check.__name__}: {err}')\n"
        "print(json.dumps({'kernels': gguf_ops.kernels(), 'failures': failures}))\n"
    )
    done = subprocess.run(
        [QEMU, "-cpu", "Haswell", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"kernels": "avx2", "failures": []}
