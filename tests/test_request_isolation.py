"""One request must never fail the others: the real fused engines under the scheduler, near the context limit, with
rows that draft different k, the cost model on a feature draft, and padding that does not depend on the batch."""

from __future__ import annotations

import numpy as np
import pytest

from door_path import submit
from runtime.engines.fused import FusedEngine
from runtime.core.scheduler import Scheduler

LINE = "for i in range(10): print(i * i)\n"


def prompt_of(generator, tokens: int) -> str:
    """A prompt string that encodes to exactly ``tokens`` ids (the tiny tokenizer round-trips)."""
    ids = generator.tokenizer.encode(LINE * 40)[:tokens]
    text = generator.tokenizer.decode(ids)
    assert len(generator.encode_prompt(text, False)) == tokens
    return text


def drain(scheduler: Scheduler) -> None:
    while scheduler.step():
        pass


def fused(generator) -> FusedEngine:
    engine = getattr(generator.target, "engine", generator.target)
    assert isinstance(engine, FusedEngine)
    return engine


def test_per_row_reservation_counts_each_rows_own_chunk(generator):
    """Row 0 sits 2 slots below the context and adds one token; row 1 is short and adds five. Each fits; the old
    reservation (longest row + widest chunk) refused the call."""
    engine = fused(generator)
    limit = engine.max_context
    cache = engine.new_cache(2)
    engine.forward(
        cache,
        np.ones((2, limit - 2), np.int64),
        (np.arange(limit - 2)[None, :] < np.array([[limit - 2], [4]])).astype(np.int64),
    )
    tokens = np.ones((2, 5), np.int64)
    valid = np.array([[1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    logits = engine.forward(cache, tokens, valid)
    assert logits.shape[:2] == (2, 5) and list(cache.lengths) == [limit - 1, 9]
    with pytest.raises(ValueError, match="context"):  # a row that really would overflow is still refused
        engine.forward(cache, np.ones((2, 5), np.int64), np.array([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]))


@pytest.mark.parametrize("policy", ["exact", "throughput"])
def test_a_request_at_the_context_limit_does_not_fail_one_drafting_k4(generator, policy):
    near = prompt_of(generator, generator.max_context - 6)
    scheduler = Scheduler(generator, max_batch=4, policy=policy)
    if policy == "throughput":
        scheduler.calibrate()
    options = [dict(max_new_tokens=64, k=1), dict(max_new_tokens=40, k=4), dict(max_new_tokens=40, k=8)]
    prompts = [near, "def add(a, b):", "The quick brown"]
    handles = [submit(scheduler, p, **o) for p, o in zip(prompts, options)]
    drain(scheduler)
    results = [h.result() for h in handles]  # raises if any failed
    assert results[0].finish_reason == "context"
    for prompt, option, got in zip(prompts, options, results):
        if policy == "exact":
            alone = generator.generate(prompt, **option)
            assert got.token_ids == alone.token_ids


def test_a_lone_row_verifies_no_padding_beyond_the_engines_own(generator):
    """At k=1 a lone row's verify call is [last, x1]: two tokens, not three."""
    engine = fused(generator)
    widths = []

    def observe(call):
        widths.append(call.session_width)  # what ONNX Runtime ran, the engine's own padding included

    scheduler = Scheduler(generator, max_batch=2)
    handle = submit(scheduler, "def add(a, b):", max_new_tokens=12, k=1)
    scheduler.step()  # admission (the prefill) and a first step
    engine.watch(observe)
    try:
        drain(scheduler)
    finally:
        engine.unwatch(observe)
    handle.result()
    assert widths and max(widths) == 2


def test_the_scheduler_leaves_the_engines_settings_alone(generator, monkeypatch):
    """Made and stepped through two requests: every target call runs with the engines' own settings."""
    engine = fused(generator)

    def settings() -> list:
        return [getattr(getattr(e, "engine", e), "min_call_tokens", None) for e in (generator.target, generator.draft)]

    before, seen, forward = settings(), [], engine.forward
    scheduler = Scheduler(generator, max_batch=2)
    handles = [submit(scheduler, p, max_new_tokens=8, k=2) for p in ("def add(a, b):", "The quick brown")]
    monkeypatch.setattr(engine, "forward", lambda *a, **kw: seen.append(settings()) or forward(*a, **kw))
    drain(scheduler)
    assert all(handle.result().token_ids for handle in handles)
    assert seen and all(during == before for during in seen) and settings() == before
    assert engine.min_call_tokens == 2  # a fused target pads one-token calls at every precision


def test_an_error_in_one_rows_drafter_retires_that_row_only(generator, monkeypatch):
    scheduler = Scheduler(generator, max_batch=4)
    bad = submit(scheduler, "def add(a, b):", max_new_tokens=16, k=2)
    good = submit(scheduler, "The quick brown", max_new_tokens=16, k=2)
    scheduler.step()
    row = next(r for r in scheduler.rows if r.handle is bad.handle)

    def broken(*args, **kwargs):
        raise RuntimeError("drafter broke")

    monkeypatch.setattr(row.drafter, "propose", broken)
    drain(scheduler)
    with pytest.raises(Exception, match="drafter broke"):
        bad.result()
    assert good.result().token_ids == generator.generate("The quick brown", max_new_tokens=16, k=2).token_ids


def test_a_full_queue_refuses_before_tokenizing(generator, monkeypatch):
    from runtime.core.handles import Overloaded

    scheduler = Scheduler(generator, max_batch=1, max_queue=1)
    submit(scheduler, "def add(a, b):", max_new_tokens=4)
    calls = []
    monkeypatch.setattr(generator.tokenizer, "encode", lambda *a: calls.append(a) or [1, 2])
    with pytest.raises(Overloaded):
        submit(scheduler, "x" * 10_000, max_new_tokens=4)
    assert not calls


@pytest.mark.parametrize("field", ["prompt", "stop", "messages"])
def test_a_lone_surrogate_is_a_request_error_naming_the_field(generator, field):
    from runtime.errors import RequestError

    scheduler = Scheduler(generator, max_batch=1)
    options = {
        "prompt": dict(prompt="ab\ud800c"),
        "stop": dict(prompt="ok", stop=["\udfff"]),
        "messages": dict(prompt=[{"role": "user", "content": "hi \ud83d"}], chat=True),
    }[field]
    with pytest.raises(RequestError, match=f"{field}: not valid Unicode"):
        submit(scheduler, options.pop("prompt"), max_new_tokens=4, **options)


def test_a_subnormal_temperature_samples_greedily_not_nan(generator):
    got = generator.generate("def add(a, b):", max_new_tokens=8, temperature=5e-324, seed=1)
    assert got.token_ids == generator.generate("def add(a, b):", max_new_tokens=8).token_ids


def test_the_batch_cache_is_reserved_once_and_requests_never_grow_it(generator):
    """The scheduler reserves max_batch rows of the whole context at start (written, so the memory is taken then);
    prompts near the limit and short ones join, prefill in place and leave, and the buffers are never replaced,
    while every answer stays what it is alone (a row's prefill makes the calls a lone request's does)."""
    engine = fused(generator)
    scheduler = Scheduler(generator, max_batch=3)
    buffers = [id(b) for b in scheduler.cache.past]
    assert scheduler.cache.past[0].shape[0] == 3 and scheduler.cache.past[0].shape[2] >= engine.max_context
    near = prompt_of(generator, generator.max_context - 12)
    prompts = [near, "def add(a, b):", near, "The quick brown", "x", near]
    handles = [submit(scheduler, p, max_new_tokens=24, k=1 + i % 3) for i, p in enumerate(prompts)]
    while scheduler.step():
        assert [id(b) for b in scheduler.cache.past] == buffers
    for i, (prompt, handle) in enumerate(zip(prompts, handles)):
        assert handle.result().token_ids == generator.generate(prompt, max_new_tokens=24, k=1 + i % 3).token_ids
    assert scheduler.cache.batch == 0 and [id(b) for b in scheduler.cache.past] == buffers


def test_a_batch_cache_larger_than_the_memory_is_refused_at_start_by_name(generator, monkeypatch):
    import runtime.engines.fused

    monkeypatch.setattr(runtime.engines.fused, "available_memory_bytes", lambda: 1 << 20)
    with pytest.raises(MemoryError, match="--max-batch"):
        Scheduler(generator, max_batch=64)


@pytest.mark.parametrize("policy", ["exact", "throughput"])
def test_every_running_row_is_verified_in_one_target_call_a_step(generator, policy):
    """Batched verification in the server: four rows drafting different k (one not at all) share one target call
    per step, and each answer is what the request gets alone."""
    engine = fused(generator)
    scheduler = Scheduler(generator, max_batch=4, policy=policy, plan=False)  # every row drafts its k
    options = [dict(k=1), dict(k=3), dict(k=4), dict(mode="target")]
    prompts = ["def add(a, b):", "The quick brown", "for i in range(3):", "x = 1"]
    handles = [submit(scheduler, p, max_new_tokens=12, **o) for p, o in zip(prompts, options)]
    scheduler.step()  # admits and prefills all four
    runs = []
    session_run = engine.session.run_with_iobinding
    engine.session.run_with_iobinding = lambda binding: runs.append(1) or session_run(binding)
    try:
        steps = 0
        while scheduler.rows and all(not row.finished for row in scheduler.rows) and steps < 4:
            scheduler.step()
            steps += 1
    finally:
        engine.session.run_with_iobinding = session_run
    assert steps and len(runs) == steps  # one session run per step, whatever each row drafted
    drain(scheduler)
    for prompt, option, handle in zip(prompts, options, handles):
        assert handle.result().token_ids == generator.generate(prompt, max_new_tokens=12, **option).token_ids


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode(generator):
    """Chunked prefill: a 90-token prompt admitted into a running batch is prefilled 16 tokens a step, each chunk
    inside the step's own target call (one session run a step, no call of its own); the running request gets a token
    at every one of those steps, and both answers are what the requests get alone (a prompt prefilled in chunks
    leaves the same cache)."""
    engine = fused(generator)
    scheduler = Scheduler(generator, max_batch=4, prefill_chunk=16)
    running = submit(scheduler, "def add(a, b):", max_new_tokens=40, k=2)
    scheduler.step()
    long_prompt = prompt_of(generator, 90)
    late = submit(scheduler, long_prompt, max_new_tokens=8, k=3)
    left, runs, got = [], [], []
    session_run = engine.session.run_with_iobinding
    engine.session.run_with_iobinding = lambda binding: runs.append(1) or session_run(binding)
    try:
        for _ in range(6):  # 89 prompt tokens to prefill: 16 a step, from the step that admits it
            before = len(scheduler.rows[0].generated)
            scheduler.step()
            got.append(len(scheduler.rows[0].generated) - before)
            left.append(len(scheduler.rows[1].prefill_left))
    finally:
        engine.session.run_with_iobinding = session_run
    assert left == [73, 57, 41, 25, 9, 0] and all(n > 0 for n in got)  # the running row never waited
    assert len(runs) == 6  # one call a step, the chunk in it
    drain(scheduler)
    assert running.result().token_ids == generator.generate("def add(a, b):", max_new_tokens=40, k=2).token_ids
    assert late.result().token_ids == generator.generate(long_prompt, max_new_tokens=8, k=3).token_ids


def test_the_auto_chunk_keeps_the_step_call_within_its_gap_bound(generator):
    """prefill_chunk="auto": the largest chunk whose call, as one more row of the step's, costs at most CHUNK_GAP
    times the call without it on the measured costs (the bound's floor where even the smallest does not fit)."""
    from runtime.core.prefill import CHUNK_BOUNDS, CHUNK_GAP

    scheduler = Scheduler(generator, max_batch=4)
    scheduler.costs = generator.step_costs(4)
    sizes = [scheduler.prefill.chunk(n) for n in (1, 2, 3)]
    assert all(CHUNK_BOUNDS[0] <= c <= CHUNK_BOUNDS[1] for c in sizes)
    width = max(scheduler.padding, 2)
    for n, c in zip((1, 2, 3), sizes):
        alone = scheduler.costs.call_cost([width] * n)
        assert c == CHUNK_BOUNDS[0] or scheduler.costs.call_cost([width] * n + [c]) <= CHUNK_GAP * alone
        assert c == CHUNK_BOUNDS[1] or scheduler.costs.call_cost([width] * n + [c + 1]) > CHUNK_GAP * alone
    assert scheduler.prefill.chunk(0) == CHUNK_BOUNDS[1]  # nobody decodes: nobody waits on a step


def test_a_throughput_batch_asks_for_unpadded_calls_and_leaves_the_engine_as_it_was(generator):
    """policy="throughput" over a batch (Python API, bench): every decode call asks the target for unpadded kernels
    (``exact=False``, per call), "exact" asks for lone-call kernels throughout, and the engine itself never changes
    (its min_call_tokens stays 2: nothing about a call is set on a shared engine)."""
    engine = fused(generator)
    generator.step_costs(2)  # measured first (its own calls, both padded and unpadded)
    seen = []
    engine.watch(seen.append)
    try:
        prompts = ["def add(a, b):", "The quick brown"]
        fast = generator.generate(prompts, max_new_tokens=10, k=2, policy="throughput")
        throughput, seen[:] = list(seen), []
        exact = generator.generate(prompts, max_new_tokens=10, k=2)
    finally:
        engine.unwatch(seen.append)
    decoding = [c for c in throughput if c.kind == "forward"]
    assert decoding and not any(c.exact for c in decoding)
    assert all(c.exact for c in seen if c.kind == "forward") and engine.min_call_tokens == 2
    assert all(r.token_ids for r in fast) and all(r.token_ids for r in exact)


def test_one_failing_admission_fails_only_its_own_request(generator, monkeypatch):
    engine = generator.target
    real = engine.prefill_rows
    poison = generator.encode_prompt("poison pill", False)[:-1]

    def picky(cache, rows, chunks):
        if any(list(map(int, chunk)) == poison for chunk in chunks):
            raise MemoryError("this request's prefill ran out of memory")
        return real(cache, rows, chunks)

    monkeypatch.setattr(engine, "prefill_rows", picky)
    scheduler = Scheduler(generator, max_batch=4)
    handles = [submit(scheduler, p, max_new_tokens=3) for p in ("hello there", "poison pill", "The quick")]
    while scheduler.step():
        pass
    assert handles[0].result().token_ids and handles[2].result().token_ids
    with pytest.raises(Exception, match="admission failed"):
        handles[1].result()
