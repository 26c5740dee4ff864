"""Where GroupQueryAttention's CPU arithmetic changes with a call's shape, so that a verify call scores each token
exactly as target-only decoding does.

A row's scores q·k are one SGEMM per head with M = the call's new tokens, K = head dim and N = the row's total length
(its ``seqlens_k`` + 1). Two things in MLAS (onnxruntime/core/mlas/lib/sgemm.cpp, ``MlasSgemmOperation``;
onnxruntime 1.32) make a score's rounding depend on the call:

- a call of one new token takes another kernel than a call of two or more (measured on every CPU tried, head dims 64,
  128 and 256), so a target's one-token calls are padded to two (``FusedEngine.min_call_tokens``);
- MLAS sums K in passes whose width follows N, and which kernels and blockings it picks follows the CPU: at head dim
  256 the totals where the rounding changes (the *points*) were 64, 192, 320, ... (every 128) on an AVX-512 AMD EPYC,
  64, 320, 576, ... (every 256) on an AVX2 Intel CPU (emulated) and none at all on an AVX2 AMD EPYC. A token scored
  in a call whose total lies across a point from the total target-only decoding gives it is ~1e-7 off, and int8
  activation rounding grows that to ~0.2 of a logit over Gemma 3 270M's 18 layers: enough to flip a near tie.

So the points are measured on the CPU that runs the bundle, never derived from rules or carried from another machine:
one GroupQueryAttention node with the engine's head dim and scale scores the same query as the first token of a call
of two and of three new tokens (totals t and t + 1); t is a point where the two differ. Which queries a point touches
depends on where they sit (MLAS sums a product over positions in blocks, and a point changes how the block holding
the query is summed), so the probe puts the query just before t and makes it attend mostly to its own neighbourhood
(``AttentionProbe``). Within two consecutive points every total gives bit-identical results, for every query
(tests/test_attention_classes.py checks it on the CPU it runs on): the engine's cuts rest on that.

Measuring every total up to a 32,768-token context costs minutes (each probe call reads the whole past), so every
total is measured up to ``DENSE_LIMIT``; beyond it, the points the spacing measured there predicts are each checked
and ``SAMPLES`` other totals checked to be none (~5 s at 32,768 on 2 cores). Where that fails, every total is
measured (logged). The points are kept per CPU (vendor, model, ISA flags), onnxruntime version and attention setting
in a small JSON file (``cache_file``), so each later load costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

ATTENTION_ATTRIBUTES = (
    "num_heads",
    "kv_num_heads",
    "do_rotary",
    "rotary_interleaved",
    "local_window_size",
    "scale",
    "softcap",
)
SEEDS = (0,)  # the probe's random draw (a focused probe shows every point with one)
DENSE_LIMIT = 1024  # every total compared with the next up to here (~0.3 s)
SAMPLES = 256  # beyond it: the predicted points and this many other totals checked
CACHE_ENV = "DRAFTSMITH_CACHE_DIR"  # where measured points are kept ("off": not kept)


def attention_settings(proto) -> tuple[tuple, ...]:
    """The distinct GroupQueryAttention attribute sets of a graph, as sorted (name, value) pairs."""
    from onnx import helper

    found = set()
    for node in proto.graph.node:
        if node.op_type == "GroupQueryAttention":
            found.add(
                tuple(
                    sorted(
                        (a.name, helper.get_attribute_value(a))
                        for a in node.attribute
                        if a.name in ATTENTION_ATTRIBUTES
                    )
                )
            )
    return tuple(sorted(found))


@lru_cache(maxsize=8)
def class_points(settings: tuple[tuple, ...], head_dim: int, max_total: int) -> tuple[int, ...]:
    """Totals t (2 <= t <= max_total) at which some layer scores a query with total t + 1 otherwise than with t, on
    this CPU: from the cache file where this CPU's points were measured that far, else measured (and kept)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(dict(attributes), seed) for attributes in settings for seed in SEEDS]
    # a one-head probe runs on the calling thread: the settings (Gemma 3: global and sliding) measure side by side
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        found = pool.map(lambda job: _points_of(job[0], head_dim, max_total, job[1]), jobs)
        return tuple(sorted({point for points in found for point in points}))


def _points_of(attributes: dict, head_dim: int, max_total: int, seed: int) -> list[int]:
    key = _cache_key(attributes, head_dim, seed)
    kept = _read_cache().get(key)
    if kept and int(kept.get("measured_to", 0)) >= max_total:
        return [int(p) for p in kept["points"] if int(p) <= max_total]
    points = measure(attributes, head_dim, max_total, seed)
    _write_cache(key, {"measured_to": max_total, "points": points})
    return points


def measure(
    attributes: dict,
    head_dim: int,
    max_total: int,
    seed: int = 0,
    dense_limit: int = DENSE_LIMIT,
    samples: int = SAMPLES,
) -> list[int]:
    """The points up to ``max_total``: every total up to ``dense_limit``; beyond it, the points the dense range's
    spacing predicts, each checked, and ``samples`` other totals checked to be no point. Where the dense range shows
    no single spacing, or a check fails, every remaining total is measured (slow at long contexts; logged)."""
    probe = AttentionProbe(attributes, head_dim, max_total, seed)
    dense_end = min(dense_limit, max_total)
    points = [t for t in range(2, dense_end + 1) if probe.is_point(t)]
    if dense_end == max_total:
        return points
    gaps = set(np.diff(points[-4:]).tolist())
    period = gaps.pop() if len(points) >= 4 and len(gaps) == 1 else 0
    if points and not period:
        return points + _measure_densely(probe, dense_end + 1, max_total, "the points show no single spacing")
    predicted = list(range(points[-1] + period, max_total + 1, period)) if period else []
    others = np.setdiff1d(np.arange(dense_end + 1, max_total + 1), predicted)
    sampled = np.random.default_rng(seed).choice(others, min(samples, len(others)), replace=False).tolist()
    if all(probe.is_point(t) for t in predicted) and not any(probe.is_point(t) for t in sampled):
        return points + predicted
    return points + _measure_densely(probe, dense_end + 1, max_total, "a point is not where the spacing predicts")


def _measure_densely(probe: "AttentionProbe", first: int, last: int, why: str) -> list[int]:
    logging.getLogger(__name__).warning(
        "measuring GroupQueryAttention's class points at every total from %d to %d "
        "on this CPU (%s); kept for later loads",
        first,
        last,
        why,
    )
    return [t for t in range(first, last + 1) if probe.is_point(t)]


class AttentionProbe:
    """One GroupQueryAttention node over a past built so that every query attends mostly to the last ~50 positions
    before it. A point changes how the products over the query's own block of positions are summed, and with
    attention spread evenly over thousands of positions (random data) that block's share is too small for the change
    to reach an output's rounding: the dense measurement of random data missed one point in three past 2,000 tokens.
    Keys grow along one direction with their position, so a query along it scores recent positions highest; rotary
    embedding and a soft cap (which would bend that ramp) are left out, and one query head is used: they change the
    scores' values, not the products' shapes, which is what a point is about."""

    FOCUS = 0.02  # score gained per position: weights fall by e every 50 positions back
    WIDEST = 16  # the widest call first_output scores

    def __init__(self, attributes: dict, head_dim: int, max_total: int, seed: int):
        import onnxruntime as ort

        from runtime.engines.sessions import make_session

        attributes = {**attributes, "num_heads": 1, "kv_num_heads": 1, "do_rotary": 0, "softcap": 0.0}
        self.slots = max_total + self.WIDEST
        self.session = make_session(probe_model(attributes, head_dim, self.slots))  # points do not follow threads
        rng = np.random.default_rng(seed)
        direction = rng.standard_normal(head_dim)
        direction /= np.linalg.norm(direction)
        scale = float(attributes.get("scale") or 0.0) or head_dim**-0.5
        ramp = self.FOCUS / scale * np.arange(self.slots)
        keys = ramp[:, None] * direction[None] + rng.standard_normal((self.slots, head_dim))
        self.keys = keys.astype(np.float32)[None, None]
        self.values = rng.standard_normal((1, 1, self.slots, head_dim)).astype(np.float32)
        query = direction + 0.1 * rng.standard_normal(head_dim)
        self.query = np.repeat(query[None, None], self.WIDEST, 1).astype(np.float32)
        self.binding = self.session.io_binding()
        self.binding.bind_output("output", "cpu")  # first: get_outputs()[0]
        for name, buffer in (("past_key", self.keys), ("past_value", self.values)):
            value = ort.OrtValue.ortvalue_from_numpy(buffer)
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output(name.replace("past", "present"), value)

    def is_point(self, total: int) -> bool:
        """Whether a query scores otherwise at total ``total`` + 1 than at ``total`` (the first of a call of three
        and of two new tokens: the query sits just before the totals, where a point can touch its rounding)."""
        past = total - 2
        return not np.array_equal(self.first_output(past, 2), self.first_output(past, 3))

    def first_output(self, past: int, width: int) -> np.ndarray:
        """The first new token's output; the new keys and values are the buffers' own rows (written back as they
        are), so the past stays the same pattern whatever was probed before."""
        return score(
            self.session,
            self.binding,
            self.query,
            self.keys[0, :, past : past + width],
            self.values[0, :, past : past + width],
            past,
            width,
        )


def score(session, binding, query, keys, values, past: int, width: int) -> np.ndarray:
    """The output of the first of ``width`` new tokens (``keys``, ``values``) after ``past`` slots (past and present
    share the buffers, as in runtime.engines.fused.FusedEngine)."""
    binding.bind_cpu_input("query", np.ascontiguousarray(query[:, :width]))
    binding.bind_cpu_input("key", np.ascontiguousarray(keys[:, :width]))
    binding.bind_cpu_input("value", np.ascontiguousarray(values[:, :width]))
    binding.bind_cpu_input("seqlens_k", np.array([past + width - 1], np.int32))
    binding.bind_cpu_input("total_sequence_length", np.array(past + width, np.int32))
    binding.bind_output("output", "cpu")  # rebound: its shape follows the width
    session.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()[0, 0].copy()


def probe_model(attributes: dict, head_dim: int, positions: int) -> bytes:
    """One GroupQueryAttention node with the graph's attributes (rotary tables of base 10000 where it rotates)."""
    from onnx import TensorProto, helper, numpy_helper

    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    tables = []
    if attributes.get("do_rotary"):
        angles = np.arange(positions)[:, None] * (10000.0 ** (-np.arange(0, head_dim, 2) / head_dim))[None]
        tables = [
            numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
            numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin"),
        ]
        names += ["cos", "sin"]
    node = helper.make_node(
        "GroupQueryAttention", names, ["output", "present_key", "present_value"], domain="com.microsoft", **attributes
    )
    f = TensorProto.FLOAT
    heads, kv_heads = int(attributes.get("num_heads", 1)), int(attributes.get("kv_num_heads", 1))
    inputs = [helper.make_tensor_value_info("query", f, [1, "s", heads * head_dim])]
    inputs += [helper.make_tensor_value_info(n, f, [1, "s", kv_heads * head_dim]) for n in ("key", "value")]
    inputs += [helper.make_tensor_value_info(n, f, [1, kv_heads, "t", head_dim]) for n in ("past_key", "past_value")]
    inputs += [
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("output", "present_key", "present_value")]
    model = helper.make_model(
        helper.make_graph([node], "probe", inputs, outputs, tables),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
    )
    model.ir_version = 9
    return model.SerializeToString()


@lru_cache(maxsize=1)
def cpu_fingerprint() -> str:
    """What MLAS chooses its kernels by: the CPU's vendor, model and ISA flags, and the onnxruntime version."""
    import platform

    import onnxruntime

    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name in ("vendor_id", "cpu family", "model", "model name", "flags", "Features", "CPU part"):
                fields.setdefault(name, value.strip())
    except OSError:
        pass
    fields["machine"] = platform.machine()
    fields["onnxruntime"] = onnxruntime.__version__
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def cache_file() -> Path | None:
    """The file this CPU's measured points are kept in (None: ``DRAFTSMITH_CACHE_DIR=off``)."""
    root = os.environ.get(CACHE_ENV)
    if root == "off":
        return None
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "draftsmith"
    return base / "attention-classes.json"


def _cache_key(attributes: dict, head_dim: int, seed: int) -> str:
    setting = json.dumps(sorted((k, v) for k, v in attributes.items() if k not in ("num_heads", "kv_num_heads")))
    return f"{cpu_fingerprint()}/{head_dim}/{seed}/{setting}"


def _read_cache() -> dict:
    """The kept points; a missing, unreadable or malformed file is an empty one (it is only a cache)."""
    path = cache_file()
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        k: v
        for k, v in data.items()
        if isinstance(v, dict)
        and isinstance(v.get("points"), list)
        and all(isinstance(p, int) for p in v["points"])
        and isinstance(v.get("measured_to"), int)
    }


_cache_lock = threading.Lock()  # settings measured side by side add their entries one at a time


def _write_cache(key: str, entry: dict) -> None:
    """Add ``entry`` under ``key``, written whole to a temporary file and renamed (a reader never sees half)."""
    path = cache_file()
    if path is None:
        return
    with _cache_lock:
        _replace_cache(path, key, entry)


def _replace_cache(path: Path, key: str, entry: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache()
        data[key] = entry
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
        os.replace(temporary, path)
    except OSError:
        pass  # a read-only home: measured again next time
