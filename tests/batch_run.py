"""A batch of token-id prompts decoded to the end by the one decoding loop (runtime/core/scheduler.py), over
engines and a drafter given directly: what the decoding tests drive (scripted engines, no tokenizer, no bundle)."""

from __future__ import annotations

from typing import Iterator

from runtime.decoding.config import DecodeConfig
from runtime.decoding.step import DecodeRow
from runtime.decoding.step_costs import CostModel
from runtime.decoding.drafter import Drafter
from runtime.engines.base import Engine
from runtime.core.loaded import LoadedBundle
from runtime.core.request import Admitted
from runtime.core.scheduler import Scheduler


class BatchRun:
    """One group of prompts (one drafter drafting them all), as the Python API submits it: ``run`` yields after every
    step its rows and the tokens each emitted; ``rows`` holds every row (finished ones too) in prompt order, ``k``
    the group's current draft length (AdaptiveK moves it), ``drafter`` the group's drafter, ``on_fallback(bool)``
    hears fallback's changes."""

    def __init__(
        self,
        target: Engine,
        drafter: Drafter | None,
        prompts: list[list[int]],
        config: DecodeConfig,
        costs: CostModel | None = None,
    ):
        self.bundle = LoadedBundle(None, target, None, None, config.eos_ids)
        self.admitted = Admitted([list(p) for p in prompts], config, (), drafter, "model" if drafter else "")
        self.drafter, self.costs = drafter, costs
        self.rows: list[DecodeRow] = []
        self.on_fallback = None
        self._seen: dict[int, DecodeRow] = {}
        self._step: list[tuple[DecodeRow, list[int]]] = []

    @property
    def k(self) -> int:
        return self.rows[0].group.policy.k

    def run(self) -> Iterator[list[tuple[DecodeRow, list[int]]]]:
        config = self.admitted.config
        scheduler = Scheduler(
            self.bundle,
            max_batch=len(self.admitted.prompts),
            max_queue=1,
            policy="exact" if config.exact else "throughput",
            plan=config.plan,
            prefill_chunk=None,
            reserve=False,
            isolate=False,
            on_step=self._stepped,
        )
        if self.costs is not None:
            scheduler.costs = self.costs
        scheduler.enqueue(self.admitted)
        fallback = False
        while scheduler.busy:
            self._step = []
            scheduler.step()
            if self.rows and self.rows[0].group.policy.in_fallback != fallback:
                fallback = not fallback
                if self.on_fallback is not None:
                    self.on_fallback(fallback)
            yield self._step

    def _stepped(self, stepped: list[tuple[DecodeRow, list[int]]]) -> None:
        self._step = stepped
        for row, _ in stepped:
            self._seen[row.index] = row
        self.rows = [self._seen[i] for i in sorted(self._seen)]
