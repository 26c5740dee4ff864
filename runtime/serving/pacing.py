"""Refusals answered at a pace: a client whose requests keep being refused waits before each refusal reaches it.

A refused request (a 4xx: a response_format past its bound, a bad key, a full queue) costs the server little, but a
client that sends them back to back costs it a request's parsing and checking each time: on a 2-core machine one such
loop made ~440 refusals a second and doubled the gaps of 16 streams beside it. Each client (the address the scheduler
shares rows by: ``client_key``, a trusted proxy's X-Forwarded-For) has a score, its refusals decayed over ``window``
seconds; past ``free`` refusals, each further one's answer is held ``delay_per_refusal`` seconds for every refusal over
``free`` (at most ``max_delay``), on the event loop's timer, which costs nothing while it waits. A looping client then
sends about 1 / delay requests a second per connection; answers that are not refusals are never held, so a client that
shares an address with one stays at full speed. nginx's ``limit_req`` and fail2ban's back-off do the same job by rate.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from runtime.serving.connections import client_key


@dataclass(frozen=True)
class RefusalPacing:
    """How refusals are paced (``free`` refusals per ``window`` seconds answered at once)."""

    free: float = 8.0
    window: float = 1.0
    delay_per_refusal: float = 0.05
    max_delay: float = 2.0
    max_clients: int = 16384  # scores kept (the least recently refused forgotten first): memory stays bounded

    def __post_init__(self):
        delays = (self.delay_per_refusal, self.max_delay)
        if self.free < 0 or self.window <= 0 or min(delays) < 0 or self.max_clients < 1:
            raise ValueError(f"refusal pacing needs free >= 0, window > 0, delays >= 0 and max_clients >= 1: {self}")


class RefusalScores:
    """Each client's refusals, decayed exponentially over ``window`` seconds (one float and a time a client)."""

    def __init__(self, pacing: RefusalPacing, clock=time.monotonic):
        self.pacing, self.clock = pacing, clock
        self._scores: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def refused(self, client: str) -> float:
        """Count one refusal of ``client``; returns how long its answer waits (seconds)."""
        now = self.clock()
        score, since = self._scores.pop(client, (0.0, now))
        score = score * math.exp(-(now - since) / self.pacing.window) + 1.0
        self._scores[client] = (score, now)
        while len(self._scores) > self.pacing.max_clients:
            self._scores.popitem(last=False)
        over = score - self.pacing.free
        return min(self.pacing.max_delay, over * self.pacing.delay_per_refusal) if over > 0 else 0.0


class RefusalPacer:
    """Pure ASGI, outermost: holds the start of a 4xx answer for the delay its client's score asks for."""

    def __init__(self, app, pacing: RefusalPacing | None = None, clock=time.monotonic, sleep=asyncio.sleep):
        self.app, self.sleep = app, sleep
        self.scores = RefusalScores(pacing or RefusalPacing(), clock)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        peer = scope.get("client")
        client = client_key(peer[0]) if peer else ""

        async def paced(message):
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500:
                delay = self.scores.refused(client)
                if delay > 0:
                    await self.sleep(delay)
            await send(message)

        await self.app(scope, receive, paced)
