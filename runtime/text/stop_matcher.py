"""Stop strings found as the text streams in: an Aho–Corasick automaton (Aho and Corasick 1975) over one request's
stop strings, whose state a row carries from one step to the next.

Searching the whole text again and trying every prefix of every stop at every step cost each row a time that grew
with the text and with the stops' number and length (705 µs a row-step at 16 stops of 256 characters, issue 54); a
row's step now costs its new characters, whatever the stops. The automaton's state is the longest end of the text so
far that begins some stop (its depth: what a row holds back), and every stop ending at a character is found there.
"""

from __future__ import annotations

import functools

ROOT = 0  # the automaton's start: no character of any stop seen


class StopAutomaton:
    """The automaton of one set of stop strings: built once, then only read (rows with the same stops share it)."""

    def __init__(self, stops: tuple[str, ...]):
        self.goto: list[dict[str, int]] = [{}]  # the trie: a state is a prefix of some stop
        self.depth = [0]  # the length of that prefix
        self.fail = [ROOT]  # the state of its longest proper end that is also a prefix
        self.match = [0]  # the length of the longest stop that ends it (0: none)
        self.longest = max((len(stop) for stop in stops), default=0)
        for stop in stops:
            self._insert(stop)
        self._link()

    def _insert(self, stop: str) -> None:
        state = ROOT
        for char in stop:
            state = self.goto[state].get(char) or self._new_state(state, char)
        self.match[state] = len(stop)

    def _new_state(self, parent: int, char: str) -> int:
        self.goto.append({})
        self.depth.append(self.depth[parent] + 1)
        self.fail.append(ROOT)
        self.match.append(0)
        self.goto[parent][char] = len(self.goto) - 1
        return len(self.goto) - 1

    def _link(self) -> None:
        """Failure links, breadth first (a state's link is shallower, so already linked); a state that is no stop
        itself inherits the longest stop ending its link."""
        queue = list(self.goto[ROOT].values())
        for state in queue:  # the list grows as it is walked: breadth first
            for char, child in self.goto[state].items():
                self.fail[child] = self.step(self.fail[state], char)
                self.match[child] = self.match[child] or self.match[self.fail[child]]
                queue.append(child)

    def step(self, state: int, char: str) -> int:
        """The state after one more character (amortized O(1): each failure taken lowers the depth that each
        character raises by at most one)."""
        while state and char not in self.goto[state]:
            state = self.fail[state]
        return self.goto[state].get(char, ROOT)

    def feed(self, state: int, text: str) -> tuple[int, int | None]:
        """(the state after ``text``, where the earliest-starting stop that ends in ``text`` starts, relative to
        ``text``'s start: negative where it began before it; None: no stop ends in it)."""
        earliest = None
        for at, char in enumerate(text):
            state = self.step(state, char)
            size = self.match[state]
            if size and (earliest is None or at - size + 1 < earliest):
                earliest = at - size + 1
        return state, earliest

    def state_of(self, text: str) -> int:
        """The state after ``text`` fed from the start: its last ``longest`` characters decide it."""
        return self.feed(ROOT, text[max(0, len(text) - self.longest) :])[0]


@functools.lru_cache(maxsize=32)
def stop_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of ``stops``, shared by the rows and requests that send the same ones (an agent's clients
    do): built once, ~4k states at the largest stops a server allows."""
    return StopAutomaton(stops)
