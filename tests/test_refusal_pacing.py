"""Refusals answered at a pace (runtime/serving/pacing.py): a client looping on refused requests waits for its
answers, on a clock the test owns; answers that are not refusals, and other clients, are never held."""

from __future__ import annotations

import asyncio

import pytest

from runtime.serving.pacing import RefusalPacer, RefusalPacing, RefusalScores


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_first_refusals_are_free_then_each_waits_longer_up_to_the_cap():
    clock = Clock()
    scores = RefusalScores(RefusalPacing(free=3, window=1.0, delay_per_refusal=0.1, max_delay=0.35), clock)
    delays = [scores.refused("a") for _ in range(8)]  # all at one instant: no decay
    assert delays[:3] == [0.0, 0.0, 0.0]
    assert delays[3:6] == pytest.approx([0.1, 0.2, 0.3])
    assert delays[6:] == [0.35, 0.35]  # capped


def test_a_score_decays_so_a_client_that_stops_is_answered_at_once_again():
    clock = Clock()
    scores = RefusalScores(RefusalPacing(free=2, window=1.0, delay_per_refusal=0.1), clock)
    assert [scores.refused("a") > 0 for _ in range(5)] == [False, False, True, True, True]
    clock.now += 10.0  # ten windows later the score is ~5 e^-10
    assert scores.refused("a") == 0.0


def test_clients_are_scored_apart_and_the_table_is_bounded():
    clock = Clock()
    scores = RefusalScores(RefusalPacing(free=1, delay_per_refusal=0.1, max_clients=2), clock)
    for _ in range(4):
        scores.refused("a")
    assert scores.refused("b") == 0.0  # another client is not held for a's refusals
    scores.refused("c")  # a third client: the least recently refused (a) is forgotten
    assert scores.refused("a") == 0.0


@pytest.mark.parametrize("bad", [dict(free=-1), dict(window=0), dict(max_delay=-1), dict(max_clients=0)])
def test_nonsense_pacing_is_refused(bad):
    with pytest.raises(ValueError, match="refusal pacing"):
        RefusalPacing(**bad)


def _run(pacer, client: str, status: int) -> list[dict]:
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    pacer.app = app
    asyncio.run(pacer({"type": "http", "client": (client, 1234)}, receive, send))
    return sent


def test_the_middleware_holds_refusals_only_and_answers_them_whole():
    slept: list[float] = []

    async def sleep(seconds):
        slept.append(seconds)

    clock = Clock()
    pacer = RefusalPacer(None, RefusalPacing(free=2, delay_per_refusal=0.05), clock=clock, sleep=sleep)
    for _ in range(4):
        assert [m["type"] for m in _run(pacer, "10.0.0.1", 400)] == ["http.response.start", "http.response.body"]
    assert slept == pytest.approx([0.05, 0.1])  # the third and fourth refusals in one instant
    _run(pacer, "10.0.0.1", 200)  # an answer that is not a refusal: never held, not counted
    _run(pacer, "10.0.0.2", 429)  # another client's first refusal: free
    assert slept == pytest.approx([0.05, 0.1])
    _run(pacer, "2001:db8::1", 400)
    _run(pacer, "2001:db8::2", 400)
    _run(pacer, "2001:db8::3", 400)  # one IPv6 /64 is one client
    assert slept[-1] == pytest.approx(0.05)
