"""Class points (runtime.attention_classes): GroupQueryAttention at head dim 256 rounds a token's scores by its call's
total, and the engine cuts its calls so that each token is scored as target-only decoding scores it."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_model, tiny_config
from runtime.attention_classes import _probe_model, _score, attention_settings, class_points
from runtime.engine import FusedEngine
from runtime.sessions import make_session

GEMMA3_SETTINGS = ((("do_rotary", 1), ("kv_num_heads", 1), ("local_window_size", -1), ("num_heads", 4),
                    ("rotary_interleaved", 0), ("scale", 0.0625)),)


def test_narrow_heads_have_no_points():
    assert class_points(GEMMA3_SETTINGS, 128, 600) == ()


def test_totals_between_two_points_score_alike_and_across_one_they_differ():
    """The claim the cut rests on: a query's output is a function of which class its call's total falls in."""
    import onnxruntime as ort
    points = np.array(class_points(GEMMA3_SETTINGS, 256, 400))
    assert len(points), "head dim 256 showed no point: the cut would never happen (check this onnxruntime)"
    attributes = dict(GEMMA3_SETTINGS[0])
    session = make_session(_probe_model(attributes, 256, 410))
    rng = np.random.default_rng(7)
    keys, values = (rng.standard_normal((1, 1, 410, 256)).astype(np.float32) for _ in range(2))
    query, new = rng.standard_normal((1, 5, 1024)).astype(np.float32), rng.standard_normal((1, 5, 256)).astype(np.float32)
    binding = session.io_binding()
    binding.bind_output("output", "cpu")
    for name, buffer in (("past_key", keys), ("past_value", values)):
        value = ort.OrtValue.ortvalue_from_numpy(buffer)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(name.replace("past", "present"), value)
    differed = 0
    for past in sorted({*rng.integers(1, 395, 12).tolist(), *(points - 3).tolist(), *(points - 2).tolist()}):
        outs = [_score(session, binding, query, new, past, width) for width in (2, 3, 4, 5)]
        classes = np.searchsorted(points, past + np.arange(2, 6))
        for i in range(1, 4):
            same = np.array_equal(outs[i], outs[0])
            assert same == (classes[i] == classes[0]), (past, i, classes)
            differed += not same
    assert differed


@pytest.fixture(scope="module")
def wide_head_int4(tmp_path_factory):
    """A tiny Gemma 3 with head dim 256 as a fused int4 graph (int8 activations: a target with min_call_tokens 2)."""
    from builder import graph
    from builder.quantize import quantize
    folder = tmp_path_factory.mktemp("wide")
    model = make_model(folder / "m", tiny_config("Gemma3ForCausalLM", head_dim=256, num_key_value_heads=1,
                                                 max_position_embeddings=512), seed=3).eval()
    decoder = graph.from_transformers(model, 200)
    graph.build(decoder, folder / "fp32.onnx", 4)
    quantize(folder / "fp32.onnx", folder / "int4.onnx", "int4", 32, False, 4)
    return folder / "int4.onnx", graph.info_of(decoder)


def _engine(path, info, points) -> FusedEngine:
    return FusedEngine(path, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                       vocab_size=info.vocab_size, max_context=200, threads=1, min_call_tokens=2,
                       class_points=points)


def _last_logits(engine, tokens, prefill: int, step: int) -> np.ndarray:
    cache = engine.new_cache(1)
    engine.prefill(cache, np.array([tokens[:prefill]]))
    i, out = prefill, None
    while i < len(tokens):
        out = engine.forward(cache, np.array([tokens[i:i + step]]))
        i += step
    return out[0, -1]


def test_calls_of_any_shape_score_a_token_as_target_only_across_a_point(wide_head_int4):
    import onnx
    path, info = wide_head_int4
    settings = attention_settings(onnx.load(str(path), load_external_data=False))
    points = class_points(settings, info.head_dim, 203)
    assert 64 in points  # the sequences below cross it
    engine = _engine(path, info, points)
    tokens = np.random.default_rng(0).integers(3, 300, 69).tolist()
    reference = _last_logits(engine, tokens, 6, 1)  # target-only: one token a call (padded to two)
    for prefill, step in ((6, 2), (7, 2), (5, 3), (6, 3), (6, 4), (60, 5), (62, 7)):
        assert np.array_equal(_last_logits(engine, tokens, prefill, step), reference), (prefill, step)


def test_a_batched_step_at_a_point_scores_as_target_only(wide_head_int4):
    """One token per row at length 63: its unpadded total (64) lies across the point from target-only's (65)."""
    path, info = wide_head_int4
    engine = _engine(path, info, class_points(attention_settings(__import__("onnx").load(
        str(path), load_external_data=False)), info.head_dim, 203))
    rng = np.random.default_rng(1)
    rows = [rng.integers(3, 300, 64).tolist(), rng.integers(3, 300, 64).tolist()]
    alone = [_last_logits(engine, row, 63, 1) for row in rows]
    cache = engine.new_cache(2)
    engine.prefill(cache, np.array([row[:63] for row in rows]))
    batched = engine.forward(cache, np.array([[row[63]] for row in rows]))
    for b in range(2):
        assert np.array_equal(batched[b, 0], alone[b])
