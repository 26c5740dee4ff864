"""Suffix drafting: propose what most often followed the longest earlier match of the text's last tokens.

The idea of SuffixDecoding (Oliaro et al. 2024): index every substring of the context in a suffix trie that counts
occurrences, find the deepest node that matches the end of the text and has been continued before, and follow its
most frequent continuation for as long as that continuation stays frequent. Against prompt lookup
(runtime/drafters/lookup.py, the latest match of the last 1-3 tokens) it matches up to ``depth`` tokens, sees every
earlier occurrence instead of one, and sizes each draft by evidence instead of always proposing k tokens.

Vocabulary, for the text so far t_1..t_n:
  match m        the longest suffix t_{n-m+1..n} that occurred earlier and was followed by a token
  support        how many earlier occurrences of the match were followed by a token
  frequency f_j  the share of those occurrences followed by the draft's first j tokens x_1..x_j
  score          f_1 + ... + f_d: the draft's expected accepted length if the text behaves like its past

The draft stops at the first j with f_j < ``min_frequency``, at ``per_match`` times m tokens (a short match is weak
evidence however often it occurred), at the trie's depth, and at the step's limit. Each row indexes its own prompt and
text, and nothing else: no request drafts from another's responses (a corpus shared by a server's clients would show
one client's outputs to another through draft counts and timing). A proposal is a point mass (q(x) = 1), so rejection
sampling stays exact under sampling, as it does for prompt lookup; no random numbers are drawn to propose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from runtime.decoding.drafter import Drafter, Proposal
from runtime.decoding.sampling import SamplingParams, point_masses

DEPTH = 16  # longest substring the trie counts: match plus draft
EDGE = 1 << 32  # edges are keyed node * EDGE + token: one flat dict instead of one per node


@dataclass(frozen=True)
class SuffixConfig:
    """How long a match must be and how sure a draft must stay."""

    depth: int = DEPTH  # the trie counts substrings up to this many tokens; appending a token costs O(depth)
    min_match: int = 1  # shortest match worth drafting from
    min_frequency: float = 0.1  # stop once the draft so far followed fewer than this share of the match's occurrences
    per_match: float = 2.0  # draft at most this many tokens per matched token
    min_score: float = 0.0  # propose nothing when the draft's score (expected accepted length) is lower

    def __post_init__(self) -> None:
        checks = [
            (isinstance(self.depth, int) and self.depth >= 2, "depth", "an integer >= 2", self.depth),
            (
                isinstance(self.min_match, int) and 1 <= self.min_match < self.depth,
                "min_match",
                f"an integer in [1, depth={self.depth})",
                self.min_match,
            ),
            (0.0 < self.min_frequency <= 1.0, "min_frequency", "a share in (0, 1]", self.min_frequency),
            (self.per_match > 0.0, "per_match", "> 0", self.per_match),
            (self.min_score >= 0.0, "min_score", ">= 0", self.min_score),
        ]
        bad = [
            f"{name}: expected {expected}, received {received!r}" for ok, name, expected, received in checks if not ok
        ]
        if bad:
            raise ValueError("suffix drafter settings: " + "; ".join(bad))


# hybrid_suffix: the suffix trie drafts a row only from a match of >= 2 tokens whose draft expects >= 1 accepted token;
# the draft model takes the other rows.
HYBRID_SUFFIX = SuffixConfig(min_match=2, min_score=1.0)


@dataclass
class Draft:
    tokens: list[int]
    score: float = 0.0
    match: int = 0


class SuffixTrie:
    """Occurrence counts of every substring of at most ``depth`` tokens of the texts appended to it.

    A suffix trie cut at a fixed depth: appending a token touches one node per suffix length, O(depth), and nothing is
    ever rebuilt. A text is tracked by its *frontier*: frontier[d] is the node of its last d tokens (d = 0: the root),
    for every d <= depth whose string is in the trie (a contiguous run: a string's suffixes are there when it is).
    """

    def __init__(self, depth: int = DEPTH):
        self.depth = depth
        self.edges: dict[int, int] = {}  # node * EDGE + token -> child
        self.count = [0]  # [node]: end positions of the node's string
        self.out = [0]  # [node]: those followed by a token (the sum of its children's counts)
        self.best = [-1]  # [node]: the child seen most often, the latest on a tie; -1: none yet
        self.token = [-1]  # [node]: the token on the edge into the node

    def copy(self) -> "SuffixTrie":
        twin = SuffixTrie(self.depth)
        twin.edges, twin.count, twin.out = self.edges.copy(), self.count[:], self.out[:]
        twin.best, twin.token = self.best[:], self.token[:]
        return twin

    @property
    def nodes(self) -> int:
        return len(self.count)

    def append(self, frontier: list[int], token: int) -> list[int]:
        """Count ``token`` after the text with this frontier; returns the frontier of the text with it appended."""
        edges, count, out, best = self.edges, self.count, self.out, self.best  # the hot loop: locals, no calls
        new = [0]
        for node in frontier[: self.depth]:
            key = node * EDGE + token
            child = edges.get(key)
            if child is None:
                child = len(count)
                edges[key] = child
                count.append(1)
                out.append(0)
                best.append(-1)
                self.token.append(token)
            else:
                count[child] += 1
            out[node] += 1
            if best[node] < 0 or count[child] >= count[best[node]]:
                best[node] = child
            new.append(child)
        count[0] += 1
        return new

    def draft(self, frontier: list[int], limit: int, config: SuffixConfig) -> Draft:
        """The most frequent continuation of the longest continued match, cut where it turns unlikely."""
        if limit <= 0:
            return Draft([])
        deepest = min(len(frontier) - 1, max(config.min_match, self.depth - limit))  # leave room for the draft
        for match in range(deepest, config.min_match - 1, -1):
            if self.out[frontier[match]] > 0:
                break
        else:
            return Draft([])
        context = frontier[match]
        support = self.out[context]
        cap = min(limit, self.depth - match, math.ceil(config.per_match * match))
        tokens, score, node = [], 0.0, context
        while len(tokens) < cap:
            node = self.best[node]
            if node < 0:
                break
            frequency = self.count[node] / support
            if frequency < config.min_frequency:
                break
            tokens.append(self.token[node])
            score += frequency
        return Draft(tokens, score, match)


@dataclass
class _Row:
    """One sequence's index over its prompt and text."""

    trie: SuffixTrie
    frontier: list[int] = field(default_factory=lambda: [0])

    def copy(self) -> "_Row":
        return _Row(self.trie.copy(), list(self.frontier))


class SuffixDrafter(Drafter):
    """Drafts from a suffix trie of each row's prompt and text.

    With ``min_score`` it proposes nothing for a row whose draft is not that sure (what a hybrid uses to leave the row
    to a draft model).
    """

    calls_draft_engine = False  # a trie walk: no model

    def __init__(self, vocab_size: int, config: SuffixConfig = SuffixConfig()):
        self.vocab_size, self.config = vocab_size, config

    def start(self, prompts: list[list[int]]) -> None:
        indexed: dict[tuple[int, ...], _Row] = {}  # a batch often repeats a prompt (n samples): index it once
        self.rows = []
        for prompt in prompts:
            twin = indexed.get(tuple(prompt))
            row = self._new_row(prompt) if twin is None else twin.copy()
            indexed.setdefault(tuple(prompt), row)
            self.rows.append(row)

    def _new_row(self, prompt: list[int]) -> _Row:
        row = _Row(SuffixTrie(self.config.depth))
        self._extend(row, prompt)
        return row

    def propose(self, limits: list[int], params: SamplingParams, rngs: list) -> Proposal:
        tokens = [self.draft(row, limit).tokens for row, limit in zip(self.rows, limits)]
        return Proposal(tokens, [point_masses(t, self.vocab_size, params) for t in tokens])

    def draft(self, row: _Row, limit: int) -> Draft:
        """The row's draft, or nothing when it scores under ``min_score``."""
        best = row.trie.draft(row.frontier, limit, self.config)
        if not best.tokens or best.score < self.config.min_score:
            return Draft([])
        return best

    def settle(self, accepted: list[int], emitted: list[list[int]]) -> None:
        self.observe(emitted)

    def observe(self, emitted: list[list[int]]) -> None:
        for row, out in zip(self.rows, emitted):
            self._extend(row, out)

    def keep_rows(self, rows: np.ndarray) -> None:
        self.rows = [self.rows[r] for r in rows]

    def _extend(self, row: _Row, tokens: list[int]) -> None:
        for token in tokens:
            row.frontier = row.trie.append(row.frontier, token)
