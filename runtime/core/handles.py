"""What a request submitted to the scheduler gets back: its events, ending in its ``Generation``, a handle to read
and cancel them, and the two errors that are not the request's own fault (runtime/core/scheduler.py)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from runtime.errors import RequestError
from runtime.metrics import RequestStats


@dataclass
class Generation:
    """One sequence's result."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    # "stop" (EOS or a stop string), "length" (max_new_tokens), "context", "timeout" or "cancelled"
    finish_reason: str
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[float] | None = None  # with logprobs: the target's log-probability of each token of token_ids
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, the n most likely (token, logprob)


class Overloaded(RequestError):
    """The queue is full, or a request waited longer than the scheduler allows: retry later."""


class Unavailable(RuntimeError):
    """Not the request's fault: the engines failed while it ran, or the scheduler is stopping."""


def is_stopping(error: Exception) -> bool:
    """Whether ``error`` says only that the server is stopping (retry on another replica): a message a client may
    read, where another Unavailable carries an engine's own text (its nodes, this machine's paths)."""
    return isinstance(error, Unavailable) and "stopping" in str(error)


@dataclass
class Event:
    """What a request receives: text as it is accepted, then exactly one ``final`` (or one ``error``)."""

    piece: str = ""
    token_ids: list[int] = field(default_factory=list)  # the tokens this event adds
    final: Generation | None = None
    error: Exception | None = None
    logprobs: tuple | None = None  # with logprobs: (tokens, logprobs, top) of the tokens since the last event

    @property
    def last(self) -> bool:
        return self.final is not None or self.error is not None


class Handle:
    """A queued request: its events, in order (in its ``sink``, a server's; else read with ``ready`` after each step,
    the Python API's), and a way to cancel it (honoured at the next step)."""

    def __init__(self, request_id: int, sink: Callable[[Event], None] | None = None):
        self.id = request_id
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()  # C-implemented: a step reads it
        self._sink = sink or self._events.put
        self._cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.outcome: Event | None = None  # the last event, once read

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def send(self, event: Event) -> None:
        self._sink(event)

    def ready(self) -> list[Event]:
        """The events sent so far and not read yet, without waiting (a caller driving the steps itself reads them
        after each step); only when no ``sink`` was given."""
        events = []
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return events
            if event.last:
                self.outcome = event
            events.append(event)
