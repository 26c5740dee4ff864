"""How late the OpenAI server's event loop runs: the figure that says whether anything held it.

Every connection, stream chunk and probe of the server waits on one event loop; work that holds it (a parse, a walk
over a body, anything holding the interpreter lock on another thread) delays all of them at once. ``LoopLag`` asks
the loop to wake it every ``INTERVAL_S`` and records how late each wake-up came, as a histogram
(``draftsmith_event_loop_lag_seconds`` on /metrics) and its largest value. A lag under a few milliseconds is the
loop's normal turn; tens of milliseconds mean something held it. ``draftsmith openai-load`` reads the histogram
before and after a run and reports the run's lag (bench/openai_load.py).
"""

from __future__ import annotations

import asyncio

from runtime.metrics import LatencyHistogram

INTERVAL_S = 0.02  # how often the loop is asked to wake the watch (50 times a second: no measurable cost)
BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
NAME = "draftsmith_event_loop_lag_seconds"
HELP = "How late the server's event loop woke a timer set every 20 ms (anything holding the loop delays it)"


class LoopLag:
    """The lag of the event loop it runs on, from ``start`` (in that loop) to ``stop``."""

    def __init__(self, interval: float = INTERVAL_S):
        self.interval = interval
        self.histogram = LatencyHistogram(BOUNDS)
        self.largest = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Watch the running loop (again, where the loop it watched is gone: a test's loops come and go); the
        server calls it as each request arrives, so it runs under any server, lifespan events or not."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._watch(), name="draftsmith-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self.interval)
            self.record(loop.time() - asked - self.interval)

    def record(self, lag: float) -> None:
        lag = max(lag, 0.0)
        self.histogram.observe(lag)
        self.largest = max(self.largest, lag)

    def prometheus(self) -> str:
        """The histogram in Prometheus' text format (appended to the metric table's on /metrics)."""
        lines = [f"# HELP {NAME} {HELP}", f"# TYPE {NAME} histogram"]
        for bound, count in self.histogram.copy().cumulative():
            label = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{NAME}_bucket{{le="{label}"}} {count}')
        lines += [f"{NAME}_count {self.histogram.observed}", f"{NAME}_sum {self.histogram.total}"]
        return "\n".join(lines) + "\n"
