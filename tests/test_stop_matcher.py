"""Stop strings found incrementally (runtime/text/stop_matcher.py) exactly as a plain search finds them: the same text
sent, the same text held back, the same cut; and a row-step's cost no longer grows with the stops (issue 54)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.text.stop_matcher import StopAutomaton
from runtime.text.tokenizer import StopText


class PlainStopText:
    """The straightforward reference (StopText before issue 54): at every push, search the text again for every stop
    and try every prefix of every stop against its end."""

    def __init__(self, stops):
        self.stops, self.text, self.held = tuple(s for s in stops if s), "", ""

    def push(self, piece):
        joined = self.held + piece
        stream = self.text + joined
        starts = [stream.find(s, max(0, len(self.text) - len(s) + 1)) for s in self.stops]
        starts = [at for at in starts if at >= 0]
        if starts and joined:
            out, hold = stream[: min(starts)][len(self.text) :], 0
        else:
            out = joined
            hold = max((n for s in self.stops for n in range(1, len(s)) if stream.endswith(s[:n])), default=0)
        self.held = out[len(out) - hold :] if hold else ""
        out = out[: len(out) - hold]
        self.text += out
        return out, bool(starts and joined)

    def flush(self):
        out, self.held = self.held, ""
        self.text += out
        return out


TEXT = st.text(alphabet="ab\nc", max_size=12)
STOPS = st.lists(st.text(alphabet="ab\nc", max_size=6), max_size=5)
STEPS = st.lists(st.one_of(TEXT, st.none()), max_size=30)  # None: a flush (the sequence ended otherwise)


@settings(max_examples=600, deadline=None)
@given(STOPS, STEPS)
def test_the_automaton_sends_holds_and_cuts_as_a_plain_search_does(stops, steps):
    """Random stops (prefixes of each other, repeated, empty) and pieces over a small alphabet, so stops straddle
    pieces, overlap and nest; pushes go on after a stop and after a flush, as a cancelled row's last event does."""
    new, plain = StopText(tuple(stops)), PlainStopText(tuple(stops))
    for piece in steps:
        assert (new.flush() if piece is None else new.push(piece)) == (
            plain.flush() if piece is None else plain.push(piece)
        )
        assert new.text == plain.text


def test_the_earliest_starting_stop_wins_over_the_first_ending():
    """ "bc" ends first, but "abcd" starts first: the text is cut before "abcd", as a plain search cuts it."""
    assert StopText(("abcd", "bc")).push("xabcd") == ("x", True)
    assert StopText(("abcd", "bc")).push("xabc") == ("xa", True)  # "abcd" is not whole yet: "bc" stops


def test_the_held_text_is_the_longest_end_that_begins_a_stop():
    automaton = StopAutomaton(("abcab", "bcx"))
    state, start = automaton.feed(0, "zzabca")
    assert start is None and automaton.depth[state] == 4  # "abca" begins "abcab"
    state, start = automaton.feed(state, "bcx")
    assert start == -4  # "abcab" ended at the piece's first character, starting four before it


def _row_step_seconds(stops: tuple[str, ...], steps: int = 400) -> float:
    best = float("inf")
    for _ in range(3):
        text = StopText(stops)
        began = time.perf_counter()
        for i in range(steps):
            text.push(f"w{i % 10} x ")  # 5-character pieces that never begin a stop
        best = min(best, (time.perf_counter() - began) / steps)
    return best


def test_a_row_steps_cost_does_not_grow_with_the_stops():
    """16 stops of 256 characters (a server's maximum) cost a row-step about what one short stop does: the plain
    search took ~200x as long (705 µs against 3.6 µs, issue 54). Relative, so a busy machine does not fail it."""
    long_stops = tuple(f"{i:02d}" + "z" * 254 for i in range(16))
    assert _row_step_seconds(long_stops) < 4 * _row_step_seconds(("\n\n",))


@pytest.mark.parametrize(
    "pieces, stops, sent, stopped",
    [
        (["abc E", "N", "D more"], ("END",), "abc ", True),  # the stop straddles three steps: nothing of it is sent
        (["abc E", "x"], ("END",), "abc Ex", False),  # held, then sent once it cannot be a stop
        (["xxa", "bc"], ("ab", "abc"), "xx", True),  # the earliest stop wins
        (["ten ", "to one"], ("one",), "ten to ", True),
        (["no stop here"], (), "no stop here", False),
    ],
)
def test_a_stop_string_split_across_steps_never_leaks_its_first_part(pieces, stops, sent, stopped):
    from runtime.text.tokenizer import StopText

    text, got, ended = StopText(stops), [], False
    for piece in pieces:
        out, ended = text.push(piece)
        got.append(out)
        if ended:
            break
    if not ended:
        got.append(text.flush())  # the sequence ends otherwise: what was held goes out
    assert "".join(got) == text.text == sent and ended == stopped
