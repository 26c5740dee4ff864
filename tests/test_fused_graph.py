"""The fused CPU graph (builder/graph.py), its engine (runtime.engine.FusedEngine) and GGUF-faithful weights."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from builder import graph, gguf_weights
from builder.architectures import REGISTRY
from builder.export import ExportError
from conftest import make_model, tiny_config
from runtime.engine import FusedEngine

TINY_MODELS = {"LlamaForCausalLM": {}, "MistralForCausalLM": {"sliding_window": 4096}, "Qwen2ForCausalLM": {}}


def _fused(model, path, accuracy_level: int = 4):
    decoder = graph.from_transformers(model)
    graph.build(decoder, path, accuracy_level)
    return decoder, graph.info_of(decoder)


def _engine(path, info, **options) -> FusedEngine:
    return FusedEngine(path, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                       vocab_size=info.vocab_size, max_context=128, threads=1, **options)


def _op_counts(path) -> collections.Counter:
    import onnx
    return collections.Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


@pytest.mark.parametrize("architecture", sorted(TINY_MODELS))
def test_fused_graph_matches_torch(architecture, tmp_path):
    """Prefill, verify after rollback, a right-padded batch, a batched step and a batched verify, against torch."""
    model = make_model(tmp_path / "m", tiny_config(architecture, **TINY_MODELS[architecture]), seed=5).eval()
    _, info = _fused(model, tmp_path / "model.onnx")
    report = graph.check_against_torch(model, tmp_path / "model.onnx", info, REGISTRY[architecture].tolerance)
    assert set(report) == {"prefill", "verify_after_rollback", "right_padded_batch", "batch_row_2", "batched_step",
                           "batched_verify"}
    assert max(report.values()) < 1e-4
    ops = _op_counts(tmp_path / "model.onnx")
    assert ops["GroupQueryAttention"] == info.num_layers and "Softmax" not in ops and "Concat" not in ops
    per_layer = (sum(ops.values()) - 6) / info.num_layers  # embedding, final norm, head and its 3-node slice
    assert per_layer <= 12, ops  # the exported graph has ~86


def test_fused_check_catches_a_wrong_graph(tmp_path):
    model = make_model(tmp_path / "a", tiny_config(), seed=5).eval()
    other = make_model(tmp_path / "b", tiny_config(), seed=6).eval()
    _, info = _fused(other, tmp_path / "other.onnx")
    with pytest.raises(ExportError, match="disagrees with torch"):
        graph.check_against_torch(model, tmp_path / "other.onnx", info, 1e-3)


def test_unsupported_rotary_scaling_is_refused(tmp_path):
    config = tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = make_model(tmp_path / "m", config, seed=1).eval()
    with pytest.raises(graph.GraphError, match="--graph export"):
        graph.from_transformers(model)


def _int4(src, dst):
    from builder.quantize import quantize
    quantize(src, dst, "int4", 32, False, 4)


def _scores(engine, prompt, tokens, one_at_a_time: bool) -> np.ndarray:
    cache = engine.new_cache(1)
    engine.forward(cache, np.array([prompt]))
    if not one_at_a_time:
        return engine.forward(cache, np.array([tokens]))[0]
    return np.stack([engine.forward(cache, np.array([[t]]))[0, 0] for t in tokens])


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_a_verify_call_scores_each_token_as_one_token_calls_do(tiny_pair, tmp_path, quant):
    """Greedy identity rests on this: the target's logits for a token must not depend on how many tokens the call
    carries. fp32: within 1e-5 (summation order). int4 with int8 activations: bit for bit, because the target's
    one-token calls are padded to two (min_call_tokens=2) and take the same many-row kernel as a verify call."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    _, info = _fused(model, tmp_path / "fp32.onnx")
    path = tmp_path / "fp32.onnx"
    if quant == "int4":
        _int4(path, tmp_path / "int4.onnx")
        path = tmp_path / "int4.onnx"
    engine = _engine(path, info, min_call_tokens=2 if quant == "int4" else 1)
    rng = np.random.default_rng(0)
    for _ in range(3):
        prompt, tokens = rng.integers(0, 300, 9).tolist(), rng.integers(0, 300, 5).tolist()
        wide, single = _scores(engine, prompt, tokens, False), _scores(engine, prompt, tokens, True)
        if quant == "int4":
            assert np.array_equal(wide, single)
        else:
            assert np.abs(wide - single).max() < 1e-5
        assert np.array_equal(wide.argmax(-1), single.argmax(-1))


def test_rollback_moves_only_lengths_and_the_buffer_grows(tiny_pair, tmp_path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    _, info = _fused(model, tmp_path / "m.onnx")
    engine = _engine(tmp_path / "m.onnx", info, initial_slots=4)
    cache = engine.new_cache(1)
    engine.forward(cache, np.array([[5, 6, 7]]))
    buffer = cache.past[0]
    engine.rollback(cache, np.array([1]))
    assert cache.lengths.tolist() == [1] and cache.past[0] is buffer  # nothing copied
    engine.forward(cache, np.array([[8, 9, 10, 11, 12]]))  # 6 > 4 slots: grows
    assert cache.past[0].shape[2] >= 6 and cache.lengths.tolist() == [6]
    fresh = engine.new_cache(1)
    want = engine.forward(fresh, np.array([[5, 8, 9, 10, 11, 12]]))[0, -1]
    got = engine.forward(cache, np.array([[13]]))  # continues after the rolled-back slots were overwritten
    again = engine.forward(fresh, np.array([[13]]))
    assert np.abs(got - again).max() < 1e-5 and want.shape == got[0, 0].shape


# --- GGUF-faithful weights ------------------------------------------------------------------------------------------

def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row order for q_proj / k_proj (what its converter writes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, path, types: dict[str, str]):
    """A GGUF file holding the model's linear weights (and head) in the given block types; the model's own weights
    are replaced by the file's dequantized values, so the model is exactly what the file says."""
    import gguf
    import torch
    from gguf import quants
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for module_name, stem in names.items():
                module = getattr(layer.self_attn, module_name, None) or getattr(layer.mlp, module_name)
                w = module.weight.numpy().astype(np.float32)
                rows = {"attn_q": heads, "attn_k": kv_heads}.get(stem)
                stored = _permute(w, rows) if rows else w
                kind = getattr(gguf.GGMLQuantizationType, types[stem])
                blocks = quants.quantize(stored, kind)
                writer.add_tensor(f"blk.{i}.{stem}.weight", blocks, raw_dtype=kind)
                back = quants.dequantize(blocks, kind).reshape(w.shape)
                module.weight.copy_(torch.from_numpy(_unpermute(back, rows) if rows else back))
        embedding = model.model.embed_tokens.weight.numpy().astype(np.float32)
        kind = getattr(gguf.GGMLQuantizationType, types["token_embd"])
        blocks = quants.quantize(embedding, kind)
        writer.add_tensor("token_embd.weight", blocks, raw_dtype=kind)
        model.model.embed_tokens.weight.copy_(torch.from_numpy(quants.dequantize(blocks, kind).reshape(embedding.shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("types", [
    {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_1", "ffn_gate": "Q4_1",
     "ffn_up": "Q4_1", "ffn_down": "Q4_1", "token_embd": "Q8_0"},  # SmolLM2's file
    {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
     "ffn_up": "Q4_0", "ffn_down": "Q8_0", "token_embd": "Q4_0"},
], ids=["q4_1", "q4_0+q8_0"])
@pytest.mark.parametrize("block", [32, 16])
def test_gguf_blocks_become_matmulnbits_exactly(tmp_path, types, block):
    """Block layout, nibble order, llama.cpp's q/k row order, fused projections and Q4_1's offsets: with fp32
    activations (accuracy level 0) the engine computes exactly the model the file holds, in the file's 32-wide
    blocks or split into 16-wide ones."""
    import torch
    model = make_model(tmp_path / "m", tiny_config(), seed=3).eval()
    _write_gguf(model, tmp_path / "m.gguf", types)
    decoder = gguf_weights.apply(graph.from_transformers(model), tmp_path / "m.gguf", block)
    assert not decoder.notes
    assert all(layer.qkv.quant is not None and layer.down.quant is not None for layer in decoder.layers)
    assert {layer.down.quant.block for layer in decoder.layers} == {decoder.head.quant.block} == {block}
    assert decoder.head.quant is not None  # the tied head from token_embd's blocks
    graph.build(decoder, tmp_path / "g.onnx", accuracy_level=0)
    ops = _op_counts(tmp_path / "g.onnx")
    assert ops["MatMulNBits"] == 4 * len(decoder.layers) + 1
    assert ("MatMul" in ops) == ("Q4_1" in types.values())  # Q4_1's offsets: blocksum(x) @ m^T
    engine = _engine(tmp_path / "g.onnx", graph.info_of(decoder))
    ids = np.random.default_rng(0).integers(0, 320, (1, 16))
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()[0]
    got = engine.forward(engine.new_cache(1), ids)[0]
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())


def test_gguf_types_without_an_exact_form_are_requantized_and_reported(tmp_path):
    model = make_model(tmp_path / "m", tiny_config(), seed=3).eval()
    types = dict.fromkeys(["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"], "Q4_1")
    types.update(ffn_down="Q5_0", token_embd="Q8_0")
    _write_gguf(model, tmp_path / "m.gguf", types)
    decoder = gguf_weights.apply(graph.from_transformers(model), tmp_path / "m.gguf")
    assert all(layer.down.quant is None and layer.qkv.quant is not None for layer in decoder.layers)
    assert decoder.notes and "Q5_0" in decoder.notes[0]


def test_profile_reports_per_operator_time_and_node_counts(tiny_bundle):
    from bench.profile import profile_bundle
    report = profile_bundle(tiny_bundle, threads=1, past=8, new=3, calls=4)
    target = report["target"]
    assert target["calls"] == 4 and target["new_tokens"] == 3 and target["mean_call_ms"] > 0
    assert target["ops"]["GroupQueryAttention"]["nodes"] == 2  # one per layer, as stored
    assert target["stored_nodes"]["GroupQueryAttention"] == 2 and "draft" in report
