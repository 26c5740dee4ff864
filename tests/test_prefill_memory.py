"""A prompt's prefill holds a chunk's logits, never S x V of them, on every engine; and a request whose own prefill
fails (a prompt too big for the memory left) is that request's 400, never an engine fault that makes the server
unready.

Before: the exported graph (``--graph export``, every CUDA bundle) and the TensorRT-LLM adapter had no prefill of
their own, so a prompt was fed in one call that scored every position (a 32k-token prompt: ~6 GB of fp32 logits
for SmolLM2's vocabulary, and S x S attention scores per head), a drafter's first call the same again; and three
such requests failing made /health answer 503. ``Recording`` wraps an engine's ONNX Runtime session (the engine's
public ``session``) and records the positions of every call."""

from __future__ import annotations

import numpy as np
import pytest

from door_path import submit
from runtime.decoding.calls import last_logits, prefill
from runtime.decoding.sampling import SamplingParams
from runtime.engines.onnx import OnnxEngine

CHUNK = 16  # prefill_positions in these tests: prompts are several chunks long


class Recording:
    """An ONNX Runtime session that records the [B, S] shape of every call's input_ids."""

    def __init__(self, session):
        self.session, self.shapes = session, []

    def run_with_ort_values(self, names, feed):
        self.shapes.append(tuple(feed["input_ids"].shape()))
        return self.session.run_with_ort_values(names, feed)

    def __getattr__(self, name):
        return getattr(self.session, name)

    @property
    def widest(self) -> int:
        """The most positions (rows x tokens) one call took."""
        return max(b * s for b, s in self.shapes)


@pytest.fixture(scope="module")
def export_generator(tiny_export_bundle):
    from runtime.api import SpeculativeGenerator

    return SpeculativeGenerator.from_bundle(tiny_export_bundle, threads=1)


@pytest.fixture
def engines(export_generator):
    """The export bundle's target and draft, each with a recording session and CHUNK-position prefill calls."""
    saved = []
    for engine in (export_generator.target, export_generator.draft):
        assert isinstance(engine, OnnxEngine)
        saved.append((engine, engine.session, vars(engine).get("prefill_positions")))
        engine.session, engine.prefill_positions = Recording(engine.session), CHUNK
    yield export_generator.target, export_generator.draft
    for engine, session, positions in saved:
        engine.session, engine.prefill_positions = session, positions


def prompt_ids(generator, words: int = 40) -> list[int]:
    return generator.tokenizer.encode(" ".join(["speculative decoding keeps the target's output"] * words))[:100]


def test_an_export_engines_prefill_takes_a_chunk_a_call_and_leaves_the_same_cache(export_generator, engines):
    target, _ = engines
    ids = prompt_ids(export_generator)
    assert len(ids) == 100
    cache = target.new_cache(1)
    prefill(target, cache, [ids[:-1]])
    assert target.session.widest <= CHUNK, target.session.shapes  # before: one call of 99 positions
    assert int(cache.lengths[0]) == 99
    chunked = target.forward(cache, np.array([ids[-1:]]))[0, 0]
    whole = target.forward(target.new_cache(1), np.array([ids]))[0, -1]  # one call: the reference
    np.testing.assert_allclose(chunked, whole, atol=1e-4)


def test_a_batch_prefill_keeps_each_rows_last_logits_and_bounds_rows_times_tokens(export_generator, engines):
    target, _ = engines
    ids = prompt_ids(export_generator)
    chunks = [ids, ids[:37], ids[:5]]
    got = last_logits(target, target.new_cache(3), chunks)
    assert got.shape == (3, target.vocab_size)
    assert target.session.widest <= CHUNK
    for row, chunk in zip(got, chunks):
        want = target.forward(target.new_cache(1), np.array([chunk]))[0, -1]
        np.testing.assert_allclose(row, want, atol=1e-4)


def test_a_drafters_first_call_on_a_long_prompt_takes_a_chunk_a_call(export_generator, engines):
    _, draft = engines
    drafter = export_generator.new_drafter("speculative", "model", None)
    drafter.start([prompt_ids(export_generator)])
    proposal = drafter.propose([3], SamplingParams(), [None])
    assert len(proposal.tokens[0]) == 3
    assert draft.session.widest <= CHUNK, draft.session.shapes  # before: the whole prompt's logits


def test_the_schedulers_joined_admission_is_chunked_and_greedy_output_is_unchanged(export_generator, engines):
    """Three prompts admitted together (``_prefill_joined`` over the export graph) in chunks; each answer is the
    target-only greedy answer."""
    from runtime.core.scheduler import Scheduler

    target, _ = engines
    prompts = ["The quick brown fox " * 9, "def add(a, b):\n" * 6, "Speculative decoding " * 7]
    want = [export_generator.generate(p, mode="target", max_new_tokens=6).token_ids for p in prompts]
    target.session.shapes.clear()
    scheduler = Scheduler(export_generator, max_batch=4, plan=False)
    handles = [submit(scheduler, p, max_new_tokens=6) for p in prompts]
    while scheduler.step():
        pass
    assert [h.result().token_ids for h in handles] == want
    assert target.session.widest <= CHUNK, target.session.shapes


def test_the_trtllm_engines_prefill_runs_nothing_and_the_first_step_sends_the_whole_prompt(generator):
    """A TensorRT-LLM engine sends a row's whole history with every request (the executor reuses its cached
    blocks): a prefill only records the tokens, and the row's first step is one request carrying all of them."""
    from runtime.trtllm.engine import ExecutorEngine
    from test_engine_contract import RecordingSession

    session = RecordingSession()
    engine = ExecutorEngine(session, vocab_size=generator.target.vocab_size, max_context=128, verifies=True)
    ids = generator.encode_prompt("The quick brown fox jumps over the lazy dog", False)
    cache = engine.new_cache(1)
    prefill(engine, cache, [ids[:-1]])
    assert session.requests == [] and cache.lengths.tolist() == [len(ids) - 1]
    engine.generate_tokens(cache, [ids[-1:]], [[]], [4])
    assert session.requests == [(ids, [], 1)]


# --- a request's own failure is not the engine's --------------------------------------------------------------------

httpx = pytest.importorskip("httpx")

from openai_asgi import call  # noqa: E402  (after the skip: it needs httpx)


@pytest.mark.parametrize("graph", ["fused", "export"])
def test_prompts_too_big_for_the_memory_left_are_400s_and_the_server_stays_ready(
    generator, export_generator, monkeypatch, graph
):
    """Long prompts whose prefill raises MemoryError (the machine's memory, not the engine, is short for them): each
    is a 400 naming the prompt's size, /health and /health/live stay 200 after more of them than make a server
    unready, and a short prompt is served. Before: each was a 500, and three made /health 503."""
    from runtime.serving.drain import Drain
    from runtime.serving.openai_server import create_app
    from runtime.core.scheduler import Scheduler

    gen = generator if graph == "fused" else export_generator
    engine = gen.target
    real = engine.prefill_rows

    def short_of_memory(cache, rows, chunks):
        if max(len(chunk) for chunk in chunks) > 30:
            raise MemoryError("Unable to allocate 9.4 GiB for an array")
        return real(cache, rows, chunks)

    monkeypatch.setattr(engine, "prefill_rows", short_of_memory)
    scheduler = Scheduler(gen, max_batch=2, prefill_chunk=None).start(calibrate=False)
    app = create_app(scheduler, "tiny", drain=Drain())
    try:
        for i in range(scheduler.health.live_after + 1):
            long = {"model": "tiny", "prompt": f"{i} " + "The quick brown fox jumps. " * 4, "max_tokens": 2}
            response = call(app, "POST", "/v1/completions", json=long)
            assert response.status_code == 400, response.text
            assert "memory" in response.json()["error"]["message"]
        assert call(app, "GET", "/health").status_code == 200
        assert call(app, "GET", "/health/live").status_code == 200
        short = call(app, "POST", "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert short.status_code == 200
    finally:
        scheduler.stop()
