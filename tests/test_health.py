"""/health and /health/live of the OpenAI server (runtime/core/health.py): readiness follows the scheduler's loop
and the engine's fault rate, liveness a longer streak of faults, and both recover after a success or a quiet spell.
The drain's part in them is tested in tests/test_drain.py."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from openai_asgi import MODEL, call  # noqa: E402
from runtime.serving.openai_server import create_app  # noqa: E402
from runtime.core.scheduler import Scheduler  # noqa: E402


def test_health_follows_the_schedulers_loop(tiny_bundle):
    """/health answers from the scheduler's real state: 200 while its loop runs, 503 once it is stopped (or died)."""
    from runtime.api import SpeculativeGenerator

    scheduler = Scheduler(SpeculativeGenerator.from_bundle(tiny_bundle, threads=1), max_batch=1).start()
    app = create_app(scheduler, MODEL)
    assert call(app, "GET", "/health").status_code == 200
    scheduler.stop()
    assert call(app, "GET", "/health").status_code == 503


@pytest.mark.parametrize("with_drain", [False, True])
def test_a_sticky_engine_fault_turns_readiness_then_liveness_off(generator, monkeypatch, with_drain):
    """Every target call fails (ORT out of memory, a CUDA error): after a few requests /health answers 503 with the
    reason, and after a longer streak /health/live too (Kubernetes restarts the pod); before, both said 200."""
    from runtime.serving.drain import Drain

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    for name in ("forward", "prefill_rows", "prefill"):
        monkeypatch.setattr(generator.target, name, broken)
    scheduler = Scheduler(generator, max_batch=2).start()
    app = create_app(scheduler, MODEL, drain=Drain() if with_drain else None)
    try:
        assert call(app, "GET", "/health").status_code == 200
        watch = scheduler.health
        for i in range(watch.live_after):
            response = call(app, "POST", "/v1/completions", json={"model": MODEL, "prompt": f"hi {i}", "max_tokens": 2})
            assert response.status_code == 500
            if i == watch.ready_after - 1:
                ready = call(app, "GET", "/health")
                assert ready.status_code == 503 and "engine" in ready.text
                if with_drain:
                    assert call(app, "GET", "/health/live").status_code == 200  # not yet: a longer streak
        assert call(app, "GET", "/health").status_code == 503
        if with_drain:
            live = call(app, "GET", "/health/live")
            assert live.status_code == 503 and "engine" in live.text
    finally:
        scheduler.stop()


def test_a_fault_watch_recovers_after_a_success_or_a_quiet_spell():
    from runtime.core.health import FaultWatch

    now = [0.0]
    watch = FaultWatch(ready_after=2, live_after=4, retry_after_s=10.0, clock=lambda: now[0])
    assert watch.readiness() is None and watch.liveness() is None
    for _ in range(2):
        watch.failed()
    assert watch.readiness() and watch.liveness() is None
    now[0] = 11.0  # quiet: let traffic try again (a transient fault must not keep the pod out for ever)
    assert watch.readiness() is None
    watch.failed()
    watch.failed()
    assert watch.readiness() and watch.liveness()
    watch.succeeded()
    assert watch.readiness() is None and watch.liveness() is None
