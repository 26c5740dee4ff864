"""What a client's regex, JSON schema or grammar would cost the grammar engine, counted before it is compiled.

llguidance compiles a regex lazily: ``a{250000}`` compiles in a hundredth of a second, then every token mask walks
an expression of a quarter million positions (0.7-0.9 s the first, 150-220 ms each after, on SmolLM2's vocabulary),
on the scheduler thread, every step of every row. The cost follows the regex's *expanded size*: a counted repetition
``x{n}`` (or ``{n,m}``, ``{n,}``) repeats x n (m) times, nested ones multiply (``(a{500}){500}`` is 250,000), the
branches of an alternation add up. So the size is counted here, from the text, and a constraint past
``MAX_EXPANDED`` is refused with a 400 naming it, before llguidance sees it.

The same counting runs over every place a counted repetition can hide: a ``response_format`` regex; a JSON schema's
``pattern`` and ``patternProperties`` regexes (its lengths and item counts, ``maxLength`` & co., cost nothing like
that: llguidance counts them without expanding, measured); a Lark grammar's ``/regex/`` terminals, its
``x{n,m}`` and ``x ~ n..m`` repetitions, the definitions they name (a terminal repeated 500 times that repeats a
string 500 times is 250,000) and the JSON schemas inlined with ``%json``. The counting is a reading of the text, not a
second regex engine: where it might read an odd construct differently from llguidance, the engine's own fuel limits
(``PARSER_LIMITS``) and the per-row time budget stop the rest.
"""

from __future__ import annotations

import json
import re
from typing import Any

from runtime.errors import RequestError

# Positions a constraint's regexes (or grammar) may expand to. Measured on SmolLM2's 49,152 tokens (2 cores, loaded):
# a mask of a{2000} takes 0.8 ms, a{10000} 4.4 ms, a{20000} 9-13 ms, a{250000} 260-610 ms (docs/serving.md).
MAX_EXPANDED = 10_000

_COUNT = re.compile(r"\{\s*(\d[\d\s]*)\s*(?:(,)\s*(\d[\d\s]*)?\s*)?\}")
_LARK_TILDE = re.compile(r"~\s*(\d+)\s*(?:\.\.\s*(\d+))?")
_CLASS_WEIGHT = 1  # a character class, escape or dot: one position (the engine's cost per position is alike)


def refuse_expansion(size: int, subject: str, detail: str) -> None:
    """A RequestError when a constraint's regexes expand past MAX_EXPANDED positions (``subject``: what expands,
    with its verb; ``detail``: the part that does)."""
    if size > MAX_EXPANDED:
        raise RequestError(
            f"{subject} to more than {MAX_EXPANDED} positions ({detail}); the limit is {MAX_EXPANDED}. A counted "
            "repetition such as x{n} or x{n,m} repeats x n (m) times, nested ones multiply and alternatives add "
            "up, and every token mask walks them all: use + or * for long runs, or fewer repetitions"
        )


def _times(match: re.Match, limit: int) -> int:
    """The repeat count of a counted repetition ``{n}``, ``{n,}`` or ``{n,m}``: its largest (n + 1 when open)."""
    low = int(re.sub(r"\s", "", match.group(1))[:12])
    if match.group(2) is None:
        return min(low, limit + 1)
    high = match.group(3)
    return min(int(re.sub(r"\s", "", high)[:12]) if high else low + 1, limit + 1)


class _Frames:
    """A stack of groups being read: per group the size of its finished alternatives, of the current one, and of
    the last atom (what a quantifier repeats). Sizes saturate at limit + 1."""

    def __init__(self, limit: int):
        self.limit = limit
        self.stack = [[0, 0, 0]]

    def atom(self, size: int) -> None:
        top = self.stack[-1]
        top[1], top[2] = self._cap(top[1] + size), size

    def repeat(self, times: int) -> None:
        top = self.stack[-1]
        grown = self._cap(top[2] * times)
        top[1], top[2] = self._cap(top[1] + grown - top[2]), grown

    def open(self) -> None:
        self.stack.append([0, 0, 0])

    def close(self) -> None:
        if len(self.stack) > 1:
            done, current, _ = self.stack.pop()
            self.atom(self._cap(done + current))

    def branch(self) -> None:
        top = self.stack[-1]
        top[0], top[1], top[2] = self._cap(top[0] + top[1]), 0, 0

    def total(self) -> int:
        while len(self.stack) > 1:
            self.close()
        done, current, _ = self.stack[0]
        return self._cap(done + current)

    def _cap(self, value: int) -> int:
        return min(value, self.limit + 1)


def regex_size(pattern: str, limit: int = MAX_EXPANDED) -> int:
    """The expanded size of a regex (Rust regex syntax, as llguidance reads it): positions counted once per
    repetition; ``limit + 1`` as soon as it is past ``limit``."""
    frames, at, verbose = _Frames(limit), 0, False
    while at < len(pattern):
        char = pattern[at]
        if char == "\\":
            at = _escape_end(pattern, at)
            frames.atom(_CLASS_WEIGHT)
            continue
        if char == "[":
            at = _class_end(pattern, at)
            frames.atom(_CLASS_WEIGHT)
            continue
        if char == "(":
            at, flags = _group_start(pattern, at)
            verbose = verbose or "x" in flags.split("-")[0]
            frames.open()
            continue
        count = _COUNT.match(pattern, at) if char == "{" else None
        if count:
            frames.repeat(_times(count, limit))
            at = count.end()
            continue
        if verbose and char == "#":
            newline = pattern.find("\n", at)
            at = len(pattern) if newline < 0 else newline + 1
            continue
        if char == ")":
            frames.close()
        elif char == "|":
            frames.branch()
        elif char not in "*+?" and not (verbose and char.isspace()):
            frames.atom(1)
        at += 1
    return frames.total()


def _escape_end(pattern: str, at: int) -> int:
    """Index after the escape starting at ``at`` (``\\x{..}``, ``\\p{..}``, ``\\pL``, ``\\xHH``, ``\\n``, ...)."""
    kind = pattern[at + 1 : at + 2]
    if kind in ("x", "u", "U", "p", "P") and pattern[at + 2 : at + 3] == "{":
        close = pattern.find("}", at + 3)
        return len(pattern) if close < 0 else close + 1
    if kind in ("p", "P"):
        return at + 3
    if kind == "x":
        return at + 4
    if kind == "u":
        return at + 6
    if kind == "U":
        return at + 10
    return at + 2


def _class_end(pattern: str, at: int) -> int:
    """Index after the character class starting at ``at``: nested classes (``[a-z&&[^aeiou]]``), POSIX classes
    (``[[:alpha:]]``), escapes, and a ``]`` first in the class (a literal)."""
    depth, at = 0, at
    while at < len(pattern):
        char = pattern[at]
        if char == "\\":
            at = _escape_end(pattern, at)
            continue
        if char == "[":
            if pattern.startswith("[:", at) and ":]" in pattern[at + 2 : at + 40]:
                at = pattern.index(":]", at + 2) + 2
                continue
            depth += 1
            at += 1
            if pattern[at : at + 1] == "^":
                at += 1
            if pattern[at : at + 1] == "]":
                at += 1  # a literal ]
            continue
        if char == "]":
            depth -= 1
            if depth == 0:
                return at + 1
        at += 1
    return at


def _group_start(pattern: str, at: int) -> tuple[int, str]:
    """(index after a group's opening, its inline flags): ``(``, ``(?:``, ``(?i:``, ``(?P<name>``, ``(?<name>``."""
    if not pattern.startswith("(?", at):
        return at + 1, ""
    if pattern.startswith(("(?P<", "(?<"), at):
        close = pattern.find(">", at)
        return (len(pattern) if close < 0 else close + 1), ""
    end = at + 2
    while end < len(pattern) and pattern[end] not in ":)":
        end += 1
    return end + (pattern[end : end + 1] == ":"), pattern[at + 2 : end]


# --- JSON schemas -------------------------------------------------------------------------------------------------


def schema_size(schema: Any, limit: int = MAX_EXPANDED) -> tuple[int, str]:
    """(the expanded size of a JSON schema's regexes together, the largest of them: a ``pattern``, or a
    ``patternProperties`` key); walked without recursion (the schema is client input)."""
    total, worst, what, stack = 0, 0, "", [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        for key, value in item.items():
            size, name = _keyword_size(key, value, limit)
            total = min(total + size, limit + 1)
            if size > worst:
                worst, what = size, name
            if isinstance(value, (dict, list)):
                stack.append(value)
    return total, what


def _keyword_size(key: str, value: Any, limit: int) -> tuple[int, str]:
    if key == "pattern" and isinstance(value, str):
        return regex_size(value, limit), f"the pattern {value!r:.80}"
    if key == "patternProperties" and isinstance(value, dict):
        sizes = [(regex_size(k, limit), k) for k in value if isinstance(k, str)]
        size, name = max(sizes, default=(0, ""))
        return size, f"the patternProperties key {name!r:.80}"
    return 0, ""


# --- Lark grammars ------------------------------------------------------------------------------------------------

_DEFINITION = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:[ \t]*\[[^\]\n]*\])?(?:[ \t]*\.[-\d]+)?[ \t]*:", re.M)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def lark_size(grammar: str, limit: int = MAX_EXPANDED) -> tuple[int, str]:
    """(the largest expanded size of a Lark grammar's definitions, the definition's name): each definition's
    strings, regexes, repetitions and the definitions it names, multiplied out (a name referring back to a
    definition being expanded counts once: recursion is the parser's, not an expansion)."""
    bodies = _definitions(grammar)
    sizes: dict[str, int] = {}
    worst, name = 0, ""
    for definition in bodies:
        size = _resolve(definition, bodies, sizes, limit)
        if size > worst:
            worst, name = size, definition
    return worst, name


def _definitions(grammar: str) -> dict[str, str]:
    """Each definition's name and its text (from after its colon to the next definition), and under "%" what
    comes before the first one (``%ignore /.../`` and other directives)."""
    starts = list(_DEFINITION.finditer(grammar))
    bodies: dict[str, str] = {"%": grammar[: starts[0].start() if starts else len(grammar)]}  # directives first
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(grammar)
        bodies[match.group(1)] = bodies.get(match.group(1), "") + "|" + grammar[match.end() : end]
    return bodies


def _resolve(name: str, bodies: dict[str, str], sizes: dict[str, int], limit: int) -> int:
    """A definition's expanded size, its references resolved depth first (an explicit stack: a grammar may chain
    thousands of definitions)."""
    pending, active = [name], set()
    while pending:
        current = pending[-1]
        if current in sizes:
            pending.pop()
            continue
        active.add(current)
        missing = [
            ref for ref in _references(bodies[current]) if ref in bodies and ref not in sizes and ref not in active
        ]
        if missing:
            pending.extend(missing)
            continue
        sizes[current] = _body_size(bodies[current], sizes, limit)
        active.discard(current)
        pending.pop()
    return sizes[name]


def _references(body: str) -> set[str]:
    return {token for kind, token in _lark_tokens(body) if kind == "name"}


def _body_size(body: str, sizes: dict[str, int], limit: int) -> int:
    frames = _Frames(limit)
    for kind, token in _lark_tokens(body):
        if kind == "name":
            frames.atom(sizes.get(token, 1))
        elif kind == "string":
            frames.atom(max(1, len(token)))
        elif kind == "regex":
            frames.atom(max(1, regex_size(token, limit)))
        elif kind == "json":
            frames.atom(max(1, _inline_json_size(token, limit)))
        elif kind == "times":
            frames.repeat(int(token))
        elif kind == "open":
            frames.open()
        elif kind == "close":
            frames.close()
        elif kind == "or":
            frames.branch()
    return frames.total()


def _inline_json_size(text: str, limit: int) -> int:
    try:
        return schema_size(json.loads(text), limit)[0]
    except (ValueError, RecursionError):
        return len(text)  # not JSON: the engine refuses it; count its text


def _lark_tokens(body: str):
    """(kind, text) of a Lark definition's pieces: name, string, regex, json (a ``%json {...}`` or ``%regex {...}``
    object), times (a repetition's count), open, close, or; comments, operators and attributes skipped."""
    at = 0
    while at < len(body):
        char = body[at]
        if body.startswith("//", at):
            newline = body.find("\n", at)
            at = len(body) if newline < 0 else newline
        elif char in "\"'":
            end = _quoted_end(body, at, char)
            yield "string", body[at + 1 : end - 1]
            at = end
        elif char == "/":
            end = _quoted_end(body, at, "/")
            yield "regex", body[at + 1 : end - 1]
            at = end
        elif char == "%" and (body.startswith("%json", at) or body.startswith("%regex", at)):
            open_at = body.find("{", at)
            end = _braces_end(body, open_at) if open_at >= 0 else len(body)
            yield "json", body[open_at:end] if open_at >= 0 else ""
            at = end
        elif char == "{" and _COUNT.match(body, at):
            count = _COUNT.match(body, at)
            yield "times", str(_times(count, MAX_EXPANDED))
            at = count.end()
        elif char == "~" and _LARK_TILDE.match(body, at):
            tilde = _LARK_TILDE.match(body, at)
            yield "times", str(min(int((tilde.group(2) or tilde.group(1))[:12]), MAX_EXPANDED + 1))
            at = tilde.end()
        elif char in "([":
            yield "open", char
            at += 1
        elif char in ")]":
            yield "close", char
            at += 1
        elif char == "|":
            yield "or", char
            at += 1
        elif _NAME.match(body, at):
            name = _NAME.match(body, at)
            yield "name", name.group()
            at = name.end()
        else:
            at += 1


def _quoted_end(text: str, at: int, quote: str) -> int:
    """Index after the string or regex literal opened at ``at`` (backslash escapes; a regex's flags follow)."""
    end = at + 1
    while end < len(text) and text[end] != quote:
        end += 2 if text[end] == "\\" else 1
    return min(end + 1, len(text) + 1)


def _braces_end(text: str, at: int) -> int:
    """Index after the balanced ``{...}`` opened at ``at`` (strings inside skipped)."""
    depth, end = 0, at
    while end < len(text):
        char = text[end]
        if char == '"':
            end = _quoted_end(text, end, '"')
            continue
        depth += {"{": 1, "}": -1}.get(char, 0)
        end += 1
        if depth == 0:
            return end
    return end
