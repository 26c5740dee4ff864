"""Logit processing and the acceptance rule of speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

Vocabulary, per verify step of one sequence with d draft tokens x_1..x_d:
  p_i     target distribution at draft position i (i = 1..d+1), after temperature/top-k/top-p
  q_i     draft distribution that x_i was sampled from, after the same processing
  accepted token   x_i kept because u < min(1, p_i(x_i) / q_i(x_i))
  recovered token  at the first rejection, sampled from norm(max(0, p_i - q_i)) instead of x_i
  bonus token      when all d are accepted, one more sampled from p_{d+1}
Each step therefore emits (accepted count + 1) tokens, and the output follows the target's distribution exactly.
Temperature 0 is the greedy limit: argmax matching, recovered/bonus tokens are the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.decoding.seeded import Draws
from runtime.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None  # keep the k most likely tokens (None or 0: all)
    top_p: float | None = None  # keep the smallest set whose probability reaches top_p (None or 1: all)

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, received {self.temperature}")
        if self.top_k is not None and (int(self.top_k) != self.top_k or self.top_k < 0):
            raise RequestError(f"top_k must be an integer >= 0, received {self.top_k}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], received {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


ENGINE_SEED_LIMIT = 2**63  # a call's seed is below this: an unsigned 64-bit seed field (TensorRT-LLM's) takes it


@dataclass(frozen=True)
class RowSampling:
    """One row's sampling for one call of an engine that samples inside itself (``Engine.samples``): its parameters
    and a seed for that call alone. An engine that returns tokens is asked again each step with the row's whole
    history, so a seed reused each call would replay the same random draws at every step; the seed comes from the
    row's own generator instead (``for_row``): a seeded row repeats its output, an unseeded one does not."""

    params: SamplingParams
    seed: int

    @classmethod
    def for_row(cls, params: SamplingParams, rng: np.random.Generator) -> "RowSampling | None":
        """This step's sampling of a row (None: greedy, which the engine decodes as it always has)."""
        if params.greedy:
            return None
        return cls(params, int(rng.integers(ENGINE_SEED_LIMIT)))


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """logits [..., V] -> processed distribution [..., V] (float32, normalized in float64 sums). Used identically
    for p and q. Few passes over the vocabulary, in float32 (a step samples from several 49k-wide rows, and this
    glue is a share of every sampled step): the max is subtracted before dividing by the temperature, so a small
    temperature does not lose the logits' differences; with top-p only the nucleus is written into a zeroed row."""
    scaled = np.asarray(logits, dtype=np.float32)
    scaled = (scaled - scaled.max(axis=-1, keepdims=True)) / np.float32(params.temperature)
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -params.top_k, axis=-1)[..., -params.top_k, None]
        scaled[scaled < kth] = -np.inf
    probs = np.exp(scaled, out=scaled)
    probs /= probs.sum(axis=-1, keepdims=True, dtype=np.float64).astype(np.float32)
    if params.top_p is not None and params.top_p < 1.0:
        flat = probs.reshape(-1, probs.shape[-1])
        out = np.zeros_like(flat)
        for b, row in enumerate(flat):
            kept = nucleus_ids(row, params.top_p)
            out[b, kept] = row[kept] / row[kept].sum(dtype=np.float64)
        probs = out.reshape(probs.shape)
    return probs


NUCLEUS_CANDIDATES = 1024  # sort at most this many of the most likely tokens when they hold the nucleus (a full sort
# of a 49k vocabulary costs ~5 ms a row; a model's nucleus is almost always far smaller)
NUCLEUS_STEP = 1e-3  # candidates: tokens within this factor of the most likely one, widened by it while they fall short


def nucleus_ids(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The top-p set of one distribution [V]: tokens in descending probability (ties: lower id first) while the
    mass strictly above them is below top_p. The same set as sorting the whole vocabulary: only the tokens at or
    above a threshold are sorted, and every token below it is less likely than all of them, so once the sorted ones
    reach top_p the set ends among them (else the threshold drops and the sort is redone)."""
    size = probs.shape[-1]
    threshold = float(probs.max()) * NUCLEUS_STEP
    while threshold > 0.0:
        candidates = np.flatnonzero(probs >= threshold)
        if len(candidates) > NUCLEUS_CANDIDATES:
            break  # a flat distribution: sort it all
        order = candidates[np.lexsort((candidates, -probs[candidates]))]
        kept = _kept(probs[order], top_p)
        if kept < len(order) or len(order) == size:
            return order[:kept]
        threshold *= NUCLEUS_STEP
    order = np.argsort(-probs, kind="stable")
    return order[: _kept(probs[order], top_p)]


def _kept(sorted_probs: np.ndarray, top_p: float) -> int:
    """How many of the sorted probabilities the nucleus keeps (at least one)."""
    before = np.cumsum(sorted_probs, dtype=np.float64) - sorted_probs  # mass strictly above each token
    return max(1, int(np.count_nonzero(before < top_p)))


def top_probability(logits: np.ndarray) -> float:
    """Probability of the most likely token under plain softmax (the draft's confidence)."""
    shifted = logits.astype(np.float64) - logits.max()
    return float(1.0 / np.exp(shifted).sum())


def sample(probs: np.ndarray, rng: np.random.Generator | Draws) -> int:
    """Inverse-CDF draw from one distribution [V], over its support (float64 sums: a float32 running sum would
    drop the smallest probabilities near its end); a seeded row's position-keyed race (runtime/decoding/seeded.py)
    where ``rng`` is its cursor."""
    if isinstance(rng, Draws):
        return rng.choose(probs)
    support = np.flatnonzero(probs > 0)
    cdf = np.cumsum(probs[support].astype(np.float64))
    return int(support[min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(support) - 1)])


def point_masses(tokens: list[int], vocab_size: int, params: SamplingParams) -> list[np.ndarray | None]:
    """q for each proposed token of a model-free drafter: one-hot on the token (None when greedy: argmax matching)."""
    if params.greedy:
        return [None] * len(tokens)
    masses = np.zeros((len(tokens), vocab_size))
    masses[np.arange(len(tokens)), tokens] = 1.0
    return list(masses)


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> tuple[int, np.ndarray | None]:
    """Choose one token from logits [V]; returns it and the distribution it came from (None when greedy)."""
    if params.greedy:
        return int(np.argmax(logits)), None
    probs = probabilities(logits, params)
    return sample(probs, rng), probs


def verify(
    draft_tokens: list[int],
    draft_probs: list[np.ndarray | None],
    target_logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Decide one sequence's verify step.

    draft_tokens: x_1..x_d; draft_probs: q_1..q_d (None when greedy); target_logits: [d+1, V], row i scores
    the token after x_i (row 0: after the last emitted token).
    Returns (number of accepted draft tokens n, the token emitted after them: recovered or bonus).
    """
    if params.greedy:
        choices = target_logits.argmax(axis=-1)
        return matched(draft_tokens, lambda i: int(choices[i]))
    if isinstance(rng, Draws):  # a seeded row: the target's own race winner at each position, the draft's kept to it
        return matched(draft_tokens, lambda i: rng.choose(probabilities(target_logits[i], params)))
    for i, token in enumerate(draft_tokens):  # p_i only for the positions reached (up to the first rejection)
        p, q = probabilities(target_logits[i], params), draft_probs[i]
        if rng.random() * q[token] < p[token]:  # u < p/q without dividing by q
            continue  # accepted token
        residual = np.maximum(p - q, 0.0)
        if residual.sum() <= 0.0:  # only when p == q up to rounding; then p itself is the right law
            residual = p
        return i, sample(residual, rng)  # recovered token
    return len(draft_tokens), sample(probabilities(target_logits[len(draft_tokens)], params), rng)  # bonus token


def matched(draft_tokens: list[int], choice) -> tuple[int, int]:
    """Verification by the target's own choices (``choice(i)``: its token at draft position i, asked in order up to
    the first that differs): the draft tokens up to there, then the target's token (recovered, or the bonus)."""
    for i, token in enumerate(draft_tokens):
        chosen = choice(i)
        if chosen != token:
            return i, chosen
    return len(draft_tokens), choice(len(draft_tokens))


def token_logprobs(logits: np.ndarray, tokens: list[int], top: int) -> tuple[list[float], list[list]]:
    """The target's own log-probabilities (log-softmax of its logits, before temperature, top-k/top-p and any
    grammar mask: what the model says) of each emitted token, from logits [m, V] whose row i scored tokens[i], and
    with top > 0 the ``top`` most likely [(token, logprob)] at each."""
    rows = logits[: len(tokens)].astype(np.float64)
    rows = rows - rows.max(axis=-1, keepdims=True)
    logp = rows - np.log(np.exp(rows).sum(axis=-1, keepdims=True))
    chosen = [float(logp[i, t]) for i, t in enumerate(tokens)]
    if top <= 0:
        return chosen, [[] for _ in tokens]
    best = np.argpartition(-logp, min(top, logp.shape[-1] - 1), axis=-1)[:, :top]
    tops = []
    for i in range(len(tokens)):
        order = best[i][np.lexsort((best[i], -logp[i, best[i]]))]
        tops.append([(int(t), float(logp[i, t])) for t in order])
    return chosen, tops
