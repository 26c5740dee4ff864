"""The Python API: ``SpeculativeGenerator``, a loaded bundle (runtime/core/loaded.py) that generates, streams and
batches.

It is a thin facade: a call admits its prompts once at its front door (runtime/core/request.py), enqueues them as one
group on the one scheduler it holds for its life (runtime/core/scheduler.py: the one decoding loop, the servers' too)
and drives that scheduler's steps in the caller's thread; the text, stop strings and ``Generation`` come from the
scheduler's output processor (runtime/core/outputs.py), so a prompt gets from ``generate`` what a server sends for it.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, Iterator

from runtime.decoding.step_costs import CostModel
from runtime.core.loaded import LoadedBundle
from runtime.metric_families import prometheus_text, read
from runtime.core.request import Admitted, Asked, DecodeRequest, FrontDoor, prompt_tokens
from runtime.core.handles import Generation, Handle, Unavailable
from runtime.core.scheduler import Scheduler, StepObserver

Piece = tuple[int, str, Generation | None]  # (prompt index, text piece, final Generation or None)


class SpeculativeGenerator(LoadedBundle):
    """Draft-then-verify generation over one bundle. Thread-compatible: one request at a time per instance."""

    @classmethod
    def from_bundle(cls, path: str | os.PathLike, **options) -> "SpeculativeGenerator":
        """Load and verify a bundle and open its engines (``LoadedBundle.open``'s options: threads, providers,
        verify, draft_threads, device, device_id)."""
        return cls.open(path, **options)

    @functools.cached_property
    def door(self) -> FrontDoor:
        """The front door of this bundle, one for its life, without a server's limits (the caller is trusted with
        its own process)."""
        return FrontDoor(self)

    def metrics_text(self) -> str:
        """This generator's cumulative metrics in Prometheus' text format: the families both servers export
        (runtime/metric_families.py), a server scheduler's reading zero here."""
        return prometheus_text(read(self.metrics))

    # --- requests -------------------------------------------------------------------------------------------------

    def generate(
        self, prompts: str | list[str], request: DecodeRequest | None = None, *, chat: bool = False, **options
    ) -> Generation | list[Generation]:
        """Generate for one prompt (returns a Generation) or a list (returns a list, in order), with ``chat``
        through the bundle's chat template.

        What to generate and how is a ``runtime.core.request.DecodeRequest`` (``request``) or its fields as keywords
        (``options``), validated once: max_new_tokens, temperature, top_k, top_p, seed, k, stop, mode, drafter,
        draft_confidence, response_format, logprobs, adaptive, fallback, forced_drafts, plan, policy.

        mode "target" decodes target-only (the baseline); drafter "prompt_lookup" drafts by n-gram lookup in the
        prompt and the text so far instead of running the draft engine, "hybrid" by lookup where the context has a
        2-gram match and with the draft engine elsewhere; None: the bundle's default (its spec's drafter). seed: one
        for the batch (each prompt draws its own stream of it) or a list, one per prompt (each prompt samples as it
        would alone with its seed).

        response_format constrains the output: OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema",
        "json_schema": {"schema": ...}}``, or ``{"type": "regex", "regex": ...}``, ``{"type": "grammar", "grammar":
        LARK}``, or a runtime.decoding.grammar.Constraint. It masks the target at every verified position and the
        draft the same way, so the output is exactly what constrained target-only decoding gives (greedy) or samples
        from (sampled); forced_drafts proposes the tokens the grammar forces without a draft call. logprobs (0-20):
        each token's log-probability under the target (Generation.logprobs) and the n most likely at each.
        """
        single = isinstance(prompts, str)
        results: dict[int, Generation] = {}
        for index, _, generation in self.stream_batch(
            [prompts] if single else list(prompts), request, chat=chat, **options
        ):
            if generation is not None:
                results[index] = generation
        ordered = [results[i] for i in sorted(results)]
        return ordered[0] if single else ordered

    def stream(
        self, prompt: str, request: DecodeRequest | None = None, *, chat: bool = False, **options
    ) -> Iterator[str]:
        """Yield text as tokens are accepted; the pieces concatenate to generate(prompt, ...).text."""
        self.last_stream: Generation | None = None
        for _, piece, generation in self.stream_batch([prompt], request, chat=chat, **options):
            if piece:
                yield piece
            if generation is not None:
                self.last_stream = generation

    def stream_batch(
        self, prompts: list[str], request: DecodeRequest | None = None, *, chat: bool = False, cancelled=None, **options
    ) -> Iterator[Piece]:
        """Yield (prompt index, text piece, final Generation or None) as each sequence advances.

        ``cancelled(index) -> bool`` is asked after every step for each running sequence: a true answer finishes it
        at the next step (finish reason "cancelled"; its cache row is freed then). ``seed`` may be a list, one seed
        per prompt: each sequence then samples as it would alone with that seed.
        """
        if not prompts:
            return
        admitted = self.door.admit(Asked(list(prompts), options, chat, base=request))
        yield from self.run(admitted, cancelled)

    @functools.cached_property
    def scheduler(self) -> Scheduler:
        """This generator's one scheduler, for its life: one caller's batch at a time, as many rows as it has
        prompts (no bound: nothing is reserved, its cache grows with them), prompts prefilled whole (nobody else
        waits on a chunk), a failure raised from its step (the caller's batch is one request). A batch's policy and
        plan are its request's own (``DecodeConfig.exact``, ``plan``), its costs the bundle's (``run``)."""
        return Scheduler(
            self,
            max_batch=sys.maxsize,
            max_queue=1,
            max_wait=float("inf"),
            prefill_chunk=None,
            reserve=False,
            isolate=False,
        )

    def run(
        self, admitted: Admitted, cancelled: Callable[[int], bool] | None = None, on_step: StepObserver | None = None
    ) -> Iterator[Piece]:
        """An admitted group of prompts decoded to the end on this generator's scheduler, driven step by step here:
        every event as (prompt index, text piece, final Generation or None). ``on_step`` sees each step's rows and
        their new tokens (the bench's timings: the same loop, observed). A batch that fails, or that its caller
        leaves, is cleared from the scheduler (its rows and cache gone), so the next one starts clean."""
        scheduler = self.scheduler
        scheduler.costs = self._costs_for(admitted)
        scheduler.on_step = on_step
        handles = scheduler.enqueue(admitted)
        try:
            yield from self._driven(handles, cancelled)
        finally:
            scheduler.on_step = None
            if any(handle.outcome is None for handle in handles):
                scheduler.clear(Unavailable("the batch was left before its end"))

    def _driven(self, handles: list[Handle], cancelled: Callable[[int], bool] | None) -> Iterator[Piece]:
        """The scheduler's steps until every handle has its last event, each event read after the step that made
        it; ``cancelled`` asked for each running sequence after every step."""
        while any(handle.outcome is None for handle in handles):
            self.scheduler.step()
            for index, handle in enumerate(handles):
                for event in handle.ready():
                    if event.error is not None:
                        raise event.error
                    if event.piece or event.final is not None:
                        yield index, event.piece, event.final
                if cancelled is not None and handle.outcome is None and cancelled(index):
                    handle.cancel()

    def _costs_for(self, admitted: Admitted) -> CostModel:
        """The call costs a batch's steps plan by: where it drafts and plans, the bundle's, measured once (again for
        a larger batch than any before); else none measured, as a batch that never plans by them."""
        if admitted.drafter is not None and admitted.config.plan:
            return self.step_costs(len(admitted.prompts))
        return CostModel()

    def encode_prompt(self, prompt: str | list[dict], chat: bool = False) -> list[int]:
        """Token ids of a prompt string, or with ``chat`` of a list of {"role", "content"} messages, as the front
        door makes them for a request."""
        return prompt_tokens(self.tokenizer, prompt, chat, self.max_context)
