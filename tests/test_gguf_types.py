"""GGUF-faithful weights (builder/gguf/weights.py) for every block type with an exact MatMulNBits form, mixed types in
one fused projection, llama.cpp's q/k row order, and the bounded header check (builder/gguf/header.py).

The oracle is the ``gguf`` package's own dequantizer (gguf/quants.py). It cannot write K-quants, so blocks are made
from random bytes in each type's layout (random scales, mins and values: every bit pattern is a valid block once its
fp16 scales are finite), and the model under test is given exactly the weights gguf reads from those bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from builder import graph
from builder.gguf import header as gguf_header
from builder.gguf import weights as gguf_weights
from builder.gguf.header import open_gguf
from builder.decoder import Linear, from_transformers
from conftest import make_model, tiny_config
from runtime.engines.fused import FusedEngine

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
HALVES = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}  # byte offsets of each block's fp16 scales / mins (ggml-common.h)
FOUR_BITS = ("Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K")
SIXTEEN_WIDE = ("Q2_K", "Q3_K", "Q6_K")
STEMS = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
Q4_K_M = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q4_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
    "token_embd": "Q6_K",
}


def _kind(name: str):
    import gguf

    return getattr(gguf.GGMLQuantizationType, name)


def _dequantize(raw: np.ndarray, kind: str, shape) -> np.ndarray:
    from gguf import quants

    return quants.dequantize(raw, _kind(kind)).reshape(shape)


def random_blocks(kind: str, n: int, k: int, rng, peak: float = 0.15) -> np.ndarray:
    """uint8 [n, row bytes]: random bytes, fp16 scales (and mins) random positive, scaled so max |w| ~ peak (w is
    linear in them)."""
    import gguf

    elements, size = gguf.GGML_QUANT_SIZES[_kind(kind)]
    raw = rng.integers(0, 256, (n, k // elements, size), dtype=np.uint8)
    halves = rng.uniform(0.5, 1.0, (len(HALVES[kind]), n, k // elements))
    for scale in (1.0, None):
        if scale is None:
            scale = peak / np.abs(_dequantize(raw.reshape(n, -1), kind, (n, k))).max()
        for at, values in zip(HALVES[kind], halves):
            raw[..., at : at + 2] = (values * scale).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    return raw.reshape(n, -1)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row order for q_proj / k_proj (what its converter writes for Llama)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, path, types: dict[str, str], permuted_qk: bool = True, seed: int = 0):
    """A GGUF file holding the model's linear weights and tied embedding as random blocks of the given types; the
    model's weights become the file's, dequantized by gguf (q / k rows stored in llama.cpp's order when
    ``permuted_qk``), so the model is exactly what the file says."""
    import gguf
    import torch

    config = model.config
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for module_name, stem in STEMS.items():
                module = getattr(layer.self_attn, module_name, None) or getattr(layer.mlp, module_name)
                n, k = module.weight.shape
                blocks = random_blocks(types[stem], n, k, rng)
                writer.add_tensor(f"blk.{i}.{stem}.weight", blocks, raw_dtype=_kind(types[stem]))
                w = _dequantize(blocks, types[stem], (n, k))
                heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(stem)
                module.weight.copy_(torch.from_numpy(_unpermute(w, heads) if heads and permuted_qk else w))
        embedding = model.model.embed_tokens.weight
        blocks = random_blocks(types["token_embd"], *embedding.shape, rng)
        writer.add_tensor("token_embd.weight", blocks, raw_dtype=_kind(types["token_embd"]))
        embedding.copy_(torch.from_numpy(_dequantize(blocks, types["token_embd"], tuple(embedding.shape))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _wide_config(architecture: str = "LlamaForCausalLM"):
    """K-quants need K a multiple of 256: hidden 256, FFN 512 (4 heads of 64, 2 KV heads)."""
    config = tiny_config(architecture)
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 512, 64
    return config


def _linear_session(linear: Linear, k: int, accuracy_level: int, threads: int = 1):
    """An ONNX Runtime session of y = x @ W (x [1, M, K], as the fused graph's [B, S, K]), W written by builder.graph
    exactly as the fused graph writes it."""
    from onnx import TensorProto, helper

    g = graph._Graph()
    g.accuracy_level = accuracy_level
    graph._linear(g, "linear", "x", linear, out="y")
    n = linear.quant.n
    model = helper.make_model(
        helper.make_graph(
            g.nodes,
            "linear",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "m", k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "m", n])],
            g.inits,
        ),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(graph.MS, 1)],
    )
    model.ir_version = 9
    from runtime.engines.sessions import make_session

    return make_session(model.SerializeToString(), threads)


def _relative_error(linear: Linear, w: np.ndarray, rng) -> float:
    """max |x @ W - x @ w^T| / max |x @ w^T| at accuracy level 0 (fp32 activations), w [N, K] the oracle."""
    x = rng.standard_normal((3, w.shape[1])).astype(np.float32)
    session = _linear_session(linear, w.shape[1], accuracy_level=0)
    got = session.run(None, {"x": x[None]})[0][0]
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def _blocks_of(kind: str, raw: np.ndarray, n: int, k: int):
    import gguf

    elements, size = gguf.GGML_QUANT_SIZES[_kind(kind)]
    return gguf_weights.DECODERS[kind](raw.reshape(n, k // elements, size))


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("block", [32, 16])
def test_each_type_is_one_exact_matmulnbits(kind, block):
    """Bytes -> MatMulNBits (+ offsets) -> the same product as gguf's dequantization of those bytes, for fp32
    activations; 16-wide sub-blocks stay 16 wide."""
    rng = np.random.default_rng(TYPES.index(kind))
    n, k = 40, 512
    raw = random_blocks(kind, n, k, rng)
    quant = gguf_weights._pack(gguf_weights.split(_blocks_of(kind, raw, n, k), block))
    assert quant.bits == (4 if kind in FOUR_BITS else 8)
    assert quant.block == (16 if kind in SIXTEEN_WIDE else block)
    assert (quant.offsets is not None) == (kind in ("Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"))
    assert (quant.zero_points is not None) == (kind in ("Q4_1", "Q4_K"))  # the others use the default
    assert _relative_error(Linear(quant=quant), _dequantize(raw, kind, (n, k)), rng) < 1e-5


def test_mixed_types_in_one_projection_become_one_exact_matmulnbits():
    """Q4_K (4 bits, zero point 0, offsets) next to Q4_0 (zero point 8) and Q6_K (8 bits, 16-blocks, no offsets):
    promoted to 8 bits in 16-blocks, Q6_K's offsets zero; 4-bit parts with different zero points (packed two a
    byte) stay 4-bit; Q2_K's 16-wide offsets make everyone's offsets 16 wide."""
    rng = np.random.default_rng(7)
    k = 512
    for kinds, bits, block, offsets in (
        (("Q4_K", "Q4_0", "Q6_K"), 8, 16, 32),
        (("Q4_K", "Q4_0", "Q4_1"), 4, 32, 32),
        (("Q4_K", "Q2_K", "IQ4_XS"), 8, 16, 16),
        (("Q3_K", "Q2_K", "Q4_1"), 4, 16, 16),
    ):
        raws = [random_blocks(kind, n, k, rng) for kind, n in zip(kinds, (24, 8, 16))]
        stacked = gguf_weights._stack([_blocks_of(kind, raw, raw.shape[0], k) for kind, raw in zip(kinds, raws)])
        quant = gguf_weights._pack(stacked)
        assert (quant.bits, quant.block, quant.offsets.shape) == (bits, block, (48, k // offsets))
        assert (quant.zero_points is not None) == (bits == 4)
        w = np.concatenate([_dequantize(raw, kind, (raw.shape[0], k)) for kind, raw in zip(kinds, raws)])
        assert _relative_error(Linear(quant=quant), w, rng) < 1e-5


def _engine(path, decoder) -> FusedEngine:
    info = graph.info_of(decoder)
    return FusedEngine(
        path,
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        vocab_size=info.vocab_size,
        max_context=128,
        threads=1,
    )


def _ops(path):
    import collections

    import onnx

    return collections.Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def _check_model_is_the_file(model, decoder, tmp_path, accuracy_level: int = 0) -> float:
    import torch

    graph.build(decoder, tmp_path / "g.onnx", accuracy_level=accuracy_level)
    assert _ops(tmp_path / "g.onnx")["MatMulNBits"] == 4 * len(decoder.layers) + 1  # fused qkv and gate_up, head
    # the embedding is the file's blocks too (GatherBlockQuantized), not a float32 table
    assert _ops(tmp_path / "g.onnx")["GatherBlockQuantized"] == (decoder.embedding_quant is not None) == 1
    engine = _engine(tmp_path / "g.onnx", decoder)
    ids = np.random.default_rng(0).integers(0, decoder.vocab, (1, 16))
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()[0]
    got = engine.forward(engine.new_cache(1), ids)[0]
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


@pytest.mark.parametrize(
    "types",
    [
        {
            "attn_q": "Q4_1",
            "attn_k": "Q4_1",
            "attn_v": "Q4_1",
            "attn_output": "Q4_1",
            "ffn_gate": "Q4_1",
            "ffn_up": "Q4_1",
            "ffn_down": "Q4_1",
            "token_embd": "Q8_0",
        },  # SmolLM2's file
        {
            "attn_q": "Q4_0",
            "attn_k": "Q4_0",
            "attn_v": "Q4_0",
            "attn_output": "Q8_0",
            "ffn_gate": "Q4_0",
            "ffn_up": "Q4_0",
            "ffn_down": "Q8_0",
            "token_embd": "Q4_0",
        },
    ],
    ids=["q4_1", "q4_0+q8_0"],
)
@pytest.mark.parametrize("block", [32, 16])
def test_gguf_blocks_become_matmulnbits_exactly(tmp_path, types, block):
    """Block layout, nibble order, llama.cpp's q/k row order, fused projections and Q4_1's offsets: with fp32
    activations (accuracy level 0) the engine computes exactly the model the file holds, in the file's 32-wide
    blocks or split into 16-wide ones."""
    model = make_model(tmp_path / "m", tiny_config(), seed=3).eval()
    _write_gguf(model, tmp_path / "m.gguf", types)
    decoder = gguf_weights.apply(from_transformers(model), open_gguf(tmp_path / "m.gguf"), block)
    assert not decoder.notes
    assert all(layer.qkv.quant is not None and layer.down.quant is not None for layer in decoder.layers)
    assert {layer.down.quant.block for layer in decoder.layers} == {block}
    assert decoder.head.quant is not None and decoder.head.quant.block == 32  # the tied head keeps the file's blocks
    assert ("MatMul" in _ops_after_build(decoder, tmp_path)) == ("Q4_1" in types.values())  # Q4_1's offsets
    assert _check_model_is_the_file(model, decoder, tmp_path) < 1e-4


def _ops_after_build(decoder, tmp_path):
    graph.build(decoder, tmp_path / "ops.onnx", accuracy_level=0)
    return _ops(tmp_path / "ops.onnx")


@pytest.mark.parametrize(
    "types",
    [
        Q4_K_M,
        {
            "attn_q": "Q5_0",
            "attn_k": "Q5_0",
            "attn_v": "Q8_0",
            "attn_output": "Q5_1",
            "ffn_gate": "Q5_K",
            "ffn_up": "Q5_0",
            "ffn_down": "Q4_K",
            "token_embd": "Q8_0",
        },  # Gemma 3 270M's Q4_K_M mixes Q5_0 and Q8_0
        {
            "attn_q": "Q3_K",
            "attn_k": "Q3_K",
            "attn_v": "Q5_K",
            "attn_output": "IQ4_XS",
            "ffn_gate": "Q2_K",
            "ffn_up": "IQ4_NL",
            "ffn_down": "Q4_K",
            "token_embd": "Q6_K",
        },
    ],
    ids=["q4_k_m", "q5+q8_0", "q2_k..iq4"],
)
@pytest.mark.parametrize("block", [32, 16])
def test_mixed_type_files_are_built_exactly_and_nothing_is_requantized(tmp_path, types, block):
    model = make_model(tmp_path / "m", _wide_config(), seed=3).eval()
    _write_gguf(model, tmp_path / "m.gguf", types)
    decoder = gguf_weights.apply(from_transformers(model), open_gguf(tmp_path / "m.gguf"), block)
    assert not decoder.notes  # nothing left as float, nothing quantized again
    qkv = decoder.layers[0].qkv.quant
    assert (qkv.bits, qkv.block) == (8, 16 if {types["attn_q"], types["attn_v"]} & set(SIXTEEN_WIDE) else block)
    assert decoder.head.quant.block == (16 if types["token_embd"] == "Q6_K" else 32)  # the head keeps the file's
    assert _check_model_is_the_file(model, decoder, tmp_path) < 1e-4


def test_unpermuted_qk_files_and_a_wrong_flag_is_corrected_and_reported(tmp_path):
    """Qwen2's converter writes q/k rows as they are (NEOX rotary): permuted_qk=False builds it exactly; the Llama
    reading (permuted_qk=True) disagrees with the model transformers loaded, so the other order is used, and said."""
    from builder.architectures import REGISTRY

    assert REGISTRY["Qwen2ForCausalLM"].gguf_permuted_qk is False
    assert REGISTRY["LlamaForCausalLM"].gguf_permuted_qk is True
    model = make_model(tmp_path / "m", _wide_config("Qwen2ForCausalLM"), seed=4).eval()
    _write_gguf(model, tmp_path / "m.gguf", Q4_K_M, permuted_qk=False)
    decoder = gguf_weights.apply(from_transformers(model), open_gguf(tmp_path / "m.gguf"), permuted_qk=False)
    assert not decoder.notes and decoder.layers[0].qkv.bias is not None  # Qwen2's q/k/v biases are kept
    assert _check_model_is_the_file(model, decoder, tmp_path) < 1e-4
    wrong = gguf_weights.apply(from_transformers(model), open_gguf(tmp_path / "m.gguf"), permuted_qk=True)
    assert (
        len(wrong.notes) == 1
        and "gguf_permuted_qk (True)" in wrong.notes[0]
        and "fix the registry entry" in wrong.notes[0]
    )
    assert all(np.array_equal(a.qkv.quant.packed, b.qkv.quant.packed) for a, b in zip(wrong.layers, decoder.layers))


def test_gguf_types_without_an_exact_form_stay_float_and_are_reported(tmp_path):
    """ffn_down rewritten as an F16 tensor (some files keep tensors in float): it stays a float weight; the rest keeps
    its blocks, and the note names the type."""
    import gguf
    import torch

    model = make_model(tmp_path / "m", _wide_config(), seed=3).eval()
    _write_gguf(model, tmp_path / "m.gguf", Q4_K_M)
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    writer = gguf.GGUFWriter(str(tmp_path / "f16.gguf"), "llama")
    with torch.no_grad():
        for tensor in reader.tensors:
            if tensor.name.endswith("ffn_down.weight"):
                layer = model.model.layers[int(tensor.name.split(".")[1])]
                weight = layer.mlp.down_proj.weight.numpy().astype(np.float16)
                writer.add_tensor(tensor.name, weight)
                layer.mlp.down_proj.weight.copy_(torch.from_numpy(weight.astype(np.float32)))
            else:
                writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    decoder = gguf_weights.apply(from_transformers(model), open_gguf(tmp_path / "f16.gguf"))
    assert all(layer.down.quant is None and layer.qkv.quant is not None for layer in decoder.layers)
    assert decoder.notes and "F16" in decoder.notes[0] and "float32" in decoder.notes[0]


def test_a_file_that_disagrees_with_the_model_is_refused(tmp_path):
    model = make_model(tmp_path / "m", tiny_config(), seed=3).eval()
    types = dict.fromkeys(["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"], "Q8_0")
    _write_gguf(model, tmp_path / "m.gguf", {**types, "token_embd": "Q8_0"})
    decoder = from_transformers(model)
    decoder.layers[1].down.weight[3, 5] += 0.5  # not what the file says
    with pytest.raises(ValueError, match="ffn_down.*differ"):
        gguf_weights.apply(decoder, open_gguf(tmp_path / "m.gguf"))
    decoder = from_transformers(model)
    decoder.layers[0].qkv.weight[0, 1] += 0.5  # q/k rows that match in neither order
    with pytest.raises(ValueError, match="attn_q.*in either q/k row order"):
        gguf_weights.apply(decoder, open_gguf(tmp_path / "m.gguf"))


# --- the header check ------------------------------------------------------------------------------------------------


def _header(
    kvs: bytes = b"", kv_count: int = 0, tensor_count: int = 0, magic: bytes = b"GGUF", version: int = 3
) -> bytes:
    return magic + struct.pack("<IQQ", version, tensor_count, kv_count) + kvs


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


HOSTILE = {
    "huge array count": (
        _header(_string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 1 << 60), 1),
        "array of 1152921504606846976 items",
    ),
    "huge scalar array": (
        _header(_string(b"scores") + struct.pack("<IIQ", 9, 6, 1 << 20) + bytes(64), 1),
        "only 64 bytes remain",
    ),
    "huge string length": (_header(struct.pack("<Q", 1 << 62) + b"x" * 16, 1), "key-value 0's key"),
    "huge string value": (
        _header(_string(b"general.name") + struct.pack("<IQ", 8, 1 << 40) + b"abc", 1),
        "'general.name'",
    ),
    "string array past the end": (
        _header(
            _string(b"tokens") + struct.pack("<IIQ", 9, 8, 3) + _string(b"a") + struct.pack("<Q", 1 << 40) + bytes(8), 1
        ),
        "'tokens'[1] runs past",
    ),
    "huge kv count": (_header(kv_count=1 << 50), "kv_count declares"),
    "huge tensor count": (_header(tensor_count=1 << 50), "tensor_count declares"),
    "truncated": (_header(_string(b"general.alignment") + struct.pack("<I", 4), 1), "general.alignment"),
    "bad magic": (_header(magic=b"GGML"), "magic"),
    "bad version": (_header(version=7), "version 7"),
    "empty": (b"", "empty"),
    "bad alignment": (_header(_string(b"general.alignment") + struct.pack("<II", 4, 24), 1), "power of two"),
    "tensor past the end": (_header(_string(b"w") + struct.pack("<I2QIQ", 2, 32, 4, 0, 0), 0, 1), "past the end"),
    "too many dims": (_header(_string(b"w") + struct.pack("<I", 9) + bytes(80), 0, 1), "9 dimensions"),
}


MAX_LINES = 1_000  # Python lines a refusal may run: a header of a few dozen fields, never one per declared item


def lines_run(call, module) -> tuple[int, BaseException | None]:
    """(lines of ``module``'s code run by ``call()``, the exception it raised): a count of work no machine's speed
    changes; a walk over the 2^60 items a header declares would never end, one over 2^20 would run millions."""
    import sys

    lines, raised = [0], None

    def local(frame, event, arg):
        if event == "line":
            lines[0] += 1
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename == module.__file__ else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        call()
    except BaseException as err:  # noqa: BLE001 - returned to the test, which checks it
        raised = err
    finally:
        sys.settrace(previous)
    return lines[0], raised


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_gguf_headers_are_refused_after_bounded_work_with_the_field_named(tmp_path, case):
    data, field = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    lines, err = lines_run(lambda: gguf_header.open_gguf(path), gguf_header)
    assert isinstance(err, gguf_header.GGUFHeaderError) and "not a valid GGUF file" in str(err)
    assert field in str(err)
    assert lines <= MAX_LINES


def test_the_checkpoint_resolver_checks_a_gguf_header_before_transformers_reads_it(tmp_path):
    from builder.checkpoint import CheckpointError, resolve

    path = tmp_path / "tiny.gguf"
    path.write_bytes(HOSTILE["huge array count"][0])
    lines, err = lines_run(lambda: resolve(str(path)), gguf_header)
    assert isinstance(err, CheckpointError) and "array of" in str(err)
    assert 0 < lines <= MAX_LINES  # the header's walk ran, briefly


def test_real_headers_pass_the_check(tmp_path):
    """A writer-made file with metadata arrays (strings, floats, nested), aligned tensors and a custom alignment."""
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "ok.gguf"), "llama")
    writer.add_uint32("general.alignment", 64)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "ünï"] * 100)
    writer.add_array("tokenizer.ggml.scores", [0.5] * 300)
    writer.add_array("nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("w", random_blocks("Q4_K", 3, 256, rng), raw_dtype=_kind("Q4_K"))
    writer.add_tensor("b", np.ones(5, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gguf_header.open_gguf(tmp_path / "ok.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "ok.gguf"))
    end = max(t.data_offset + t.n_bytes for t in reader.tensors if t.name == "b")
    del reader
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "ok.gguf").read_bytes()[: end - 1])  # tensor b cut short
    with pytest.raises(gguf_header.GGUFHeaderError, match="'b'"):
        gguf_header.open_gguf(tmp_path / "cut.gguf")


@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q6_K"])
def test_rows_read_in_chunks_are_the_same_blocks(tmp_path, monkeypatch, kind):
    """A table is read and unpacked a few rows at a time into arrays made once (a build's peak): the blocks are
    those of reading it whole."""
    model = make_model(tmp_path / "m", _wide_config(), seed=5).eval()
    _write_gguf(model, tmp_path / "m.gguf", {**Q4_K_M, "token_embd": kind})
    tensors = gguf_header.read(tmp_path / "m.gguf")
    data = gguf_weights.FileBytes(tmp_path / "m.gguf")
    decoder = from_transformers(model)
    whole = gguf_weights._tensor_blocks(data, tensors["token_embd.weight"], decoder, "token_embd", True)
    monkeypatch.setattr(gguf_weights, "DECODE_ROWS", 7)  # 320 rows: 46 chunks, the last one short
    chunked = gguf_weights._tensor_blocks(data, tensors["token_embd.weight"], decoder, "token_embd", True)
    for key, value in vars(whole).items():
        assert (value is None and getattr(chunked, key) is None) or np.array_equal(value, getattr(chunked, key)), key
