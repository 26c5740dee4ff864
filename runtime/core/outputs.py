"""The output processor: a sequence's tokens as its caller gets them, written once for every caller (the Python API,
the OpenAI server, the Triton model, the bench), as vLLM's ``OutputProcessor`` serves its offline ``LLM`` and its
server alike.

Per sequence (``TextOutput``): incremental detokenizing (never half a UTF-8 character: runtime/text/tokenizer.py),
stop strings (text that could still begin one is held back until a later step says: ``StopText``), the
log-probabilities not sent yet, and at the end the finish reason and the ``Generation``, whose statistics are
counted in the bundle's metrics. The scheduler (runtime/core/scheduler.py) calls it after every step and when a
row leaves.
"""

from __future__ import annotations

from runtime.decoding.step import DecodeRow
from runtime.metrics import MetricsRegistry
from runtime.core.handles import Event, Generation
from runtime.text.tokenizer import IncrementalDecoder, StopText, Tokenizer

INTERRUPTED = ("cancelled", "timeout")  # finish reasons from outside: the text held back is sent as it is


class TextOutput:
    """One sequence's text so far: what its decoder holds back and what its client was sent."""

    def __init__(self, tokenizer: Tokenizer | None, stops: tuple[str, ...]):
        """``tokenizer`` None: token ids only (a bundle of scripted engines), no text."""
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.sent = StopText(stops)
        self.logprobs_sent = 0  # generated tokens whose log-probabilities went out in events

    def advance(self, row: DecodeRow, new: list[int]) -> Event | None:
        """After a step: the text its new tokens add (everything held back too when the step finished the row), a
        stop string's end of the row (``row.finished = "stop"``), and the event its client gets (None: no text yet)."""
        piece = self.decoder.push(new) if new and self.decoder is not None else ""
        if row.finished and self.decoder is not None:
            piece += self.decoder.flush()
        piece, stopped = self.sent.push(piece)
        if stopped:
            row.finished = "stop"
        elif row.finished:
            piece += self.sent.flush()
        return Event(piece, new, logprobs=self.take_logprobs(row)) if piece else None

    def final(self, row: DecodeRow, reason: str, metrics: MetricsRegistry, drafter_name: str) -> Event:
        """The row's last event: what text is still held (all of it where the row was cancelled or timed out), and
        its Generation; its statistics are counted in ``metrics`` (its drafter's acceptance under
        ``drafter_name``)."""
        tail = self.sent.flush()
        if reason in INTERRUPTED:
            held = self.decoder.flush() if self.decoder is not None else ""
            tail = self.sent.push(held)[0] + self.sent.flush()
        row.finished = reason
        row.stats.finish_reason, row.stats.prompt_tokens = reason, len(row.prompt)
        metrics.add(row.stats, drafter_name)
        generation = Generation(
            self.sent.text, list(row.generated), len(row.prompt), reason, row.stats, row.logprobs, row.top_logprobs
        )
        return Event(tail, [], final=generation, logprobs=self.take_logprobs(row))

    def take_logprobs(self, row: DecodeRow) -> tuple | None:
        """(tokens, logprobs, top) not sent in an event yet (None without logprobs)."""
        if row.logprobs is None:
            return None
        sent, self.logprobs_sent = self.logprobs_sent, len(row.logprobs)
        return row.generated[sent : len(row.logprobs)], row.logprobs[sent:], row.top_logprobs[sent:]
