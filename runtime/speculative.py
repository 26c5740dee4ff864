"""The draft-then-verify loop over engines, for a batch of sequences.

Longer than most modules: the loop and the model drafter share the per-row bookkeeping of one step (drafters
that need no model are runtime/lookup.py, runtime/suffix.py, runtime/features.py).

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
from typing import Any, Iterator, Protocol, Sequence

import numpy as np

from runtime.engine import Engine
from runtime.errors import RequestError
from runtime.grammar import constrain, forced_proposals, token_logprobs
from runtime.metrics import RequestStats
from runtime.sampling import SamplingParams, next_token, point_masses, top_probability, verify


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
    grammar: Any = None  # a GrammarRow (runtime/grammar.py) when the output is constrained
    logprobs: list[float] | None = None  # the target's log-probability of each generated token, when asked
    top_logprobs: list[list[tuple[int, float]]] | None = None

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

    grammars: list | None = None  # per row, the GrammarRow its draws are masked by (set by the loop; None: none)

    def __init__(self, engine: Engine, confidence: float = 0.0):
        self.engine = engine
        self.confidence = confidence
        self.calls = 0

    def start(self, prompts: list[list[int]]) -> None:
        self.cache = self.engine.new_cache(len(prompts))
        self.pending = [list(p) for p in prompts]  # tokens the draft has not been fed yet

    def _feed(self, chunks: list[list[int]]) -> np.ndarray:
        """Feed one chunk per row; returns the logits after each row's last token [B, V] (junk for empty rows)."""
        self.calls += 1
        return last_logits(self.engine, self.cache, chunks)

    takes_prefixes = True  # propose() continues given draft tokens (grammar-forced ones) instead of starting afresh

    def propose(self, limits: list[int], params: SamplingParams, rngs: list,
                prefixes: list[list[int]] | None = None) -> Proposal:
        """Up to limits[b] draft tokens per row; with ``prefixes``, row b's draft starts with prefixes[b] (fixed
        tokens, point masses: the grammar forces them), fed to the draft model with its pending tokens, and the
        model drafts on from there."""
        rows = len(limits)
        prefixes = prefixes or [[] for _ in range(rows)]
        tokens: list[list[int]] = [list(p) for p in prefixes]
        probs: list[list] = [point_masses(p, self.engine.vocab_size, params) for p in prefixes]
        active = [limit > len(p) for limit, p in zip(limits, prefixes)]
        self.base = self.cache.lengths.copy()
        self.fed = [len(p) if a else 0 for p, a in zip(prefixes, active)]
        chunks = [list(pending) + list(p) if a else [] for pending, p, a in zip(self.pending, prefixes, active)]
        self.fed_pending = list(active)
        while any(active):
            logits = self._feed(chunks)
            drawn = draw_rows(logits, active, tokens, probs, limits, params, rngs, self.confidence, self.grammars)
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
              params: SamplingParams, rngs: list, confidence: float = 0.0, grammars: list | None = None
              ) -> list[int | None]:
    """``draw_next`` for every active row of a draft call's logits [B, V]; rows that stop become inactive. Returns
    each row's token to feed the draft next (None: nothing). With ``grammars``, a row that has one draws from its
    logits masked by the grammar (q is then a law over allowed tokens), and stops where its output is complete."""
    drawn: list[int | None] = [None] * len(active)
    for b in np.flatnonzero(active):
        row_logits = logits[b]
        if grammars is not None and grammars[b] is not None:
            mask = grammars[b].mask_after(tokens[b])
            if mask is None or not mask.any() or (tokens[b] and grammars[b].stopped):
                active[b] = False
                continue
            row_logits = constrain(row_logits, mask)
        drawn[b] = draw_next(row_logits, tokens[b], probs[b], limits[b], params, rngs[b], confidence)
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


def last_logits(engine: Engine, cache, chunks: list[list[int]], **options) -> np.ndarray:
    """Feed per-row chunks in one call; the logits after each row's last token [B, V] (junk for empty rows). An
    engine that ``scores_last`` runs its head there alone (a drafter reads nothing else)."""
    tokens, valid = padded(chunks)
    if getattr(engine, "scores_last", False):
        return engine.forward(cache, tokens, valid, last=True, **options)[:, 0]
    logits = engine.forward(cache, tokens, valid, **options)
    return logits[np.arange(len(chunks)), np.maximum(valid.sum(axis=1) - 1, 0)]


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
    grammar: Any = None  # a CompiledGrammar (runtime/grammar.py): every row's output must match it
    forced_drafts: bool = True  # with a grammar: propose the tokens it forces as a draft (no draft call)
    logprobs: int | None = None  # None: off; n >= 0: each token's log-probability and the n most likely


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
        self.constrained = config.grammar is not None
        for row in self.rows:
            row.grammar = config.grammar.start() if self.constrained else None
            if config.logprobs is not None:
                row.logprobs, row.top_logprobs = [], []
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
            if self.constrained:
                proposal = self._propose_constrained(running, limits, use_draft)
            elif use_draft:
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
                n, out = verify_row(row, drafted, proposal.probs[b], logits[b, : len(drafted) + 1], self.config)
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
                after_append(row, new)
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

    def _propose_constrained(self, running: list[Row], limits: list[int], use_draft: bool) -> Proposal:
        return propose_constrained(self.drafter if use_draft else None, [r.grammar for r in running], limits,
                                   self.config, [r.rng for r in running], self.target.vocab_size)

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


def verify_row(row, drafted: list[int], probs: list, logits: np.ndarray, config: DecodeConfig
               ) -> tuple[int, list[int]]:
    """``sampling.verify`` for one row (logits [len(drafted) + 1, V]) under its grammar, if any (the target's law
    masked at every position), recording the target's log-probabilities of what it emits when asked. Returns
    (accepted draft tokens n, the tokens the step emits)."""
    scores = logits if row.grammar is None else constrain(logits, row.grammar.verify_masks(drafted))
    n, extra = verify(drafted, probs, scores, config.params, row.rng)
    out = drafted[:n] + [extra]
    if row.grammar is not None:
        out = out[: row.grammar.commit(n, extra)]
    if row.logprobs is not None:
        record_logprobs(row, logits, out, config.logprobs)
    return n, out


def propose_constrained(drafter: Drafter | None, grammars: list, limits: list[int], config: DecodeConfig, rngs: list,
                        vocab_size: int) -> Proposal:
    """Drafts under the rows' grammars: the grammar-forced tokens where there are any (point masses, no draft call
    for those rows), the drafter's masked draws elsewhere (``drafter`` None: no drafting this step), each cut at its
    first token the grammar refuses (see runtime/grammar.py for why both stay exact)."""
    rows = len(grammars)
    forced = forced_proposals(grammars, limits) if config.forced_drafts else [[] for _ in range(rows)]
    continues = getattr(drafter, "takes_prefixes", False)  # a draft model drafts on after the forced tokens
    if drafter is not None:
        give_grammars(drafter, grammars)
        if continues:
            inner = drafter.propose(limits, config.params, rngs, prefixes=forced)
        else:
            inner = drafter.propose([0 if f else limit for f, limit in zip(forced, limits)], config.params, rngs)
    else:
        inner = Proposal([[] for _ in range(rows)], [[] for _ in range(rows)])
    tokens, probs = [], []
    for b, grammar in enumerate(grammars):
        if forced[b] and not continues:
            drafted, q = forced[b], point_masses(forced[b], vocab_size, config.params)
        else:
            drafted, q = inner.tokens[b], inner.probs[b]
        valid = len(drafted) if grammar is None else grammar.valid_prefix(drafted)
        tokens.append(list(drafted[:valid]))
        probs.append(list(q[:valid]))
    return Proposal(tokens, probs)


def give_grammars(drafter, grammars: list) -> None:
    """Hand the rows' grammars to every model drafter inside ``drafter`` (a hybrid holds one as ``model``)."""
    for part in (drafter, getattr(drafter, "model", None)):
        if part is not None and hasattr(part, "grammars"):
            part.grammars = grammars


def record_logprobs(row, logits: np.ndarray, out: list[int], top: int) -> None:
    """The target's own log-probabilities of a step's emitted tokens (logits [>= len(out), V]: row i scored
    out[i]), appended to the row's; exact under speculation, since row i is the target's score after out[:i]."""
    chosen, tops = token_logprobs(logits, out, top)
    row.logprobs.extend(chosen)
    row.top_logprobs.extend(tops)


def after_append(row, new: list[int]) -> None:
    """Trim logprobs to the tokens a row took, and end a constrained row whose output is complete."""
    if row.logprobs is not None and len(row.logprobs) > len(row.generated):
        del row.logprobs[len(row.generated):], row.top_logprobs[len(row.generated):]
    if row.grammar is not None and not row.finished and row.grammar.stopped:
        row.finished = "stop"


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
