"""A scripted engine: a bigram 'language model' with a tiny vocabulary, behind the same Engine interface.

Its KV cache is the slot tokens themselves, rolled back through the same live-slot mask as OnnxEngine, so the loop's
control flow, rollback and call counts are tested without ONNX models, and exact target distributions are known.
The helpers below compute those exactly (token prefixes, acceptance per draft position) and bound the sampling noise,
so each drafter's distribution test asserts the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.engines.base import Engine, KVCache, live_keep_mask
from runtime.engines.onnx import stack_rows


def last_positions(logits: np.ndarray, valid: np.ndarray | None) -> np.ndarray:
    """Logits [B, S, V] cut to [B, 1, V] at each row's last valid position: how a scripted engine that computes every
    position answers ``last``."""
    counts = np.full(len(logits), logits.shape[1]) if valid is None else np.asarray(valid).sum(axis=1)
    return logits[np.arange(len(logits)), np.maximum(counts - 1, 0)][:, None]


class TokenCache(Engine):
    """A fake engine's KV cache: the slot tokens themselves, rolled back through the same live-slot mask as
    OnnxEngine (the cache methods every scripted engine shares)."""

    def new_cache(self, batch: int) -> KVCache:
        return KVCache([np.zeros((batch, 0), np.int64)], np.zeros((batch, 0), np.int64), np.zeros(batch, np.int64))

    def rollback(self, cache: KVCache, keep: np.ndarray) -> None:
        cache.mask = live_keep_mask(cache.mask, keep)
        cache.lengths = np.minimum(cache.lengths, keep)

    def select(self, cache: KVCache, rows: np.ndarray) -> KVCache:
        return KVCache([cache.past[0][rows]], cache.mask[rows], cache.lengths[rows], cache.calls)

    def join(self, cache: KVCache, other: KVCache) -> KVCache:
        past, mask = stack_rows(cache.past, cache.mask, other.past, other.mask, time_axis=1)
        return KVCache(past, mask, np.concatenate([cache.lengths, other.lengths]), cache.calls)

    def live_tokens(self, cache: KVCache, row: int) -> list[int]:
        return [int(t) for t, m in zip(cache.past[0][row], cache.mask[row]) if m]


class BigramEngine(TokenCache):
    def __init__(self, table: np.ndarray, max_context: int = 512):
        self.table = np.asarray(table, dtype=np.float64)  # [V, V]: logits of the next token given the previous one
        self.vocab_size = self.table.shape[0]
        self.max_context = max_context
        self.calls = 0
        self.tokens_fed = 0

    def compute(self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None = None, *, last=False, **_):
        valid = np.ones_like(tokens) if valid is None else valid
        cache.past = [np.concatenate([cache.past[0], tokens], axis=1)]
        cache.mask = np.concatenate([cache.mask, valid.astype(np.int64)], axis=1)
        cache.lengths = cache.lengths + valid.sum(axis=1)
        cache.calls += 1
        self.calls += 1
        self.tokens_fed += int(valid.sum())
        logits = self.table[tokens]  # each position's next-token logits depend on its own token only
        return last_positions(logits, valid) if last else logits


def random_table(vocab: int, seed: int, scale: float = 1.5) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, scale, (vocab, vocab))


def copying_table(vocab: int, seed: int, path: list[int], boost: float = 2.0, scale: float = 0.5) -> np.ndarray:
    """A target that mostly follows ``path`` (each a -> b on it is boosted), as a text that repeats its context does:
    a model-free drafter's multi-token proposals along it are accepted often enough, and rejected often enough, to
    test both."""
    table = random_table(vocab, seed, scale)
    for a, b in zip(path, path[1:]):
        table[a, b] += boost
    return table


def prefix_frequencies(rows, vocab: int, length: int) -> np.ndarray:
    """Observed frequencies of the first ``length`` generated tokens of finished rows, as an array [vocab] * length."""
    firsts = np.array([row.generated[:length] for row in rows], dtype=np.int64)
    counts = np.bincount(np.ravel_multi_index(tuple(firsts.T), (vocab,) * length), minlength=vocab**length)
    return (counts / len(rows)).reshape((vocab,) * length)


def pair_frequencies(rows, vocab: int) -> np.ndarray:
    """Observed frequencies of (first, second) generated token pairs over finished loop rows."""
    return prefix_frequencies(rows, vocab, 2)


def exact_prefixes(probs: np.ndarray, start: int, length: int) -> np.ndarray:
    """P(x_1..x_length | start) under a bigram target whose next-token law after token a is probs[a]."""
    joint = probs[start]
    for _ in range(length - 1):
        joint = joint[..., None] * probs  # joint[..., a, b] = P(..., a) p(b | a)
    return joint


def exact_acceptance(probs: np.ndarray, draft_laws: list[np.ndarray], start: int, races: bool = False) -> np.ndarray:
    """P(draft tokens 1..j all accepted), j = 1..len(draft_laws), in one verify step after ``start``.

    draft_laws[j-1][a, b] is the draft's q(b | a) at position j (a point-mass proposal x_j: 1 where b == x_j). Under
    rejection sampling P(x_j = b and accepted | x_{j-1} = a) = min(p(b | a), q(b | a)); under a seeded row's races
    (``races``) it is ``raced_together``'s. Either way the chain is a product.
    """
    reach = np.eye(len(probs))[start]  # [a]: P(all so far accepted and the last token is a)
    out = []
    for law in draft_laws:
        reach = reach @ (raced_together(probs, law) if races else np.minimum(probs, law))
        out.append(reach.sum())
    return np.array(out)


def raced_together(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """[..., b]: P(b wins both exponential races over the same noise, one under p and one under q): b wins both when
    every other w's time E_w exceeds E_b * max(p_w / p_b, q_w / q_b); integrated over E_b ~ Exp(1), that is
    1 / sum_w max(p_w / p_b, q_w / q_b), and 0 where p_b or q_b is 0."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.maximum(p[..., None, :] / p[..., :, None], q[..., None, :] / q[..., :, None])
        out = 1.0 / ratios.sum(-1)
    return np.where((p > 0) & (q > 0), out, 0.0)


def drawn_by_races(rows) -> bool:
    """Whether the rows are seeded sampled rows drawn by position-keyed races (runtime/decoding/seeded.py)."""
    from runtime.decoding.seeded import SeededNoise

    return isinstance(rows[0].rng, SeededNoise)


def point_mass_laws(tokens: list[int], vocab: int) -> list[np.ndarray]:
    """draft_laws for a fixed proposal x_1..x_d (prompt lookup, suffix drafting)."""
    laws = []
    for token in tokens:
        law = np.zeros((vocab, vocab))
        law[:, token] = 1.0
        laws.append(law)
    return laws


def tv_bound(exact: np.ndarray, n: int, failure: float = 1e-6) -> float:
    """A bound the total variation between ``exact`` and the frequencies of n samples from it exceeds with
    probability < failure: its mean is at most 0.5 * sum(sqrt(p (1 - p) / n)), and one sample moves it by at most
    1/n, so by McDiarmid it exceeds the mean by t with probability <= exp(-2 n t^2)."""
    p = np.clip(exact.ravel(), 0.0, 1.0)  # a float32 law's products can sum to 1 + 1e-8
    return 0.5 * float(np.sqrt(p * (1 - p) / n).sum()) + float(np.sqrt(np.log(1 / failure) / (2 * n)))


def rate_bound(n: int, failure: float = 1e-6) -> float:
    """Hoeffding: an observed rate over n trials misses its probability by more than this with probability < failure."""
    return float(np.sqrt(np.log(2 / failure) / (2 * n)))


def total_variation(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


@dataclass
class DraftCounts:
    """Per draft position, summed over rows: how many steps proposed it and how many accepted it."""

    drafted: np.ndarray
    accepted: np.ndarray

    @classmethod
    def of(cls, rows) -> "DraftCounts":
        size = max([len(r.stats.drafted_per_position) for r in rows] + [1])
        drafted, accepted = np.zeros(size, np.int64), np.zeros(size, np.int64)
        for row in rows:
            d, a = row.stats.drafted_per_position, row.stats.accepted_per_position
            drafted[: len(d)] += d
            accepted[: len(a)] += a
        return cls(drafted, accepted)

    def multi_token_steps_decided_both_ways(self) -> bool:
        """Steps drafted >= 2 tokens, some second tokens were accepted, and some draft tokens were rejected."""
        return (
            len(self.drafted) >= 2
            and self.drafted[1] > 0
            and self.accepted[1] > 0
            and bool((self.accepted < self.drafted).any())
        )


def run_loop(loop, groups: int = 1) -> DraftCounts | list[DraftCounts]:
    """Run a loop to the end; returns its first step's draft counts (every row starts from a known context there),
    one per equal slice of its rows when ``groups`` > 1."""
    steps = loop.run()
    next(steps)
    size = len(loop.rows) // groups
    first = [DraftCounts.of(loop.rows[g * size : (g + 1) * size]) for g in range(groups)]
    for _ in steps:
        pass
    return first if groups > 1 else first[0]


LENGTH = 4  # tokens generated per sequence in the distribution tests: the first step may draft up to LENGTH - 1


def assert_follows_target(rows, first: DraftCounts, probs: np.ndarray, start: int, draft_laws: list[np.ndarray]):
    """Rows decoded from context ``start`` follow the target exactly: the laws of x_1, (x_1, x_2), (x_1, x_2, x_3) and
    (x_3, x_4) within sampling noise; the first step drafted len(draft_laws) tokens in every row and accepted each
    position as often as the exact value says; and across all steps, multi-token drafts were accepted and rejected."""
    n, vocab = len(rows), len(probs)
    exact, observed = exact_prefixes(probs, start, LENGTH), prefix_frequencies(rows, vocab, LENGTH)
    for axes in ((1, 2, 3), (2, 3), (3,), (0, 1)):
        law = exact.sum(axes)
        assert total_variation(observed.sum(axes), law) < tv_bound(law, n), f"law of the tokens but {axes}"
    acceptance = exact_acceptance(probs, draft_laws, start, races=drawn_by_races(rows))
    depth = len(draft_laws)
    assert first.drafted[:depth].tolist() == [n] * depth and len(first.drafted) == depth
    assert np.abs(first.accepted[:depth] / n - acceptance).max() < rate_bound(n), (first.accepted / n, acceptance)
    assert DraftCounts.of(rows).multi_token_steps_decided_both_ways()


# What a hostile manifest claims (kept as data: the code-base scan refuses consent hard-coded in a call)
CLAIMED_CONSENT = {"allow_pickle": True, "trust_remote_code": True}


def consent_spy(monkeypatch, manifest):
    """A manifest whose spec claims --allow-pickle and --trust-remote-code, and the consent list every
    ``builder.checkpoint.resolve`` call then receives (each call stops there): the peers' consent tests."""
    import dataclasses

    import builder.checkpoint

    seen = []

    def resolve(source, allow_pickle=False, trust_remote_code=False):
        seen.append((allow_pickle, trust_remote_code))
        raise builder.checkpoint.CheckpointError("stop here")

    monkeypatch.setattr(builder.checkpoint, "resolve", resolve)
    spec = dataclasses.replace(manifest.spec, **CLAIMED_CONSENT)
    return dataclasses.replace(manifest, spec=spec), seen


def fake_gpu_runner(step, root) -> None:
    """Stands in for a TensorRT-LLM build's GPU steps (convert, quantize, trtllm-build, ModelOpt): writes each step's
    outputs with a config.json; runs the CPU-only steps for real."""
    import json

    from builder.trtllm import build as trtllm

    if step.call in (
        "builder.trtllm.build.copy_checkpoint",
        "tensorrt_llm.LLM",
        "builder.trtllm.build.write_calibration_set",
    ):
        trtllm.run_step(step, root)
        return
    for output in step.outputs:
        (root / output).mkdir(parents=True, exist_ok=True)
        (root / output / "config.json").write_text(json.dumps(step.to_dict()), encoding="utf-8")
