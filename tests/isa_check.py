"""The exactness checks of tests/test_attention_classes.py as one script without torch, so that
tests/test_isa_emulation.py can run it under an emulated CPU (qemu-user): ``python isa_check.py INFO_JSON GRAPH...``
(fused graphs of one model: fp32, int8, int4) prints one JSON line {"points": ..., "failures": [...]}."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.engines.attention_classes import AttentionProbe, attention_settings, class_points  # noqa: E402
from runtime.engines.call_checks import call_shape_mismatch, prefill_chunks_differ  # noqa: E402
from runtime.engines.fused import FusedEngine  # noqa: E402


def probe_failures(head_dim: int, settings: tuple) -> list[str]:
    """Between two points a query scores alike at every total; across one it differs."""
    points = np.array(class_points(settings, head_dim, 300), np.int64)
    probe = AttentionProbe(dict(settings[0]), head_dim, 300, seed=7)
    failures = []
    for past in sorted({5, 40, 100, 170, 250, *(points - 3).tolist(), *(points - 2).tolist()}):
        if not 1 <= past <= 290:
            continue
        outs = [probe.first_output(past, width) for width in (2, 3, 5)]
        classes = np.searchsorted(points, past + np.array([2, 3, 5]))
        for i in (1, 2):
            if np.array_equal(outs[i], outs[0]) != (classes[i] == classes[0]):
                failures.append(f"head dim {head_dim}: past {past} width {[2, 3, 5][i]} against points {points}")
    return failures


def last_logits(engine, tokens, prefill: int, step: int) -> np.ndarray:
    cache = engine.new_cache(1)
    engine.prefill(cache, np.array([tokens[:prefill]]))
    i, out = prefill, None
    while i < len(tokens):
        out = engine.forward(cache, np.array([tokens[i : i + step]]))
        i += step
    return out[0, -1]


def engine_failures(path: Path, info: dict) -> tuple[list[int], list[str]]:
    """Verify calls across this CPU's points, a batched step, and the load-time check, on one fused graph."""
    import onnx

    settings = attention_settings(onnx.load(str(path), load_external_data=False))
    points = class_points(settings, info["head_dim"], 203)
    engine = FusedEngine(
        path,
        num_layers=info["num_layers"],
        num_kv_heads=info["num_kv_heads"],
        head_dim=info["head_dim"],
        vocab_size=info["vocab_size"],
        max_context=200,
        threads=1,
        min_call_tokens=2,
        class_points=points,
    )
    failures = []
    mismatch = call_shape_mismatch(engine, info["vocab_size"])
    if mismatch:
        failures.append(f"load-time check: {mismatch}")
    if prefill_chunks_differ(engine, info["vocab_size"]):
        failures.append("a prefill in chunks")
    tokens = np.random.default_rng(0).integers(3, 300, 69).tolist()
    reference = last_logits(engine, tokens, 6, 1)
    for prefill, step in ((6, 2), (5, 3), (6, 4), (60, 5), (62, 7)):
        if not np.array_equal(last_logits(engine, tokens, prefill, step), reference):
            failures.append(f"verify calls of {step} after a prefill of {prefill}")
    rows = np.random.default_rng(1).integers(3, 300, (2, 64))
    cache = engine.new_cache(2)
    engine.prefill(cache, rows[:, :63])
    batched = engine.forward(cache, rows[:, 63:64])
    for b in range(2):
        if not np.array_equal(batched[b, 0], last_logits(engine, rows[b].tolist(), 63, 1)):
            failures.append(f"batched step, row {b}")
    return list(points), failures


def main() -> None:
    info, graphs = json.loads(Path(sys.argv[1]).read_text()), [Path(p) for p in sys.argv[2:]]
    failures = []
    for head_dim in (64, 256):
        failures += probe_failures(
            head_dim,
            (
                (
                    ("do_rotary", 1),
                    ("kv_num_heads", 1),
                    ("local_window_size", -1),
                    ("num_heads", 4),
                    ("rotary_interleaved", 0),
                    ("scale", head_dim**-0.5),
                ),
            ),
        )
    points = []
    for path in graphs:
        points, more = engine_failures(path, info)
        failures += [f"{path.name}: {failure}" for failure in more]
    print(json.dumps({"points": [int(p) for p in points], "failures": failures}))


if __name__ == "__main__":
    main()
