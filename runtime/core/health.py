"""What the OpenAI server's probes report: whether its scheduler can serve, read from the engine's recent faults.

A loop thread that is alive is not enough: a sticky engine fault (ONNX Runtime out of memory on every call, a CUDA
error) leaves the thread running while every request fails. ``FaultWatch`` counts the engine failures in a row
(a step's shared target call; an admission whose prefills all failed when the engine then fails a one-token call
too: runtime/core/scheduler.py ``engine_answers``; never one request's own failure, a prompt too big for the
memory left included, so a client cannot make the pod unready with poison requests): readiness turns false after
``ready_after`` of them (the balancer sends traffic elsewhere), liveness after ``live_after`` (Kubernetes restarts
the pod). One success clears both. Readiness also comes back after ``retry_after_s`` without a new fault, so a
transient fault does not keep an unready pod out of rotation for ever (it gets traffic again; a sticky fault then
fails again at once).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

READY_AFTER = 3  # engine failures in a row that make the server unready
LIVE_AFTER = 12  # ... and not live (a restart is worth it)
RETRY_AFTER_S = 30.0  # seconds without a new fault after which an unready server takes traffic again


class FaultWatch:
    """Engine failures in a row, and when the last one was; thread-safe (the scheduler's thread writes, the
    probes read)."""

    def __init__(
        self,
        ready_after: int = READY_AFTER,
        live_after: int = LIVE_AFTER,
        retry_after_s: float = RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 1 <= ready_after <= live_after or retry_after_s <= 0:
            raise ValueError(
                f"expected 1 <= ready_after <= live_after and retry_after_s > 0, received "
                f"{ready_after}, {live_after}, {retry_after_s}"
            )
        self.ready_after, self.live_after, self.retry_after_s = ready_after, live_after, retry_after_s
        self.clock = clock
        self.streak, self.last, self.total = 0, 0.0, 0
        self._lock = threading.Lock()

    def failed(self) -> None:
        with self._lock:
            self.streak += 1
            self.total += 1
            self.last = self.clock()

    def succeeded(self) -> None:
        with self._lock:
            self.streak = 0

    def readiness(self) -> str | None:
        """Why the server should take no traffic now (None: it may)."""
        with self._lock:
            streak, quiet = self.streak, self.clock() - self.last
        if streak >= self.ready_after and quiet < self.retry_after_s:
            return f"the engine failed {streak} times in a row (the last {quiet:.0f} s ago)"
        return None

    def liveness(self) -> str | None:
        """Why the process is worth restarting (None: it is not)."""
        streak = self.streak
        if streak >= self.live_after:
            return f"the engine failed {streak} times in a row: restart"
        return None


def scheduler_problem(scheduler, live: bool = False) -> str | None:
    """Why ``scheduler`` cannot serve (None: it can): its loop is down, or its engine keeps failing (``live``:
    the longer streak that makes a restart worth it)."""
    if not scheduler.running:
        return "the scheduler is not running"
    return scheduler.health.liveness() if live else scheduler.health.readiness()
