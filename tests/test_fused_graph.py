"""The fused CPU graph (builder/graph.py) and its engine (runtime.engines.fused.FusedEngine)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from builder import graph
from builder.architectures import REGISTRY
from builder.decoder import ROPE_KINDS, GraphError, RotaryTable, from_transformers
from builder.export import ExportError
from conftest import EVAL_TOKENS, make_model, tiny_config
from runtime.engines.fused import FusedEngine

# Rotary scalings on Llama, each changing the angles within the 16 checked positions
ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 500000.0,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0],
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    },
}
# One tiny model per case: (architecture, config keys over the registry's tiny_config). Windows of 4 tokens are
# shorter than the checked sequences, so sliding attention is really exercised.
TINY_MODELS = {
    "LlamaForCausalLM": ("LlamaForCausalLM", {}),
    **{f"LlamaForCausalLM-{kind}": ("LlamaForCausalLM", {"rope_parameters": rope}) for kind, rope in ROPES.items()},
    "MistralForCausalLM": ("MistralForCausalLM", {"sliding_window": 4}),
    "Qwen2ForCausalLM": ("Qwen2ForCausalLM", {}),
    "Qwen3ForCausalLM": ("Qwen3ForCausalLM", {}),
    "Qwen3ForCausalLM-sliding": (
        "Qwen3ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    ),
    "Phi3ForCausalLM": ("Phi3ForCausalLM", {}),  # longrope, partial rotary 0.5, fused qkv_proj / gate_up_proj
    "Phi3ForCausalLM-default": (
        "Phi3ForCausalLM",
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
    ),
    "Gemma2ForCausalLM": ("Gemma2ForCausalLM", {}),  # softcaps 50 / 30 (Gemma 2's defaults)
    "Gemma2ForCausalLM-softcap": (
        "Gemma2ForCausalLM",
        {"final_logit_softcapping": 5.0, "attn_logit_softcapping": 2.0},
    ),  # caps that bite
    "Gemma3ForCausalLM": ("Gemma3ForCausalLM", {}),
    # transformers' Gemma 3 caps only the logits (it keeps attn_logit_softcapping but never applies it)
    "Gemma3ForCausalLM-softcap": ("Gemma3ForCausalLM", {"final_logit_softcapping": 5.0, "attn_logit_softcapping": 2.0}),
    "SmolLM3ForCausalLM": ("SmolLM3ForCausalLM", {}),  # layer 1 of 2 without rotary embedding
    "GraniteForCausalLM": ("GraniteForCausalLM", {}),
    "Olmo2ForCausalLM": ("Olmo2ForCausalLM", {}),
    "LlamaForCausalLM-biases": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
}


def _fused(model, path, accuracy_level: int = 4):
    decoder = from_transformers(model)
    graph.build(decoder, path, accuracy_level)
    return decoder, graph.info_of(decoder)


def _engine(path, info, **options) -> FusedEngine:
    return FusedEngine(
        path,
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        vocab_size=info.vocab_size,
        max_context=128,
        threads=1,
        **options,
    )


def _op_counts(path) -> collections.Counter:
    import onnx

    return collections.Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def _tiny(case: str, tmp_path, seed: int = 5, **extra):
    architecture, keys = TINY_MODELS[case]
    return make_model(tmp_path / "m", tiny_config(architecture, **{**keys, **extra}), seed=seed).eval()


def test_every_registry_entry_and_rotary_kind_has_a_tiny_model_test():
    assert {arch for arch, _ in TINY_MODELS.values()} == set(REGISTRY), "add a TINY_MODELS case per registry entry"
    assert set(ROPES) | {"default"} == set(ROPE_KINDS), "add a ROPES case per rotary kind the graph writes"


@pytest.mark.parametrize("case", sorted(TINY_MODELS))
def test_fused_graph_matches_torch(case, tmp_path):
    """Prefill, verify after rollback, a right-padded batch, a batched step and a batched verify, against torch."""
    architecture = TINY_MODELS[case][0]
    arch = REGISTRY[architecture]
    model = _tiny(case, tmp_path)
    decoder, info = _fused(model, tmp_path / "model.onnx")
    report = graph.check_fused_against_torch(model, tmp_path / "model.onnx", info, REGISTRY[architecture].tolerance)
    assert set(report) == {
        "prefill",
        "verify_after_rollback",
        "right_padded_batch",
        "batch_row_2",
        "batched_step",
        "batched_verify",
    }
    assert max(report.values()) < (1e-3 if arch.qk_norm else 1e-4), report  # q/k norms sharpen attention
    ops = _op_counts(tmp_path / "model.onnx")
    assert ops["GroupQueryAttention"] == info.num_layers and "Softmax" not in ops and "Concat" not in ops
    per_layer = (sum(ops.values()) - 6) / info.num_layers  # embedding, final norm, head and its 3-node slice
    # the exported graph has ~86; q/k norms add 7 nodes, Gemma's sandwich norms 2, a longrope switch and the
    # softcaps a few shared ones
    assert per_layer <= 12 + 7 * arch.qk_norm + 2 * arch.sandwich_norms + 4, ops


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rotary_tables_are_transformers_own(kind, tmp_path):
    """The tables equal the model's rotary module's cos/sin (so the check above tests the scaling) and differ from
    unscaled ones within the checked positions."""
    import torch

    model = _tiny(f"LlamaForCausalLM-{kind}", tmp_path)
    table = from_transformers(model, max_context=32).rotary["default"]
    assert table.cos.shape == (34, 8) and table.long is None  # 32 positions + the padding slot; 64 > 32: short
    positions = torch.arange(16)[None]
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(torch.zeros(1, 16, 64), positions)
    assert np.abs(table.cos[:16] - cos[0, :, :8].numpy()).max() < 1e-6
    assert np.abs(table.sin[:16] - sin[0, :, :8].numpy()).max() < 1e-6
    plain = RotaryTable(*graph._rotary_tables(16, 10000.0, 16))
    assert np.abs(table.cos[:16] - plain.cos).max() > 1e-2


def test_longrope_switches_factors_per_call_as_transformers_does(tmp_path):
    """Past original_max_position_embeddings transformers rotates a call's new tokens by the long factors (keys
    already cached keep the short ones); the graph does the same, picked by total_sequence_length."""
    import torch

    model = _tiny("Phi3ForCausalLM", tmp_path, original_max_position_embeddings=8)
    decoder, info = _fused(model, tmp_path / "model.onnx")
    table = decoder.rotary["default"]
    assert table.long is not None and table.switch == 8 and decoder.notes
    assert np.abs(table.long.cos[:12] - table.cos[:12]).max() > 1e-2
    assert from_transformers(model, max_context=8).rotary["default"].long is None  # short factors only
    ids = np.random.default_rng(0).integers(0, 320, (1, 13))
    engine = _engine(tmp_path / "model.onnx", info)
    cache, torch_cache = engine.new_cache(1), None
    for start, end in ((0, 5), (5, 12), (12, 13)):  # totals 5 (short), 12 and 13 (long)
        with torch.no_grad():
            out = model(torch.from_numpy(ids[:, start:end]), cache=torch_cache, use_cache=True)
        torch_cache = out.cache
        got = engine.forward(cache, ids[:, start:end])
        assert np.abs(got - out.logits.numpy()).max() < 1e-4, (start, end)


def test_layers_without_rotary_embedding_skip_it(tmp_path):
    decoder = from_transformers(_tiny("SmolLM3ForCausalLM", tmp_path))
    assert [layer.rope for layer in decoder.layers] == ["default", None]


def test_rotary_tables_follow_the_build_context(tmp_path):
    model = _tiny("Gemma3ForCausalLM", tmp_path)
    decoder = from_transformers(model, max_context=40)
    assert set(decoder.rotary) == {"sliding_attention", "full_attention"}
    assert {t.cos.shape for t in decoder.rotary.values()} == {(42, 8)}
    assert [layer.window for layer in decoder.layers] == [4, 0]
    assert [layer.rope for layer in decoder.layers] == ["sliding_attention", "full_attention"]
    full = from_transformers(model).rotary["full_attention"]
    assert full.cos.shape == (258, 8) and np.array_equal(full.cos[:42], decoder.rotary["full_attention"].cos)


@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize(
    "architecture",
    [
        "Qwen3ForCausalLM",
        "Phi3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "SmolLM3ForCausalLM",
        "GraniteForCausalLM",
        "Olmo2ForCausalLM",
    ],
)
def test_quantized_targets_keep_greedy_speculation_identical(architecture, quant, tmp_path):
    """A whole build (fused graph, the build's checks, quantization) of each family with an int4 or int8 target and
    a 1-layer int4 self-draft that is often wrong: greedy speculative output equals target-only output."""
    from builder.build import build
    from conftest import make_tokenizer
    from runtime.api import SpeculativeGenerator
    from runtime.bundle import BuildSpec

    folder = tmp_path / "target"
    make_tokenizer(folder)
    make_model(folder, tiny_config(architecture), seed=7)
    manifest = build(
        BuildSpec(
            target=str(folder),
            draft="self:layers=1",
            target_quant=quant,
            draft_quant="int4",
            block_size=16,
            k=3,
            max_context=96,
            eval_tokens=EVAL_TOKENS,
        ),
        tmp_path / "bundle",
    )
    # the tiny Phi-3's longrope switches at 64 < 96 tokens: the build says so
    longrope = [n for n in manifest.report["engine_notes"]["target"] if "longrope" in n]
    assert bool(longrope) == (architecture == "Phi3ForCausalLM")
    generator = SpeculativeGenerator.from_bundle(tmp_path / "bundle", threads=1)
    drafted = accepted = 0
    for prompt in ("The quick brown", "def add(a, b):"):
        spec = generator.generate(prompt, max_new_tokens=24, plan=False)  # k every step: rollbacks happen
        assert spec.token_ids == generator.generate(prompt, max_new_tokens=24, mode="target").token_ids
        drafted, accepted = drafted + spec.stats.num_draft_tokens, accepted + spec.stats.num_accepted_tokens
    assert drafted > accepted  # drafts were rejected and rolled back


def test_fused_check_catches_a_wrong_graph(tmp_path):
    model = make_model(tmp_path / "a", tiny_config(), seed=5).eval()
    other = make_model(tmp_path / "b", tiny_config(), seed=6).eval()
    _, info = _fused(other, tmp_path / "other.onnx")
    with pytest.raises(ExportError, match="disagrees with torch"):
        graph.check_fused_against_torch(model, tmp_path / "other.onnx", info, 1e-3)


def test_unsupported_rotary_scaling_is_refused(tmp_path):
    """dynamic NTK recomputes its frequencies from each call's length: no fixed table is right, so it is refused
    with the reason, the kinds the graph has and what to do."""
    config = tiny_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    model = make_model(tmp_path / "m", config, seed=1).eval()
    with pytest.raises(GraphError, match="'dynamic'.*change with the sequence length.*'llama3'.*--graph export"):
        from_transformers(model)


def test_a_rotary_dimension_the_kernel_lacks_is_refused_before_running(tmp_path):
    model = _tiny(
        "Phi3ForCausalLM-default",
        tmp_path,
        partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25},
    )  # 8 of 32 dims rotate
    with pytest.raises(GraphError, match="rotary dimension of 8.*--graph export"):
        from_transformers(model)


def _int4(src, dst):
    from builder.quantize import quantize

    quantize(src, dst, "int4", 32, False, 4)


def _padded_target(tiny_pair, tmp_path, quant: str):
    """The tiny target's fused engine at fp32 or int4, its one-token calls padded to two (min_call_tokens=2)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    _, info = _fused(model, tmp_path / "fp32.onnx")
    path = tmp_path / "fp32.onnx"
    if quant == "int4":
        _int4(path, tmp_path / "int4.onnx")
        path = tmp_path / "int4.onnx"
    return _engine(path, info, min_call_tokens=2)


def _scores(engine, prompt, tokens, one_at_a_time: bool) -> np.ndarray:
    cache = engine.new_cache(1)
    engine.forward(cache, np.array([prompt]))
    if not one_at_a_time:
        return engine.forward(cache, np.array([tokens]))[0]
    return np.stack([engine.forward(cache, np.array([[t]]))[0, 0] for t in tokens])


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_a_verify_call_scores_each_token_as_one_token_calls_do(tiny_pair, tmp_path, quant):
    """Greedy identity rests on this: the target's logits for a token must not depend on how many tokens the call
    carries. Bit for bit at every precision, because a fused target's one-token calls are padded to two
    (min_call_tokens=2) and take the same many-row kernels as a verify call (matmuls and attention alike)."""
    engine = _padded_target(tiny_pair, tmp_path, quant)
    rng = np.random.default_rng(0)
    for _ in range(3):
        prompt, tokens = rng.integers(0, 300, 9).tolist(), rng.integers(0, 300, 5).tolist()
        wide, single = _scores(engine, prompt, tokens, False), _scores(engine, prompt, tokens, True)
        assert np.array_equal(wide, single)


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_a_batched_verify_call_scores_every_row_as_that_row_alone_in_one_run(tiny_pair, tmp_path, quant):
    """Batched verification rests on this: one session run scores every row's own chunk after its own past (a ragged
    batch: the graph's query_lengths), and each row's logits, hidden states and cache are bit for bit those of the
    row's own calls alone, with a row of one token, a row of none and a row of five among them."""
    engine = _padded_target(tiny_pair, tmp_path, quant)
    assert engine.ragged
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 300, n).tolist() for n in (9, 4, 13, 6)]
    chunks = [rng.integers(0, 300, n).tolist() for n in (3, 1, 0, 5)]
    batch = engine.new_cache(4)
    for b, prompt in enumerate(prompts):
        engine.prefill_rows(batch, [b], [prompt])
    runs = []
    session_run = engine.session.run_with_iobinding
    engine.session.run_with_iobinding = lambda binding: runs.append(1) or session_run(binding)
    tokens = np.zeros((4, 5), np.int64)
    valid = np.zeros((4, 5), np.int64)
    for b, chunk in enumerate(chunks):
        tokens[b, : len(chunk)], valid[b, : len(chunk)] = chunk, 1
    logits = engine.forward(batch, tokens, valid)
    hidden = batch.extra["hidden"]
    assert len(runs) == 1 and batch.lengths.tolist() == [12, 5, 13, 11]
    engine.session.run_with_iobinding = session_run
    for b, (prompt, chunk) in enumerate(zip(prompts, chunks)):
        alone = engine.new_cache(1)
        engine.forward(alone, np.array([prompt]))
        if not chunk:
            continue
        want = engine.forward(alone, np.array([chunk]))[0]
        assert np.array_equal(logits[b, : len(chunk)], want)
        assert np.array_equal(hidden[b, : len(chunk)], alone.extra["hidden"][0])
        live = len(prompt) + len(chunk)
        for got, own in zip(batch.past, alone.past):
            assert np.array_equal(got[b, :, :live], own[0, :, :live])


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


@pytest.mark.parametrize("points", [(), (12,)])
def test_last_only_scoring_gives_each_rows_last_logits_and_the_same_cache(tiny_pair, tmp_path, points):
    """forward(last=True) runs the head only at each row's last token (what a drafter reads): the same logits as
    full scoring there, the same hidden states and cache, on a fresh cache (one batched call), on a past (row by row)
    and with calls cut at a class point."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    _, info = _fused(model, tmp_path / "m.onnx")
    engine = _engine(tmp_path / "m.onnx", info, class_points=points)
    rng = np.random.default_rng(1)
    full_cache, last_cache = engine.new_cache(3), engine.new_cache(3)
    for counts in ([9, 4, 1], [3, 0, 6], [1, 1, 1]):
        tokens = rng.integers(0, 300, (3, max(counts)))
        valid = (np.arange(tokens.shape[1])[None] < np.array(counts)[:, None]).astype(np.int64)
        full = engine.forward(full_cache, tokens * valid, valid)
        full_hidden = full_cache.extra["hidden"]
        last = engine.forward(last_cache, tokens * valid, valid, last=True)
        assert last.shape == (3, 1, info.vocab_size)
        for b, n in enumerate(counts):
            if n:
                assert np.abs(last[b, 0] - full[b, n - 1]).max() < 1e-5
                assert np.array_equal(last_cache.extra["hidden"][b, :n], full_hidden[b, :n])
        assert np.array_equal(last_cache.lengths, full_cache.lengths)
        for a, b in zip(last_cache.past, full_cache.past):
            assert np.array_equal(a[:, :, : int(full_cache.lengths.max())], b[:, :, : int(full_cache.lengths.max())])


# GGUF-faithful weights (builder/gguf/weights.py): tests/test_gguf_types.py


def test_profile_reports_per_operator_time_and_node_counts(tiny_bundle):
    from bench.profile import profile_bundle

    report = profile_bundle(tiny_bundle, threads=1, past=8, new=3, calls=4)
    target = report["target"]
    assert target["calls"] == 4 and target["new_tokens"] == 3 and target["mean_call_ms"] > 0
    assert target["ops"]["GroupQueryAttention"]["nodes"] == 2  # one per layer, as stored
    assert target["stored_nodes"]["GroupQueryAttention"] == 2 and "draft" in report


def test_profile_reports_each_call_widths_cost_over_one_tokens_and_the_weight_bytes_read(tiny_bundle):
    from bench.profile import profile_bundle, weight_bytes

    report = profile_bundle(tiny_bundle, threads=1, past=8, new=(1, 2, 4), calls=3)
    target = report["target"]
    assert sorted(target["by_new"]) == [1, 2, 4] and target["ratio"][1] == 1.0
    assert all(target["by_new"][n]["new_tokens"] == n for n in (1, 2, 4))
    assert target["ratio"][4] == round(target["by_new"][4]["mean_call_ms"] / target["by_new"][1]["mean_call_ms"], 3)
    stored = weight_bytes(tiny_bundle / "target" / "model.onnx")
    graph_bytes = (tiny_bundle / "target" / "model.onnx").stat().st_size
    linear = {op: n for op, n in stored.items() if op in ("MatMul", "MatMulNBits", "GgufMatMul")}
    assert linear and all(0 < n <= graph_bytes for n in stored.values())  # the tiny graph holds its weights inline
    assert target["by_new"][1]["weight_bytes"] == stored
