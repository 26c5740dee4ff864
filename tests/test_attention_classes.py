"""Class points (runtime.engines.attention_classes) and the call shapes the engine uses: a token's logits must not
depend on
the call that scores it, on whatever CPU the suite runs. Every test here asserts that property against the points
this CPU measures; none assumes another CPU's points (an AVX-512 AMD EPYC shows them every 128 tokens at head dim
256, an AVX2 Intel every 256, an AVX2 AMD EPYC none). tests/test_isa_emulation.py runs the same checks under
emulated AVX2 CPUs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from isa_check import last_logits
from runtime.engines import attention_classes
from runtime.engines.attention_classes import AttentionProbe, attention_settings, class_points, measure
from runtime.engines.call_checks import call_shape_mismatch, prefill_chunks_differ
from runtime.engines.fused import FusedEngine


def settings_of(head_dim: int, window: int = -1) -> tuple[tuple, ...]:
    """Gemma 3's attention attributes at ``head_dim`` (one KV head, four query heads, rotary)."""
    return (
        (
            ("do_rotary", 1),
            ("kv_num_heads", 1),
            ("local_window_size", window),
            ("num_heads", 4),
            ("rotary_interleaved", 0),
            ("scale", head_dim**-0.5),
        ),
    )


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_totals_between_two_points_score_alike_and_across_one_they_differ(head_dim):
    """The claim the engine's cuts rest on: for any query, its output is a function of which class its call's total
    falls in (calls of two or more tokens), whatever this CPU's points are, none included."""
    points = np.array(class_points(settings_of(head_dim), head_dim, 420), np.int64)
    probe = AttentionProbe(dict(settings_of(head_dim)[0]), head_dim, 420, seed=7)
    rng = np.random.default_rng(7)
    pasts = {*rng.integers(1, 395, 16).tolist(), *(points - 3).tolist(), *(points - 2).tolist()}
    differed = 0
    for past in sorted(p for p in pasts if 1 <= p <= 410):
        outs = [probe.first_output(past, width) for width in (2, 3, 4, 5, 9)]
        classes = np.searchsorted(points, past + np.array([2, 3, 4, 5, 9]))
        for i in range(1, len(outs)):
            same = np.array_equal(outs[i], outs[0])
            assert same == (classes[i] == classes[0]), (past, i, classes, points)
            differed += not same
    assert differed or not len(points)  # where this CPU has points, the sampled calls crossed some


def test_the_sparse_measurement_finds_every_point_a_dense_one_does():
    """Beyond DENSE_LIMIT only predicted points and a sample are probed: here it must agree with probing every
    total (head dim 256, a sliding window and none)."""
    for window in (-1, 512):
        attributes = dict(settings_of(256, window)[0])
        dense = measure(attributes, 256, 2200, dense_limit=2200)
        assert measure(attributes, 256, 2200, dense_limit=1024) == dense


def test_rotary_windows_and_head_counts_do_not_move_the_points():
    """The probe leaves rotary and soft caps out and uses one query head: on this CPU the graph's own settings
    show the same points (probed densely on random data of their own)."""

    def points_with(attributes):
        probe = AttentionProbe(attributes, 256, 300, seed=1)
        return [t for t in range(2, 300) if probe.is_point(t)]

    base = dict(settings_of(256)[0])
    assert (
        points_with(base)
        == points_with({**base, "local_window_size": 64})
        == points_with({**base, "do_rotary": 0, "num_heads": 2})
    )


def test_measured_points_are_kept_per_cpu_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv(attention_classes.CACHE_ENV, str(tmp_path))
    class_points.cache_clear()
    both = settings_of(256) + settings_of(256, window=512)  # measured side by side, each kept
    first = class_points(both, 256, 700)
    kept = json.loads((tmp_path / "attention-classes.json").read_text())
    assert [entry["measured_to"] for entry in kept.values()] == [700, 700]
    assert all(key.startswith(attention_classes.cpu_fingerprint()) for key in kept)
    class_points.cache_clear()
    monkeypatch.setattr(attention_classes, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert class_points(both, 256, 600) == tuple(p for p in first if p <= 600)
    class_points.cache_clear()


def test_a_damaged_cache_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv(attention_classes.CACHE_ENV, str(tmp_path))
    (tmp_path / "attention-classes.json").write_text('{"x": {"points": ["64"], "measured_to": 1e9}, "y": [')
    class_points.cache_clear()
    assert class_points(settings_of(256), 256, 300) == tuple(measure(dict(settings_of(256)[0]), 256, 300))
    class_points.cache_clear()


def _engine(path, info, points=None) -> FusedEngine:
    import onnx

    if points is None:
        settings = attention_settings(onnx.load(str(path), load_external_data=False))
        points = class_points(settings, info.head_dim, 203)
    return FusedEngine(
        path,
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        vocab_size=info.vocab_size,
        max_context=200,
        threads=1,
        min_call_tokens=2,
        class_points=points,
    )


def test_calls_of_any_shape_score_a_token_as_target_only(wide_head_int4):
    """Prefills and verify calls of every width, across this CPU's first point where it has one (64 or beyond:
    the sequences run to 69 and 140)."""
    path, info = wide_head_int4
    engine = _engine(path, info)
    for length, shapes in (
        (69, ((6, 2), (7, 2), (5, 3), (6, 3), (6, 4), (60, 5), (62, 7))),
        (140, ((100, 8), (127, 13), (129, 11))),
    ):
        tokens = np.random.default_rng(length).integers(3, 300, length).tolist()
        reference = last_logits(engine, tokens, 6, 1)  # target-only: one token a call (padded to two)
        for prefill, step in shapes:
            assert np.array_equal(last_logits(engine, tokens, prefill, step), reference), (length, prefill, step)


@pytest.mark.parametrize("length", [63, 64, 100])
def test_a_batched_step_scores_as_target_only(wide_head_int4, length):
    """One token per row: a batched call would take the one-query kernels, so the engine pads it to target-only's
    shape (row by row) unless asked for exact=False."""
    path, info = wide_head_int4
    engine = _engine(path, info)
    rng = np.random.default_rng(length)
    rows = [rng.integers(3, 300, length + 1).tolist(), rng.integers(3, 300, length + 1).tolist()]
    alone = [last_logits(engine, row, length, 1) for row in rows]
    cache = engine.new_cache(2)
    engine.prefill(cache, np.array([row[:length] for row in rows]))
    batched = engine.forward(cache, np.array([[row[length]] for row in rows]))
    for b in range(2):
        assert np.array_equal(batched[b, 0], alone[b])


def test_the_load_time_check_passes_here_and_its_exact_form_matches_target_only(wide_head_int4):
    path, info = wide_head_int4
    engine = _engine(path, info)
    assert call_shape_mismatch(engine, info.vocab_size) is None  # verify calls, batched steps, ragged verify calls
    assert not prefill_chunks_differ(engine, info.vocab_size)  # a server's chunked prefill
    tokens = np.random.default_rng(5).integers(3, 300, 20).tolist()
    reference = last_logits(engine, tokens, 6, 1)
    engine.one_token_calls = True  # the form a CPU that fails the check gets: verify calls one token at a time
    assert np.array_equal(last_logits(engine, tokens, 6, 7), reference)


def test_a_failed_check_switches_to_the_exact_form_and_says_so_once(caplog, tmp_path, monkeypatch):
    from runtime.engines import loading

    class Differing:
        vocab_size, one_token_calls, prefills_in_chunks = 300, False, True

    monkeypatch.setattr(loading, "call_shape_mismatch", lambda engine, vocab: "a verify call of 4 tokens")
    monkeypatch.setattr(loading, "prefill_chunks_differ", lambda engine, vocab: True)

    engines = [Differing(), Differing()]
    with caplog.at_level("WARNING", logger="draftsmith"):
        for engine in engines:
            loading.check_call_shapes(engine, tmp_path / "bundle")
    assert all(engine.one_token_calls and not engine.prefills_in_chunks for engine in engines)
    said = [r.getMessage() for r in caplog.records if "scores a token otherwise" in r.getMessage()]
    assert len(said) == 1 and "a verify call of 4 tokens" in said[0] and str(tmp_path / "bundle") in said[0]
