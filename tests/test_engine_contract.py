"""The runtime's Engine contract (runtime/engines/base.py), run for every backend, and the guard that keeps its
capabilities declared rather than probed.

onnxruntime-fused: the tiny bundle's target engine (the fused CPU graph, builder/graph.py; the default).
onnxruntime-int4: the tiny int4 bundle's target (fused, int8 activations, one-token calls padded to two).
onnxruntime-export: the torch-exported graph (builder/export.py) of the same pair.
onnxruntime-fp16: the tiny pair built for CUDA (fp16 engines), run on the CPU with the cache in an IO binding, as the
    GPU runs it (looser tolerance: fp16 activations).
onnxruntime-cuda: the same engine on CUDAExecutionProvider; skipped, with the reason shown, without onnxruntime-gpu.

TensorRT-LLM's engines return tokens, not logits (runtime/engines/tokens.py): their bookkeeping (whole histories,
the step's invariant, rollback, select, join) is checked below over a recording executor; their decoding under the
scheduler in tests/test_trtllm_runtime.py, and on a GPU by scripts/gpu_check.sh.
"""

from __future__ import annotations


import numpy as np
import pytest

from runtime.bundle import load_manifest
from runtime.engines.base import Engine, EngineWrapper
from runtime.decoding.sampling import RowSampling, SamplingParams
from runtime.engines.onnx import engine_class
from test_drafter_contract import PACKAGES, ROOT, capability_probes

ATOL = 2e-4


def onnx_engine(bundle, **options):
    manifest = load_manifest(bundle, verify=False)
    entry = manifest.target
    if entry.graph == "fused":
        options["min_call_tokens"] = entry.min_call_tokens
    return engine_class(entry.graph)(
        bundle / entry.engine,
        num_layers=entry.num_layers,
        num_kv_heads=entry.num_kv_heads,
        head_dim=entry.head_dim,
        vocab_size=entry.vocab_size,
        max_context=manifest.max_context,
        threads=1,
        **options,
    )


def tolerance(engine) -> float:
    if engine.min_call_tokens > 1:
        return 5e-2  # int8 activations: a call's rows are rounded together
    return 3e-2 if getattr(engine, "dtype", None) == np.float16 else ATOL


@pytest.fixture(
    params=["onnxruntime-fused", "onnxruntime-int4", "onnxruntime-export", "onnxruntime-fp16", "onnxruntime-cuda"]
)
def engine(request):
    bundles = {
        "onnxruntime-fused": "tiny_bundle",
        "onnxruntime-int4": "tiny_int4_bundle",
        "onnxruntime-export": "tiny_export_bundle",
    }
    if request.param in bundles:
        return onnx_engine(request.getfixturevalue(bundles[request.param]))
    import onnxruntime

    from runtime.engines.sessions import providers_for

    device = "cpu" if request.param == "onnxruntime-fp16" else "cuda"
    if device == "cuda" and "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip(
            "onnxruntime-cuda: this onnxruntime has no CUDAExecutionProvider (pip install onnxruntime-gpu "
            "on a GPU machine; scripts/gpu_check.sh)"
        )
    return onnx_engine(
        request.getfixturevalue("tiny_cuda_bundle"), cache_device=device, providers=providers_for(device)
    )


def tokens(rng, batch, width, high=300):
    return rng.integers(3, high, size=(batch, width)).astype(np.int64)


def test_new_cache_is_empty(engine):
    cache = engine.new_cache(3)
    assert cache.batch == 3 and cache.lengths.tolist() == [0, 0, 0]


def test_forward_with_past_returns_batch_by_new_positions_by_vocab(engine):
    rng = np.random.default_rng(0)
    cache = engine.new_cache(2)
    first = engine.forward(cache, tokens(rng, 2, 5))
    second = engine.forward(cache, tokens(rng, 2, 3))
    assert first.shape == (2, 5, engine.vocab_size) and second.shape == (2, 3, engine.vocab_size)
    assert np.isfinite(second).all()
    assert cache.lengths.tolist() == [8, 8]


def test_incremental_forward_equals_one_pass(engine):
    rng = np.random.default_rng(1)
    ids = tokens(rng, 2, 9)
    whole = engine.forward(engine.new_cache(2), ids)
    cache = engine.new_cache(2)
    parts = [engine.forward(cache, ids[:, :4]), engine.forward(cache, ids[:, 4:5]), engine.forward(cache, ids[:, 5:])]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), whole, atol=tolerance(engine))


def test_rollback_then_forward_equals_a_fresh_run(engine):
    rng = np.random.default_rng(2)
    prefix, rejected, replacement = tokens(rng, 2, 6), tokens(rng, 2, 4), tokens(rng, 2, 3)
    cache = engine.new_cache(2)
    engine.forward(cache, prefix)
    engine.forward(cache, rejected)
    keep = np.array([7, 6])  # row 0 keeps one drafted token, row 1 none
    engine.rollback(cache, keep)
    assert cache.lengths.tolist() == [7, 6]
    after = engine.forward(cache, replacement)
    for row in range(2):
        history = np.concatenate([prefix[row], rejected[row]])[: keep[row]]
        fresh = engine.forward(engine.new_cache(1), np.concatenate([history, replacement[row]])[None])
        np.testing.assert_allclose(after[row], fresh[0, -3:], atol=tolerance(engine))


def test_padding_is_ignored(engine):
    rng = np.random.default_rng(3)
    ids = tokens(rng, 2, 4)
    valid = np.array([[1, 1, 1, 1], [1, 1, 0, 0]])
    cache = engine.new_cache(2)
    logits = engine.forward(cache, ids * valid, valid)
    assert cache.lengths.tolist() == [4, 2]
    alone = engine.forward(engine.new_cache(1), ids[1:, :2])
    np.testing.assert_allclose(logits[1, :2], alone[0], atol=tolerance(engine))
    nxt = tokens(rng, 2, 1)
    step = engine.forward(cache, nxt)
    fresh = engine.forward(engine.new_cache(1), np.concatenate([ids[1, :2], nxt[1]])[None])
    np.testing.assert_allclose(step[1, 0], fresh[0, -1], atol=tolerance(engine))


def test_select_keeps_the_chosen_rows(engine):
    rng = np.random.default_rng(4)
    ids = tokens(rng, 3, 5)
    cache = engine.new_cache(3)
    engine.forward(cache, ids)
    picked = engine.select(cache, np.array([2, 0]))
    assert picked.batch == 2 and picked.lengths.tolist() == [5, 5]
    nxt = tokens(rng, 2, 2)
    out = engine.forward(picked, nxt)
    for i, row in enumerate((2, 0)):
        fresh = engine.forward(engine.new_cache(1), np.concatenate([ids[row], nxt[i]])[None])
        np.testing.assert_allclose(out[i], fresh[0, -2:], atol=tolerance(engine))


class RecordingSession:
    """An ExecutorSession stand-in: records each request's input, draft and max_tokens; answers with the draft, all
    accepted, then 100 + the input's length (or max_tokens such tokens)."""

    def __init__(self):
        self.requests = []

    def generate(self, histories, max_tokens, drafts):
        self.requests += [(list(h), list(d), m) for h, d, m in zip(histories, drafts, max_tokens)]
        return [
            (d + [100 + len(h)])[:m] if d else [100 + len(h) + i for i in range(m)]
            for h, d, m in zip(histories, drafts, max_tokens)
        ]


def test_an_engine_that_returns_tokens_sends_whole_histories_and_keeps_the_steps_invariant():
    """A TensorRT-LLM engine's cache is each row's token ids, sent whole with every request (the executor reuses
    their cached blocks): a prefill records them, a step's call sends history + last token with the draft to
    verify, and the cache then holds all the row emitted but its last token, with lengths and mask to match."""
    from runtime.trtllm.engine import ExecutorEngine

    session = RecordingSession()
    engine = ExecutorEngine(session, vocab_size=200, max_context=64, verifies=True)
    cache, _ = engine.admit_rows(engine.new_cache(0), [[5, 6, 7], [8, 9]])
    assert session.requests == [] and cache.lengths.tolist() == [3, 2]
    out = engine.generate_tokens(cache, [[1], [2]], [[50, 51], []], [8, 8])
    assert out == [[50, 51, 104], [103]]  # the draft accepted and the target's own token; a lone token
    assert session.requests == [([5, 6, 7, 1], [50, 51], 3), ([8, 9, 2], [], 1)]
    assert cache.extra["tokens"] == [[5, 6, 7, 1, 50, 51], [8, 9, 2]] and cache.lengths.tolist() == [6, 3]
    assert cache.mask.sum(axis=1).tolist() == [6, 3]
    # room for one token: the draft is cut (the executor returns the draft and one more); none: no request
    assert engine.generate_tokens(cache, [[1], [2]], [[60], []], [1, 0]) == [[107], []]
    assert session.requests[-1] == ([5, 6, 7, 1, 50, 51, 1], [], 1) and len(session.requests) == 3
    engine.rollback(cache, np.array([4, 2]))
    assert cache.extra["tokens"] == [[5, 6, 7, 1], [8, 9]]
    picked = engine.join(engine.select(cache, np.array([1])), engine.new_cache(1))
    assert picked.extra["tokens"] == [[8, 9], []] and picked.lengths.tolist() == [2, 0]
    with pytest.raises(TypeError, match="returns tokens, not logits"):
        engine.forward(cache, np.array([[1], [2]]))
    seen = EngineWrapper(engine)  # a wrapper is the engine it wraps, its token calls included
    assert seen.returns_tokens and seen.speculation == "verifies" and not seen.samples
    assert seen.generate_tokens(cache, [[3], [4]], [[], []], [1, 1]) == [[105], [103]]
    sampled = [RowSampling(SamplingParams(0.8), 5), None]  # an engine that decodes greedily takes no sampled row
    with pytest.raises(TypeError, match="decodes greedily"):
        seen.generate_tokens(cache, [[3], [4]], [[], []], [1, 1], sampled)


def test_join_appends_rows_that_continue_as_if_alone(engine):
    rng = np.random.default_rng(5)
    first, second = tokens(rng, 2, 6), tokens(rng, 1, 3)
    cache = engine.new_cache(2)
    engine.forward(cache, first)
    other = engine.new_cache(1)
    engine.forward(other, second)
    joined = engine.join(engine.select(cache, np.array([1])), other)  # a retired row, then an admitted one
    assert joined.batch == 2 and joined.lengths.tolist() == [6, 3]
    nxt = tokens(rng, 2, 1)
    out = engine.forward(joined, nxt)
    for i, history in enumerate((first[1], second[0])):
        fresh = engine.forward(engine.new_cache(1), np.concatenate([history, nxt[i]])[None])
        np.testing.assert_allclose(out[i, 0], fresh[0, -1], atol=tolerance(engine))


def test_the_last_position_alone_is_what_the_whole_call_scores_there(engine):
    """``last=True`` (a drafter's read): each row's logits at its last valid token, as the full call scores them."""
    rng = np.random.default_rng(6)
    ids = tokens(rng, 2, 5)
    valid = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    whole = engine.forward(engine.new_cache(2), ids * valid, valid)
    last = engine.forward(engine.new_cache(2), ids * valid, valid, last=True)
    assert last.shape == (2, 1, engine.vocab_size)
    for row, at in enumerate((4, 2)):
        np.testing.assert_allclose(last[row, 0], whole[row, at], atol=tolerance(engine))


def test_admitted_rows_continue_as_if_alone_and_the_running_rows_are_untouched(engine):
    """``admit_rows`` (a scheduler's admission): new rows after the running ones, each prefilled with its prompt
    (one with none yet), then a step over all of them scores each row as its own history alone does."""
    rng = np.random.default_rng(7)
    running = tokens(rng, 1, 6)
    cache = engine.new_cache(1)
    engine.forward(cache, running)
    prompts = [tokens(rng, 1, 4)[0].tolist(), []]
    cache, states = engine.admit_rows(cache, prompts)
    assert cache.batch == 3 and cache.lengths.tolist() == [6, 4, 0] and len(states) == 2
    nxt = tokens(rng, 3, 1)
    out = engine.forward(cache, nxt)
    for row, history in enumerate((running[0].tolist(), prompts[0], prompts[1])):
        fresh = engine.forward(engine.new_cache(1), np.array([history + [int(nxt[row, 0])]]))
        np.testing.assert_allclose(out[row, 0], fresh[0, -1], atol=tolerance(engine))


def test_every_call_is_reported_to_the_engines_observers_until_they_leave(engine):
    seen = []
    engine.watch(seen.append)
    try:
        cache = engine.new_cache(2)
        engine.prefill(cache, tokens(np.random.default_rng(8), 2, 3))
        engine.forward(cache, tokens(np.random.default_rng(9), 2, 1), exact=False)
        engine.admit_rows(cache, [tokens(np.random.default_rng(12), 1, 3)[0].tolist(), []])
    finally:
        engine.unwatch(seen.append)
    engine.forward(engine.new_cache(1), tokens(np.random.default_rng(10), 1, 1))
    assert [(c.kind, c.rows, c.width, c.first, c.exact) for c in seen[:2]] == [
        ("prefill", 2, 3, True, True),
        ("forward", 2, 1, False, False),
    ]
    assert [(c.kind, c.rows, c.width) for c in seen[2:]] == [("prefill_rows", 1, 3)]  # the row given a prompt
    assert all(c.seconds >= c.session_seconds >= 0 for c in seen)


def test_a_call_that_is_not_exact_leaves_the_next_exact_call_as_it_was(engine):
    """Exactness is a call's (``forward(..., exact=False)``: the "throughput" policy), never the engine's state: an
    exact one-token call scores the same before and after an unpadded one on the same engine (a padded target's
    kernels differ between the two, so a switch left on the engine would show)."""
    ids = tokens(np.random.default_rng(11), 1, 5)

    def exact_step() -> np.ndarray:
        cache = engine.new_cache(1)
        engine.prefill(cache, ids[:, :4])
        return engine.forward(cache, ids[:, 4:])

    before = exact_step()
    cache = engine.new_cache(1)
    engine.prefill(cache, ids[:, :4])
    engine.forward(cache, ids[:, 4:], exact=False)
    np.testing.assert_array_equal(exact_step(), before)


ENGINE_CAPABILITIES = {name for name in vars(Engine) if not name.startswith("_")} | {
    "engine",
    "scores_last",
    "prefill_row",
}


def test_no_engine_capability_is_probed():
    """Every capability is declared on runtime.engines.base.Engine with its default and read as it is: no
    ``hasattr``/``getattr`` of one anywhere in the packages (and no reaching into a wrapper for its engine)."""
    probes = [
        f"{path.relative_to(ROOT)}:{line} probes {name!r}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name in capability_probes(path.read_text(encoding="utf-8"), ENGINE_CAPABILITIES)
    ]
    assert probes == [], "declare the capability on runtime.engines.base.Engine and read it:\n" + "\n".join(probes)


ENGINE_MODULES = (
    "runtime.engines.onnx",
    "runtime.engines.mapped",
    "runtime.trtllm.engine",
    "runtime.trtllm.llmapi",
    "bench.tree",
)
# the base class's calls, observed
OBSERVED = ("forward", "prefill", "prefill_rows", "generate_tokens", "watch", "unwatch", "_observed")
REQUIRED = ("new_cache", "compute", "rollback", "select", "join")


def engine_classes() -> list[type]:
    """Every subclass of Engine the packages and the test fakes define."""
    import importlib

    for name in (*ENGINE_MODULES, "fakes", "prefix_fakes", "test_feature_draft"):
        importlib.import_module(name)
    found, todo = [], [Engine]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def test_every_engine_implements_the_contract_and_leaves_its_calls_to_the_base_class():
    """Each engine of the packages (ONNX plain and fused, the reduced-head wrapper, TensorRT-LLM's executor and LLM
    API engines, the bench's recorder) implements the cache methods and ``compute`` (``compute_tokens`` too where it
    returns tokens); none, fakes included, redefines a public call, so every call reaches the observers (the Triton
    model's counter, the bench's timings)."""
    classes = engine_classes()
    names = {cls.__name__ for cls in classes}
    engines = ("OnnxEngine", "FusedEngine", "MappedVocabEngine", "ExecutorEngine", "LlmApiEngine", "BigramEngine")
    assert {*engines, "PrefixEngine"} <= names
    for cls in classes:
        assert not set(OBSERVED) & set(vars(cls)), f"{cls.__qualname__} redefines {set(OBSERVED) & set(vars(cls))}"
        if cls.__module__.split(".")[0] in PACKAGES:
            required = REQUIRED + (("compute_tokens",) if cls.returns_tokens else ())
            missing = [name for name in required if getattr(cls, name) is getattr(Engine, name)]
            assert missing == [], f"{cls.__qualname__} leaves {missing} to the base class, which only raises"


def test_the_engine_guard_sees_a_probe():
    source = (
        'pad = getattr(target, "min_call_tokens", 1)\nif hasattr(engine, "prefill_rows"):\n'
        '    inner = getattr(e, "engine", e)'
    )
    assert capability_probes(source, ENGINE_CAPABILITIES) == [
        (1, "min_call_tokens"),
        (2, "prefill_rows"),
        (3, "engine"),
    ]
