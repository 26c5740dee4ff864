"""Graceful shutdown of the OpenAI server (runtime/serving/drain.py): the drain state on a fake clock, and two real
server processes under load with one stopped by SIGTERM mid-run (bench/drain_openai.py; Triton's:
bench/drain_triton.py), where no request may be lost."""

from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from conftest import has_tritonserver  # noqa: E402
from runtime.serving.drain import Drain  # noqa: E402 - after the skips: it needs uvicorn


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_drain_refuses_new_work_at_once_and_waits_for_running_requests():
    clock = Clock()
    drain = Drain(timeout=30, linger=2, clock=clock)
    assert drain.enter() and drain.enter() and drain.inflight == 2
    assert not drain.finished()
    drain.begin()
    assert drain.draining and not drain.enter()  # refused: not counted
    assert drain.inflight == 2
    clock.now += 5
    drain.leave()
    assert not drain.finished()  # one request still running
    drain.leave()
    assert drain.finished()


def test_drain_lingers_even_when_idle_and_gives_up_at_the_timeout():
    clock = Clock()
    drain = Drain(timeout=10, linger=3, clock=clock)
    drain.begin()
    clock.now += 2.9
    assert not drain.finished()  # idle, but the balancer may not know yet
    clock.now += 0.2
    assert drain.finished()
    drain = Drain(timeout=10, linger=3, clock=clock)
    assert drain.enter()
    drain.begin()
    clock.now += 9.9
    assert not drain.finished()
    clock.now += 0.2
    assert drain.finished()  # the request overran: stop anyway (the pod's grace period would kill it)
    drain.begin()  # a second SIGTERM changes nothing
    assert drain.finished()


@pytest.mark.parametrize("timeout,linger,retry_after", [(0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 1, 0)])
def test_bad_drain_settings_are_refused_by_name(timeout, linger, retry_after):
    with pytest.raises(ValueError, match="drain: expected timeout > 0"):
        Drain(timeout=timeout, linger=linger, retry_after=retry_after)


def test_sigterm_under_load_loses_no_request(tiny_bundle, tmp_path):
    """Two replicas, load spread over both, SIGTERM to one mid-run: every request answered (a refused one was
    retried on the other replica and answered there), none lost or cut short; the stopped one exits 0. The 5-run
    figure: python -m bench.drain BUNDLE --repetitions 5."""
    from bench.drain_openai import run_drain

    report = run_drain(tiny_bundle, repetitions=1, duration=5.0, sigterm_after=1.5, log_dir=tmp_path)
    run = report["runs"][0]
    assert run["sent"] > 0 and run["lost"] == 0 and run["truncated"] == 0, run
    assert run["answered"] == run["sent"]
    assert run["victim_inflight_at_sigterm"] >= 2  # the signal came while the victim had a full batch and a queue...
    assert run["answered_by_victim_after_sigterm"] >= 1  # ...and that work finished after it
    assert run["probe_after_sigterm"] == {"status": 503, "retry_after": "1"}
    assert run["victim_exit_code"] == 0
    assert "drained (0 requests still in flight)" in run["victim_stop_line"]
    assert run["victim_stop_line"].endswith("idle: stopping")  # it stopped once its work was done, not out of time


@pytest.mark.triton
@pytest.mark.skipif(not has_tritonserver(), reason="needs nvidia-pytriton's tritonserver")
def test_triton_sigterm_unloads_then_exits_without_losing_a_request(tiny_bundle, generator, tmp_path):
    """``draftsmith serve`` under load, SIGTERM: the requests running finish in full (the runtime's own greedy text),
    the ensemble's readiness turns false at once, later requests are refused before any work, the command exits 0."""
    from bench.drain_triton import triton_drain_once
    from triton_repo.generate import RepoOptions, write_repository

    repo = write_repository(tiny_bundle, tmp_path / "repo", RepoOptions(threads=1, max_batch_size=4))
    prompts = ("The quick brown fox", "def add(a, b):", "for i in range(10):")
    reference = {p: generator.generate(p, max_new_tokens=24).text for p in prompts}
    run = triton_drain_once(repo, reference, clients=6, linger=1.0, max_tokens=24, log_dir=tmp_path)
    assert run["lost"] == 0 and set(run["outcomes"]) <= {"answered", "refused"}, run
    assert run["answered_after_sigterm"] >= 1  # in flight at the signal, and answered in full afterwards
    assert run["model_ready_0_5_s_after_sigterm"] != 200
    assert run["exit_code"] == 0
    assert "drained: every model unloaded" in (tmp_path / "serve.log").read_text()  # not stopped at the timeout


def test_a_drainable_triton_restricts_the_model_repository_api():
    """Unloading models must not be open to every client: the caller's restriction is reused when it covers the
    model-repository API, else a random header is added that only the TritonServer knows."""
    from triton_repo.server import _drain_restriction

    theirs = ["statistics:admin-key=one", "model-repository,model-config:admin-key=two"]
    assert _drain_restriction(theirs) == (theirs, ("admin-key", "two"))
    specs, header = _drain_restriction(["statistics:admin-key=one"])
    again = _drain_restriction([])[1]
    assert header[0] == "draftsmith-drain" and len(header[1]) == 32 and header[1] != again[1]
    assert specs == ["statistics:admin-key=one", f"model-repository:draftsmith-drain={header[1]}"]


def test_health_and_refusals_of_a_draining_app(generator):
    """In process: readiness follows the drain and the scheduler's loop, liveness only the loop; a completion
    request while draining is refused with 503, Retry-After and Connection: close, in OpenAI's error shape."""
    import asyncio

    from runtime.serving.openai_server import create_app
    from runtime.core.scheduler import Scheduler

    scheduler = Scheduler(generator, max_batch=2).start()
    drain = Drain(timeout=5, linger=0)
    app = create_app(scheduler, "tiny", api_key="k", drain=drain)

    async def calls():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            before = [(await client.get(path)).status_code for path in ("/health", "/health/live")]
            drain.begin()
            ready, live = await client.get("/health"), await client.get("/health/live")
            body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
            refused = await client.post("/v1/completions", json=body)  # no key: refused before the key check
            scheduler.stop()
            after = [(await client.get(path)).status_code for path in ("/health", "/health/live")]
            return before, ready, live, refused, after

    before, ready, live, refused, after = asyncio.run(calls())
    assert before == [200, 200]
    assert ready.status_code == 503 and ready.headers["retry-after"] == "1" and live.status_code == 200
    assert refused.status_code == 503 and refused.headers["connection"] == "close"
    assert refused.json()["error"]["code"] == "server_shutting_down" and drain.inflight == 0
    assert after == [503, 503]  # the loop is gone: not ready, and not alive either
