"""Seeded sampling whose text depends on the seed and the target alone, never on the draft.

Exact rejection sampling (runtime/decoding/sampling.py ``verify``) draws from a row's random stream as the step goes:
one uniform per tested draft token, one for the recovered or bonus token. How many a step takes depends on how many
tokens were drafted, so a seeded row's text changed with its draft lengths, and the plan had to leave such rows at
their limit on every step (which made every target call of a busy server k + 1 tokens wide).

Here each position's token is an exponential race instead (the Gumbel-max trick, written with exponentials): token
``argmin_v E[v] / p[v]`` where ``E[v] = -log U(seed, position, v)`` are independent Exp(1) draws keyed by the row's
seed, the position in its output and the token id. ``P(v wins) = p[v]`` exactly, positions are independent, so the
text follows the target's distribution; and the winner is a function of (seed, position, p) alone: the same text
with any draft, any draft length, or none (target-only decoding with the same seed gives it too).

The draft runs the same race over its own q with the same noise, so where q is close to p it proposes the token the
target will choose; verification keeps the draft's tokens while they equal the target's race winners and emits the
target's winner at the first that differs (as greedy matching does). Acceptance is the coupling's, P(same winner),
which is at least (1 - TV) / (1 + TV) for total-variation distance TV between p and q: a little below rejection
sampling's 1 - TV. Unseeded rows keep rejection sampling.

The noise is a counter-based hash (splitmix64's finalizer) of (row key, position, token id), so a race hashes only
the ids it needs: a top-p nucleus's, or over a large vocabulary one block of ids after a race between blocks
(``race``).
"""

from __future__ import annotations

import numpy as np

MIX_1, MIX_2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finalizer (Steele, Lea and Flood 2014)
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: successive inputs land far apart before mixing
WORD = (1 << 64) - 1
UNIT = 2.0**-53


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over an array of uint64 (wrapping arithmetic): every input bit reaches every output
    bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(MIX_1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(MIX_2)
    return x ^ (x >> np.uint64(31))


def mix_one(x: int) -> int:
    """``mix`` of one 64-bit integer, in Python's integers (a race's per-position key costs no array calls)."""
    x = ((x ^ (x >> 30)) * MIX_1) & WORD
    x = ((x ^ (x >> 27)) * MIX_2) & WORD
    return x ^ (x >> 31)


BLOCK = 1024  # a race over a large vocabulary runs in two rounds: blocks of this many ids, then ids in the winner
BLOCKS_SALT = 0x5EED_B10C  # the block round's noise is a stream apart from the id round's


def uniforms(key: int, position: int, ids: np.ndarray, salt: int = 0) -> np.ndarray:
    """U(key, position, id) in (0, 1), float64, one per id: 53 bits of a hash of the three (and ``salt``, which
    keeps the two rounds' noise apart)."""
    stream = mix_one(key ^ mix_one((position * GOLDEN + GOLDEN + salt) & WORD))
    bits = mix(np.uint64(stream) + (ids.astype(np.uint64) + np.uint64(1)) * np.uint64(GOLDEN))
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * UNIT


def winner(weights: np.ndarray, key: int, position: int, first_id: int = 0, salt: int = 0) -> int:
    """The exponential race over nonnegative ``weights`` (ids ``first_id`` on): argmin E / w over the positive ones,
    P(i wins) = w_i / sum(w)."""
    support = np.flatnonzero(weights > 0)
    times = -np.log(uniforms(key, position, support + first_id, salt)) / weights[support].astype(np.float64)
    return int(support[np.argmin(times)])


def race(probs: np.ndarray, key: int, position: int) -> int:
    """The token at ``position`` of the row keyed ``key`` under distribution ``probs`` [V].

    Over more than BLOCK tokens, two rounds: a race over the blocks of BLOCK consecutive ids, weighted by their mass,
    then a race over the winning block's ids: P(v) = P(its block) * p(v) / P(its block) = p(v). Hashing every id of
    a 151,936-token vocabulary cost ~3 ms a position (a temperature-only row's support is the whole vocabulary); the
    rounds hash ~150 blocks and one block's ids. The draft races the same rounds, so where its q is close to p both
    rounds tend to pick the same winners."""
    size = probs.shape[-1]
    if size <= BLOCK:
        return winner(probs, key, position)
    masses = np.add.reduceat(probs, np.arange(0, size, BLOCK), dtype=np.float64)
    block = winner(masses, key, position, salt=BLOCKS_SALT)
    first = block * BLOCK
    return first + winner(probs[first : first + BLOCK], key, position, first_id=first)


class SeededNoise:
    """A seeded sampled row's randomness: its 64-bit key, from its seed sequence (``row_randomness`` derives it as it
    derives every row's stream). Only rows of a target that our sampling serves get one: a target that samples inside
    itself takes a seed a call from a generator instead."""

    def __init__(self, seed_sequence: np.random.SeedSequence):
        self.key = int(seed_sequence.generate_state(1, np.uint64)[0])

    def at(self, position: int) -> "Draws":
        """The row's draws from output position ``position`` on."""
        return Draws(self, position)


class Draws:
    """A cursor over a seeded row's positions: each ``choose`` is the race at the next position. Drafting and
    verification each take one from the row's first open position, so the draft's i-th token and the target's
    choice after i accepted tokens share their noise."""

    def __init__(self, noise: SeededNoise, position: int):
        self.noise, self.position = noise, position

    def choose(self, probs: np.ndarray) -> int:
        token = race(probs, self.noise.key, self.position)
        self.position += 1
        return token


def positioned(rng, position: int):
    """What a step's draws of a row come from: a seeded row's cursor at ``position``, else the row's generator."""
    return rng.at(position) if isinstance(rng, SeededNoise) else rng
