"""A request sent the way the servers send one (runtime/serving/openai_server.py, the Triton model): the front door's
one call with the scheduler's room, then ``Scheduler.enqueue`` with a sink its events arrive in. What the scheduler
tests drive: the real path, not an entry point of their own."""

from __future__ import annotations

import queue
from typing import Iterator

from runtime.core.handles import Event, Generation, Handle
from runtime.core.request import Asked, DecodeRequest, FrontDoor
from runtime.core.scheduler import Scheduler

WAIT_S = 300  # a test that waits longer for an event has hung: it fails instead


class Sent:
    """One queued prompt: its handle (to cancel it) and the events its sink received, read in order."""

    def __init__(self):
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.handle: Handle | None = None
        self.outcome: Event | None = None  # the last event, once read

    def cancel(self) -> None:
        self.handle.cancel()

    def __iter__(self) -> Iterator[Event]:
        """Its events until the last one (waiting for each); nothing once the last was read."""
        while self.outcome is None:
            event = self.events.get(timeout=WAIT_S)
            if event.last:
                self.outcome = event
            yield event

    def result(self) -> Generation:
        """The final Generation (the events left read on the way); raises the request's error."""
        for _ in self:
            pass
        if self.outcome.error is not None:
            raise self.outcome.error
        return self.outcome.final


def submit(
    scheduler: Scheduler,
    prompt,
    request: DecodeRequest | None = None,
    *,
    chat: bool = False,
    timeout: float | None = None,
    client: str = "",
    **options,
) -> Sent:
    """``prompt`` (chat messages with ``chat``) with ``request`` and ``options`` on top, as the Python API takes
    them, through the front door of the scheduler's bundle (its room: the scheduler's), then queued."""
    door = FrontDoor(scheduler.bundle, room=scheduler.check_room)
    admitted = door.admit(Asked([prompt], options, chat, base=request))
    sent = Sent()
    sent.handle = scheduler.enqueue(admitted, timeout=timeout, sink=sent.events.put, client=client)[0]
    return sent
