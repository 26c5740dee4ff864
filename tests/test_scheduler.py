"""The in-flight batching scheduler over scripted engines: admission mid-flight, per-row settings and exactness,
cancellation, deadlines, the queue limit, failures."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from door_path import submit
from batch_run import BatchRun
from fakes import BigramEngine, exact_prefixes, random_table, total_variation, tv_bound
from runtime.api import SpeculativeGenerator
from runtime.errors import RequestError
from runtime.core.handles import Overloaded, Unavailable
from runtime.decoding.sampling import SamplingParams, probabilities
from runtime.core.scheduler import Scheduler
from runtime.decoding.config import AdaptiveK, DecodeConfig, Fallback
from runtime.drafters.model import ModelDrafter
from runtime.text.tokenizer import Tokenizer

PROMPTS = ["the cat", "a b c d e f", "hello there, how are", "def f(x):", "one two one two one", "zz"]


@pytest.fixture(scope="module")
def generator(tiny_bundle):
    tokenizer = Tokenizer(tiny_bundle / "tokenizer")
    vocab = tokenizer.vocab_size
    target = BigramEngine(random_table(vocab, 1, scale=3.0), max_context=128)
    draft = BigramEngine(random_table(vocab, 1, scale=3.0) + random_table(vocab, 2, scale=0.7), max_context=128)
    return SpeculativeGenerator(None, target, draft, tokenizer, eos_ids=(2,), max_k=8)


def drain(scheduler: Scheduler) -> int:
    steps = 0
    while scheduler.step():
        steps += 1
    return steps


SETTINGS = [
    dict(k=1),
    dict(k=3, drafter="prompt_lookup"),
    dict(k=4),
    dict(mode="target"),
    dict(k=2, stop=["e"]),
    dict(k=5, max_new_tokens=7),
]


@pytest.mark.parametrize("policy", ["exact", "throughput"])
def test_rows_admitted_mid_flight_get_what_they_get_alone(generator, policy):
    scheduler = Scheduler(generator, max_batch=4, policy=policy)
    scheduler.calibrate()
    options = [{"max_new_tokens": 24, **s} for s in SETTINGS]
    handles = [submit(scheduler, p, **o) for p, o in zip(PROMPTS[:3], options[:3])]
    for _ in range(3):
        scheduler.step()
    handles += [submit(scheduler, p, **o) for p, o in zip(PROMPTS[3:], options[3:])]  # 3 join, 1 waits for a row
    drain(scheduler)
    for prompt, option, handle in zip(PROMPTS, options, handles):
        alone = generator.generate(prompt, **option)
        got = handle.result()
        assert got.token_ids == alone.token_ids and got.text == alone.text, (prompt, option)
        assert got.finish_reason == alone.finish_reason
    stats = scheduler.stats()
    assert stats["admitted"] == stats["finished"] == 6 and stats["running"] == 0


def test_a_new_request_gets_its_first_token_at_the_next_step(generator):
    scheduler = Scheduler(generator, max_batch=4)
    long = submit(scheduler, PROMPTS[0], max_new_tokens=100, k=2)
    for _ in range(5):
        scheduler.step()
    short = submit(scheduler, PROMPTS[1], max_new_tokens=3, k=2)
    scheduler.step()
    first = next(iter(short))
    assert first.token_ids and not first.last  # one step after it arrived
    long.cancel()
    drain(scheduler)


def test_seeded_sampling_does_not_depend_on_the_batch(generator):
    def run(others: int) -> list[int]:
        scheduler = Scheduler(generator, max_batch=8)
        noise = [submit(scheduler, p, max_new_tokens=20, temperature=0.9, k=2) for p in PROMPTS[:others]]
        mine = submit(scheduler, "hello there", max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7, k=3)
        noise += [submit(scheduler, p, max_new_tokens=5, k=1) for p in PROMPTS[others:]]
        drain(scheduler)
        return mine.result().token_ids

    alone = run(0)
    assert run(3) == alone and run(6) == alone
    assert (
        generator.generate("hello there", max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7, k=3).token_ids == alone
    )


@pytest.mark.parametrize("policy", ["exact", "throughput"])
def test_rows_with_different_temperatures_each_follow_their_own_target_law(generator, policy):
    """One batch mixes temperature 1.0 and 0.5 rows, k=3 drafted: each group's first two tokens follow the target's
    law at its own temperature. In "throughput" the costs say one batched call is cheap: every step is batched
    target-only, each row sampling from its own distribution."""
    n = 1500
    no_eos = SpeculativeGenerator(None, generator.target, generator.draft, generator.tokenizer, max_k=8)
    scheduler = Scheduler(no_eos, max_batch=64, max_queue=2 * n, policy=policy)
    if policy == "throughput":
        # one batched call of 64 rows costs little more than one row's; 64 rows of 4 tokens cost far more
        scheduler.costs.call = {(1, 1): 1.0, (1, 4): 1.1, (64, 1): 1.2, (64, 4): 80.0}
    prompt = "the cat"
    start = generator.tokenizer.encode(prompt)[-1]
    groups = {1.0: [], 0.5: []}
    for _ in range(n):
        for temperature, handles in groups.items():
            handles.append(submit(scheduler, prompt, max_new_tokens=4, temperature=temperature, k=3))
    drain(scheduler)
    table = generator.target.table
    for temperature, handles in groups.items():
        law = exact_prefixes(np.stack([probabilities(row, SamplingParams(temperature)) for row in table]), start, 2)
        pairs = np.array([h.result().token_ids[:2] for h in handles])
        observed = np.bincount(pairs[:, 0] * len(table) + pairs[:, 1], minlength=law.size).reshape(law.shape) / n
        assert total_variation(observed, law) < tv_bound(law, n), temperature
        # the pair bound is loose over V^2 cells: the first token's law over V cells, and the second token's law
        # given the commonest first token, are checked much more tightly
        first = law.sum(axis=1)
        assert total_variation(observed.sum(axis=1), first) < tv_bound(first, n), temperature
        top = int(first.argmax())
        given = pairs[pairs[:, 0] == top, 1]
        conditional = law[top] / law[top].sum()
        assert total_variation(np.bincount(given, minlength=len(table)) / len(given), conditional) < tv_bound(
            conditional, len(given)
        ), temperature
    drafted = sum(h.result().stats.num_draft_tokens for h in groups[1.0])
    accepted = sum(h.result().stats.num_accepted_tokens for h in groups[1.0])
    if policy == "exact":
        assert drafted >= 3 * n and 0 < accepted < drafted  # k=3 drafted at the first step, accepted and rejected
    else:
        assert drafted == 0 and scheduler.counters["speculative_steps"] == 0


def test_cancel_frees_the_row_at_the_next_step(generator):
    scheduler = Scheduler(generator, max_batch=2)
    a = submit(scheduler, PROMPTS[0], max_new_tokens=50)
    b = submit(scheduler, PROMPTS[1], max_new_tokens=50)
    scheduler.step()
    a.cancel()
    scheduler.step()
    assert len(scheduler.rows) == 1 and scheduler.cache.batch == 1
    final = [e for e in a if e.last][0]
    assert final.final.finish_reason == "cancelled" and scheduler.stats()["cancelled"] == 1
    c = submit(scheduler, PROMPTS[2], max_new_tokens=4)  # the freed row is reused
    drain(scheduler)
    assert b.result().finish_reason in ("length", "stop")
    assert c.result().token_ids == generator.generate(PROMPTS[2], max_new_tokens=4).token_ids


def test_a_request_past_its_deadline_finishes_with_timeout(generator):
    scheduler = Scheduler(generator)
    handle = submit(scheduler, PROMPTS[0], max_new_tokens=100, timeout=1e-6)
    drain(scheduler)
    assert handle.result().finish_reason == "timeout"


def test_the_queue_limit_and_the_waiting_limit_refuse_with_overloaded(generator):
    scheduler = Scheduler(generator, max_batch=1, max_queue=1, max_wait=0.0)
    submit(scheduler, PROMPTS[0], max_new_tokens=3)
    with pytest.raises(Overloaded, match="retry later"):
        submit(scheduler, PROMPTS[1], max_new_tokens=3)
    scheduler.step()  # the first is admitted; the queue has room again
    waiting = submit(scheduler, PROMPTS[1], max_new_tokens=3)
    scheduler.step()  # no free row, and it has waited longer than max_wait
    with pytest.raises(Overloaded, match="waited"):
        waiting.result()
    drain(scheduler)


def test_bad_requests_fail_at_submit(generator):
    scheduler = Scheduler(generator)
    for bad in (
        dict(k=0),
        dict(max_new_tokens=0),
        dict(drafter="nope"),
        dict(seed=-1),
        dict(timeout=0),
        dict(stop=[""]),
    ):
        with pytest.raises(RequestError):
            submit(scheduler, "hello", **bad)
    assert not scheduler.waiting


def test_an_engine_failure_fails_the_running_rows_and_the_loop_goes_on(generator, monkeypatch):
    scheduler = Scheduler(generator).start(calibrate=False)
    try:
        broken = {"once": True}
        forward = generator.target.forward

        def flaky(*args, **kwargs):
            if broken.pop("once", False):
                raise RuntimeError("boom")
            return forward(*args, **kwargs)

        monkeypatch.setattr(generator.target, "forward", flaky)
        with pytest.raises(Unavailable, match="boom"):
            submit(scheduler, PROMPTS[0], max_new_tokens=5).result()
        assert (
            submit(scheduler, PROMPTS[1], max_new_tokens=5).result().token_ids
            == generator.generate(PROMPTS[1], max_new_tokens=5).token_ids
        )
    finally:
        scheduler.stop()


def test_threads_submit_concurrently_and_stop_fails_what_is_left(generator):
    scheduler = Scheduler(generator, max_batch=3).start()
    results = {}

    def client(i: int) -> None:
        results[i] = submit(scheduler, PROMPTS[i % len(PROMPTS)], max_new_tokens=12, k=1 + i % 4).result()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, got in results.items():
        assert got.token_ids == generator.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=12, k=1 + i % 4).token_ids
    scheduler.stop()
    with pytest.raises(Unavailable):
        submit(scheduler, PROMPTS[0])
    idle = Scheduler(generator)  # never started: what waits when it stops gets an error, not silence
    left = submit(idle, PROMPTS[0], max_new_tokens=5)
    idle.stop()
    with pytest.raises(Unavailable, match="stopping"):
        left.result()


def test_the_plan_stops_drafting_for_a_row_whose_drafts_fail_and_keeps_its_answer(generator):
    vocab = generator.target.vocab_size
    stale = SpeculativeGenerator(
        None,
        generator.target,
        BigramEngine(random_table(vocab, 9, scale=3.0), max_context=128),
        generator.tokenizer,
        max_k=8,
    )
    drafted = {}
    for plan in (False, True):
        scheduler = Scheduler(stale, plan=plan)
        # a draft token must be accepted to pay: each costs a fifth of a call, a call of 5 tokens 1.5 of one
        scheduler.costs.call, scheduler.costs.draft = {(1, 1): 1.0, (1, 2): 1.0, (1, 5): 1.5}, {1: 0.2}
        handle = submit(scheduler, PROMPTS[2], max_new_tokens=60, k=4)
        drain(scheduler)
        result = handle.result()
        assert result.token_ids == stale.generate(PROMPTS[2], max_new_tokens=60, k=4).token_ids
        drafted[plan] = result.stats.num_draft_tokens
    assert drafted[True] < drafted[False] / 3  # it stopped, and probed again now and then
    assert drafted[True] > 4


def test_free_rows_go_first_to_the_clients_holding_the_fewest(generator):
    """One client's burst queued first does not keep another client's request out of the rows."""
    scheduler = Scheduler(generator, max_batch=2)
    burst = [submit(scheduler, PROMPTS[i % 3], max_new_tokens=30, client="a") for i in range(4)]
    other = submit(scheduler, PROMPTS[1], max_new_tokens=30, client="b")
    scheduler.step()
    assert sorted(row.client for row in scheduler.rows) == ["a", "b"]  # not the burst's first two
    drain(scheduler)
    assert other.result().token_ids == generator.generate(PROMPTS[1], max_new_tokens=30).token_ids
    assert all(h.result().finish_reason in ("length", "stop") for h in burst)


def test_a_client_at_its_row_cap_waits_while_rows_stay_free(generator):
    scheduler = Scheduler(generator, max_batch=3, max_rows_per_client=1)
    first = submit(scheduler, PROMPTS[0], max_new_tokens=6, client="a")
    second = submit(scheduler, PROMPTS[1], max_new_tokens=6, client="a")
    scheduler.step()
    assert [row.client for row in scheduler.rows] == ["a"] and len(scheduler.waiting) == 1
    drain(scheduler)
    assert (
        first.result().finish_reason
        and second.result().token_ids == generator.generate(PROMPTS[1], max_new_tokens=6).token_ids
    )
    with pytest.raises(ValueError, match="max_rows_per_client"):
        Scheduler(generator, max_rows_per_client=0)


# --- the loop's control flow over scripted engines (a BatchRun: one group, one drafter) ----------------------


def run_loop(target, draft, prompts, **config):
    loop = BatchRun(target, ModelDrafter(draft) if draft else None, prompts, DecodeConfig(**config))
    steps = list(loop.run())
    return loop, steps


def test_eos_ends_generation():
    table = np.full((5, 5), -5.0)
    table[:, 4] = 5.0  # every token is followed by token 4 (our EOS)
    target = BigramEngine(table)
    loop, _ = run_loop(target, BigramEngine(table), [[1, 2]], max_new_tokens=10, k=3, eos_ids=(4,))
    assert loop.rows[0].generated == [4] and loop.rows[0].finished == "stop"


def test_context_limit_ends_cleanly():
    table = random_table(6, 0)
    target = BigramEngine(table, max_context=12)
    loop, _ = run_loop(target, BigramEngine(table, max_context=12), [[1] * 5], max_new_tokens=50, k=4)
    row = loop.rows[0]
    assert row.finished == "context" and row.total == 12


def test_call_counts_with_a_perfect_draft():
    """A draft identical to the target: every step accepts k and adds a bonus; draft calls are k per step."""
    table = random_table(7, 1)
    target, draft = BigramEngine(table), BigramEngine(table)
    loop, steps = run_loop(target, draft, [[0, 1]], max_new_tokens=21, k=4)
    row = loop.rows[0]
    assert len(row.generated) == 21
    assert row.stats.num_steps == 5  # 4 full steps emit 5 each (20), then one token left: k shrinks to 0
    assert row.stats.num_accepted_tokens == 16 and row.stats.draft_acceptance_rate == 1.0
    assert target.calls == 1 + 5  # prefill + one verify per step
    assert draft.calls == 4 * 4  # k calls per drafting step, nothing in the last step
    assert row.stats.mean_acceptance_length == 5.0


def test_a_useless_draft_still_gives_target_output():
    target_table, draft_table = random_table(7, 1), -random_table(7, 1)  # the draft prefers what the target doesn't
    spec, _ = run_loop(BigramEngine(target_table), BigramEngine(draft_table), [[0, 1]], max_new_tokens=30, k=3)
    plain, _ = run_loop(BigramEngine(target_table), None, [[0, 1]], max_new_tokens=30, k=3)
    assert spec.rows[0].generated == plain.rows[0].generated
    assert spec.rows[0].stats.draft_acceptance_rate < 0.2


def test_draft_cache_matches_emitted_tokens_after_every_step():
    """Rollback keeps exactly the accepted prefix in both caches (the invariant the loop relies on)."""
    target_table = random_table(6, 3)
    draft_table = target_table + np.random.default_rng(4).normal(0, 1.0, target_table.shape)
    target, draft = BigramEngine(target_table), BigramEngine(draft_table)
    drafter = ModelDrafter(draft)
    loop = BatchRun(target, drafter, [[0, 1, 2]], DecodeConfig(max_new_tokens=40, k=3))
    for _ in loop.run():
        row = loop.rows[0]
        seen = draft.live_tokens(drafter.cache, 0) + drafter.pending[0]
        assert seen == row.prompt + row.generated
    assert 0 < loop.rows[0].stats.num_accepted_tokens < loop.rows[0].stats.num_draft_tokens


def test_adaptive_k_grows_on_full_acceptance_and_shrinks_on_rejection():
    table = random_table(7, 1)
    loop = BatchRun(
        BigramEngine(table),
        ModelDrafter(BigramEngine(table)),
        [[0]],
        DecodeConfig(max_new_tokens=60, k=1, adaptive=AdaptiveK(min_k=1, max_k=6)),
    )
    ks = []
    for _ in loop.run():
        ks.append(loop.k)
    assert ks[:3] == [3, 5, 6]
    bad = BatchRun(
        BigramEngine(table),
        ModelDrafter(BigramEngine(-table)),
        [[0]],
        DecodeConfig(max_new_tokens=30, k=5, adaptive=AdaptiveK(min_k=1, max_k=6)),
    )
    for _ in bad.run():
        pass
    assert bad.k == 1


def test_fallback_switches_to_target_only_and_reprobes():
    table = random_table(7, 1)
    draft = BigramEngine(-table)
    loop = BatchRun(
        BigramEngine(table),
        ModelDrafter(draft),
        [[0]],
        DecodeConfig(max_new_tokens=120, k=4, fallback=Fallback(threshold=0.5, window=8, probe_every=10)),
    )
    states = []
    loop.on_fallback = states.append
    plain, _ = run_loop(BigramEngine(table), None, [[0]], max_new_tokens=120, k=4)
    for _ in loop.run():
        pass
    stats = loop.rows[0].stats
    assert states[:3] == [True, False, True]  # fell back, re-probed, fell back again
    assert stats.fallback_steps >= 10
    assert loop.rows[0].generated == plain.rows[0].generated


def test_draft_confidence_stops_drafting_early():
    table = random_table(7, 1, scale=0.01)  # a nearly uniform draft: never confident
    target = BigramEngine(random_table(7, 2))
    drafter = ModelDrafter(BigramEngine(table), confidence=0.5)
    loop = BatchRun(target, drafter, [[0]], DecodeConfig(max_new_tokens=10, k=4))
    for _ in loop.run():
        pass
    assert loop.rows[0].stats.num_draft_tokens == loop.rows[0].stats.num_drafts  # one token per step, not 4
