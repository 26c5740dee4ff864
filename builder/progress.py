"""Progress lines for long stages where no progress bar shows (a log file, not a terminal): what a stage does, how
far it got and the time left, at least once a minute. Used by the build's evaluation and the distillation."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

Stage = Callable[[str], None]  # told each build stage's name as it starts (the CLI's progress)


@dataclass
class Heartbeat:
    """An ``advance(n)`` callback for a long stage that also says how far it got, at least once every ``every``
    seconds, where no progress bar is seen (a log, not a terminal: ``say`` is None on a terminal).

    The stage calls it with the items just finished, and with 0 between them (every engine step) so a line comes on
    time even while no item finishes. Time left is the rate so far applied to what remains, or the time to the
    stage's ``deadline`` if that comes first (generation stops admitting there).
    """

    what: str
    total: int
    say: Callable[[str], None] | None
    advance: Callable[[int], None] = lambda n: None
    deadline: float = math.inf
    every: float = 60.0
    clock: Callable[[], float] = time.perf_counter
    done: int = 0

    def __post_init__(self) -> None:
        self.started = self.last = self.clock()

    def __call__(self, n: int) -> None:
        self.done += n
        if n:
            self.advance(n)
        now = self.clock()
        if self.say is not None and now - self.last >= self.every:
            self.last = now
            self.say(self.line(now))

    def line(self, now: float) -> str:
        """``what: done/total (share), elapsed, about N s left``."""
        elapsed = now - self.started
        left = max(0.0, self.deadline - now) if self.deadline < math.inf else math.inf
        if self.done:
            left = min(left, elapsed / self.done * max(0, self.total - self.done))
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        remaining = f"about {left:.0f} s left" if left < math.inf else "time left not known yet"
        return f"{self.what}: {self.done}/{self.total}{share}, {elapsed:.0f} s, {remaining}"


@contextlib.contextmanager
def ticking(what: str, say: Callable[[str], None] | None, every: float = 60.0):
    """A line ``what: N s`` every ``every`` seconds while the block runs, for a stage that reports nothing of its own
    (writing a large engine); nothing where ``say`` is None (a terminal, whose bars show the stage)."""
    if say is None:
        yield
        return
    stop = threading.Event()
    started = time.perf_counter()

    def tick() -> None:
        while not stop.wait(every):
            say(f"{what}: {time.perf_counter() - started:.0f} s")

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
