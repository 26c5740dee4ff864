"""The draft-then-verify loop over engines, for a batch of sequences.

Per step: the drafter proposes d_b <= k tokens for each running row b; the target scores [last, x_1..x_d] for all
rows in one call; sampling.verify keeps n_b accepted tokens and adds one recovered or bonus token; both caches roll
back past the rejected slots. Rows finish independently (EOS, budget, context, or the caller's stop) and leave the
batch. Target-only decoding is the same loop with d = 0 (no drafter calls).

Invariant between steps, per row: the target cache holds every token but the last emitted one (``last``), which the
next verify call feeds first; the drafter's cache lags by its own pending tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import numpy as np

from runtime.engine import Engine
from runtime.errors import RequestError
from runtime.metrics import RequestStats
from runtime.sampling import SamplingParams, next_token, top_probability, verify


@dataclass(frozen=True)
class AdaptiveK:
    """Schedule k from what the last step achieved: +up after a fully accepted step, -down otherwise."""

    min_k: int = 1
    max_k: int = 8
    up: int = 2
    down: int = 1
    confidence: float = 0.0  # stop drafting a row when the draft's top probability falls below this (0: never)

    def next(self, k: int, all_accepted: bool) -> int:
        return min(self.max_k, k + self.up) if all_accepted else max(self.min_k, k - self.down)


@dataclass(frozen=True)
class Fallback:
    """Run target-only when rolling acceptance over the last ``window`` draft tokens falls under ``threshold``;
    re-probe with the draft every ``probe_every`` target-only steps. A stale draft must not slow serving down."""

    threshold: float = 0.3
    window: int = 64
    probe_every: int = 32


@dataclass
class Row:
    """One running sequence."""

    index: int  # position in the caller's batch
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    rng: np.random.Generator | None = None
    finished: str = ""

    @property
    def total(self) -> int:
        return len(self.prompt) + len(self.generated)


@dataclass
class Proposal:
    tokens: list[list[int]]  # per row: x_1..x_d
    probs: list[list[np.ndarray | None]]  # per row: q_1..q_d (None when greedy)


class Drafter(Protocol):
    def start(self, prompts: list[list[int]]) -> None:
        """Take the prompts; the drafter sees every prompt token."""

    def propose(self, limits: list[int], params: SamplingParams, rngs: list) -> Proposal:
        """Propose up to limits[b] tokens for each row."""

    def settle(self, accepted: list[int], emitted: list[list[int]]) -> None:
        """After verification: row b kept accepted[b] draft tokens; emitted[b] is everything it emitted."""

    def observe(self, emitted: list[list[int]]) -> None:
        """A step ran without drafting (fallback, or no room to draft): remember what it emitted."""

    def keep_rows(self, rows: np.ndarray) -> None:
        """Drop finished rows."""


class ModelDrafter:
    """A draft model with its own KV cache."""

    def __init__(self, engine: Engine, confidence: float = 0.0):
        self.engine = engine
        self.confidence = confidence
        self.calls = 0

    def start(self, prompts: list[list[int]]) -> None:
        self.cache = self.engine.new_cache(len(prompts))
        self.pending = [list(p) for p in prompts]  # tokens the draft has not been fed yet

    def _feed(self, chunks: list[list[int]]) -> np.ndarray:
        """Feed one chunk per row; returns the logits after each row's last token [B, V] (junk for empty rows)."""
        logits, valid = feed(self.engine, self.cache, chunks)
        self.calls += 1
        last = np.maximum(valid.sum(axis=1) - 1, 0)
        return logits[np.arange(len(chunks)), last]

    def propose(self, limits: list[int], params: SamplingParams, rngs: list) -> Proposal:
        rows = len(limits)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        probs: list[list] = [[] for _ in range(rows)]
        active = [limit > 0 for limit in limits]
        self.base = self.cache.lengths.copy()
        self.fed = [0] * rows
        chunks = [list(p) if a else [] for p, a in zip(self.pending, active)]
        self.fed_pending = list(active)
        while any(active):
            logits = self._feed(chunks)
            drawn = draw_rows(logits, active, tokens, probs, limits, params, rngs, self.confidence)
            chunks = [[] if token is None else [token] for token in drawn]
            self.fed = [fed + (token is not None) for fed, token in zip(self.fed, drawn)]
        return Proposal(tokens, probs)

    def settle(self, accepted: list[int], emitted: list[list[int]]) -> None:
        keep = self.cache.lengths.copy()
        for b, (n, out) in enumerate(zip(accepted, emitted)):
            if not self.fed_pending[b]:  # this row drafted nothing: its pending tokens wait, plus what it emitted
                self.pending[b] = self.pending[b] + out
                continue
            fed = self.fed[b]
            keep[b] = self.base[b] + len(self.pending[b]) + min(n, fed)
            # accepted draft tokens the draft never saw as input, then the recovered/bonus token
            self.pending[b] = out[min(n, fed):]
        self.engine.rollback(self.cache, keep)

    def observe(self, emitted: list[list[int]]) -> None:
        self.pending = [p + out for p, out in zip(self.pending, emitted)]

    def keep_rows(self, rows: np.ndarray) -> None:
        self.cache = self.engine.select(self.cache, rows)
        self.pending = [self.pending[r] for r in rows]


def draw_rows(logits: np.ndarray, active: list[bool], tokens: list[list[int]], probs: list[list], limits: list[int],
              params: SamplingParams, rngs: list, confidence: float = 0.0) -> list[int | None]:
    """``draw_next`` for every active row of a draft call's logits [B, V]; rows that stop become inactive. Returns
    each row's token to feed the draft next (None: nothing)."""
    drawn: list[int | None] = [None] * len(active)
    for b in np.flatnonzero(active):
        drawn[b] = draw_next(logits[b], tokens[b], probs[b], limits[b], params, rngs[b], confidence)
        active[b] = drawn[b] is not None
    return drawn


def draw_next(logits: np.ndarray, tokens: list[int], probs: list, limit: int, params: SamplingParams, rng,
              confidence: float = 0.0) -> int | None:
    """A draft row's next token from its logits, appended with its q to ``tokens``/``probs``; returns the token to
    feed the draft next, or None when the row stops: at its limit, or unsure (top probability under ``confidence``,
    after its first token), when what it has goes to verification."""
    if confidence and tokens and top_probability(logits) < confidence:
        return None
    token, q = next_token(logits, params, rng)
    tokens.append(token)
    probs.append(q)
    return token if len(tokens) < limit else None


def prefill(engine: Engine, cache, chunks: list[list[int]]) -> None:
    """Feed prompts whose logits nobody reads; an engine with a ``prefill`` skips its output head for them."""
    if not hasattr(engine, "prefill"):
        feed(engine, cache, chunks)
        return
    tokens, valid = padded(chunks)
    engine.prefill(cache, tokens, valid)


def row_features(cache, counts: list[int]) -> list[np.ndarray] | None:
    """Each row's final hidden states [counts[b], H] from the target's last call on ``cache`` (None: the engine
    returns none, or no call was made)."""
    hidden = cache.extra.get("hidden")
    return None if hidden is None else [hidden[b, :n] for b, n in enumerate(counts)]


def padded(chunks: list[list[int]], min_width: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per-row chunks right-padded into tokens and valid [B, max(min_width, longest chunk)] (padding is 0 and not
    valid)."""
    width = max(min_width, max(len(c) for c in chunks))
    tokens = np.zeros((len(chunks), width), np.int64)
    valid = np.zeros((len(chunks), width), np.int64)
    for b, chunk in enumerate(chunks):
        tokens[b, : len(chunk)], valid[b, : len(chunk)] = chunk, 1
    return tokens, valid


def feed(engine: Engine, cache, chunks: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """One forward call over per-row chunks of different lengths, right-padded; padding slots stay masked."""
    tokens, valid = padded(chunks)
    return engine.forward(cache, tokens, valid), valid


@dataclass
class DecodeConfig:
    max_new_tokens: int
    k: int
    params: SamplingParams = SamplingParams()
    eos_ids: tuple[int, ...] = ()
    adaptive: AdaptiveK | None = None
    fallback: Fallback | None = None
    seed: int | Sequence[int | None] | None = None  # one seed for the batch, or one per row (see row_generators)


def row_generators(seed: int | Sequence[int | None] | None, rows: int) -> list[np.random.Generator]:
    """One random generator per row; every draw of a row (draft sample, acceptance, recovered, bonus) uses its own.

    One seed for the whole batch: row b draws from stream b of it, so identical prompts still differ. One seed per
    row (a sequence): each row's generator comes from its own seed alone, the stream a batch of one would give it, so
    a seeded request's text does not depend on what it was batched with or where. None: fresh entropy.
    """
    if seed is None or isinstance(seed, (int, np.integer)):
        if seed is not None and seed < 0:
            raise RequestError(f"seed: expected an integer >= 0, received {seed}")
        return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(rows)]
    seeds = list(seed)
    if len(seeds) != rows:
        raise RequestError(f"seed: expected one seed per prompt ({rows}), received {len(seeds)}")
    return [row_generators(s, 1)[0] for s in seeds]


class SpeculativeLoop:
    """Runs a batch to completion; ``run`` yields after every step the tokens each row emitted."""

    def __init__(self, target: Engine, drafter: Drafter | None, prompts: list[list[int]], config: DecodeConfig):
        self.target, self.drafter, self.config = target, drafter, config
        rngs = row_generators(config.seed, len(prompts))
        self.rows = [Row(i, list(p), rng=rng) for i, (p, rng) in enumerate(zip(prompts, rngs))]
        self.k = config.k
        self.recent = deque(maxlen=config.fallback.window if config.fallback else 1)  # 1/0 per recent draft token
        self.fallback_steps_left = 0
        self.on_fallback = None  # callback(bool) when fallback state changes

    def finish(self, index: int, reason: str) -> None:
        """Stop a row from outside (e.g. a stop string matched)."""
        for row in self.rows:
            if row.index == index and not row.finished:
                row.finished = reason

    @property
    def in_fallback(self) -> bool:
        return self.fallback_steps_left > 0

    def run(self) -> Iterator[list[tuple[Row, list[int]]]]:
        start = time.perf_counter()
        running = self.rows
        cache = self.target.new_cache(len(running))
        # prefill: everything but each prompt's last token (that one is fed by the first verify call)
        if any(len(r.prompt) > 1 for r in running):
            prefill(self.target, cache, [r.prompt[:-1] for r in running])
        last = [r.prompt[-1] for r in running]
        feeds_features = hasattr(self.drafter, "take_features")  # a feature drafter reads the target's hidden states
        if self.drafter is not None:
            self.drafter.start([r.prompt for r in running])
            if feeds_features:
                self.drafter.take_features(row_features(cache, [len(r.prompt) - 1 for r in running]))
        while running:
            limits = [self._draft_limit(r) for r in running]
            t0 = time.perf_counter()
            use_draft = self.drafter is not None and not self.in_fallback and any(limits)
            if use_draft:
                proposal = self.drafter.propose(limits, self.config.params, [r.rng for r in running])
            else:
                proposal = Proposal([[] for _ in running], [[] for _ in running])
            t1 = time.perf_counter()
            logits = self._feed_target(cache, [[tok] + draft for tok, draft in zip(last, proposal.tokens)])
            t2 = time.perf_counter()
            if feeds_features:
                self.drafter.take_features(row_features(cache, [len(d) + 1 for d in proposal.tokens]))
            accepted, emitted = [], []
            for b, row in enumerate(running):
                drafted = proposal.tokens[b]
                n, extra = verify(drafted, proposal.probs[b], logits[b, : len(drafted) + 1], self.config.params,
                                  row.rng)
                out = drafted[:n] + [extra]
                accepted.append(n)
                emitted.append(out)
                self.recent.extend([1] * n + [0] * (len(drafted) > n))
                row.stats.record_step(len(drafted), n, 0, fallback=self.in_fallback)
                row.stats.draft_time += t1 - t0
                row.stats.verify_time += t2 - t1
            # roll the target back: keep its cache through [last, accepted draft tokens]
            keep = cache.lengths - np.array([len(d) - n for d, n in zip(proposal.tokens, accepted)])
            self.target.rollback(cache, keep)
            if use_draft:
                self.drafter.settle(accepted, emitted)
            elif self.drafter is not None:
                self.drafter.observe(emitted)
            self._update_k(accepted, proposal, use_draft)
            now = time.perf_counter()
            step = []
            for b, row in enumerate(running):
                new = self._append(row, emitted[b])
                row.stats.num_emitted_tokens += len(new)
                if row.generated and not row.stats.time_to_first_token:
                    row.stats.time_to_first_token = now - start
                row.stats.total_time = now - start
                last[b] = row.generated[-1] if row.generated else last[b]
                step.append((row, new))
            yield step
            keep_rows = np.array([b for b, r in enumerate(running) if not r.finished], dtype=np.int64)
            if len(keep_rows) < len(running):
                running = [running[b] for b in keep_rows]
                last = [last[b] for b in keep_rows]
                if running:
                    cache = self.target.select(cache, keep_rows)
                    if self.drafter is not None:
                        self.drafter.keep_rows(keep_rows)

    def _feed_target(self, cache, chunks: list[list[int]]) -> np.ndarray:
        return feed(self.target, cache, chunks)[0]

    def _draft_limit(self, row: Row) -> int:
        """Draft tokens worth proposing: k, but never past the budget or the context."""
        budget = self.config.max_new_tokens - len(row.generated) - 1
        context = self.target.max_context - row.total
        return max(0, min(self.k, budget, context))

    def _update_k(self, accepted: list[int], proposal: Proposal, used_draft: bool) -> None:
        fallback = self.config.fallback
        if fallback:
            if self.in_fallback:
                self.fallback_steps_left -= 1
                if self.fallback_steps_left == 0:
                    self.recent.clear()  # re-probe: judge the draft afresh
                    self._notify(False)
            elif len(self.recent) == self.recent.maxlen and np.mean(self.recent) < fallback.threshold:
                self.fallback_steps_left = fallback.probe_every
                self._notify(True)
        if self.config.adaptive and used_draft:
            full = all(n == len(d) and d for n, d in zip(accepted, proposal.tokens))
            self.k = self.config.adaptive.next(self.k, full)

    def _notify(self, state: bool) -> None:
        if self.on_fallback:
            self.on_fallback(state)

    def _append(self, row: Row, tokens: list[int]) -> list[int]:
        return append_tokens(row, tokens, self.config, self.target.max_context)


def append_tokens(row, tokens: list[int], config: DecodeConfig, max_context: int) -> list[int]:
    """Add emitted tokens to a row (its ``prompt``, ``generated`` and ``finished``), stopping at EOS, the budget and
    the context; returns the tokens it took."""
    new = []
    for token in tokens:
        if row.finished:
            break
        row.generated.append(token)
        new.append(token)
        if token in config.eos_ids:
            row.finished = "stop"
        elif len(row.generated) >= config.max_new_tokens:
            row.finished = "length"
        elif len(row.prompt) + len(row.generated) >= max_context:
            row.finished = "context"
    return new
