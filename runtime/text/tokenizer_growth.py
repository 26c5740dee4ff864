"""How much longer a tokenizer.json's normalizer, pre-tokenizer and decoder can make a text, read from the file.

A tokenizer.json comes from a checkpoint or a bundle: hostile data. Its pipeline is built from steps that each map
a text to another, and some can lengthen it: ``Replace "a" -> "aa"`` doubles every ``a``; twenty-two of them in a
``Sequence`` turn ``encode("a")`` into four million ids, forty never finish, and the work happens inside the Rust
library, where no budget of ours reaches (on a server's scheduler thread for a cross-tokenizer draft; on every
evaluation text of a build). So the file is read before anything goes through it: every step gets an upper bound
``out <= factor * in + extra`` (characters), a ``Sequence`` composes its steps' bounds, and a tokenizer whose
normalizer and pre-tokenizer together, or whose decoder, can grow a text more than ``MAX_GROWTH`` times (or add
more than ``MAX_EXTRA`` characters) is refused, naming the step. A step of a kind this module does not know is
refused too: its growth cannot be bounded.

The bounds are the steps' worst cases, not their usual ones: a ``Replace`` whose pattern is a regex may match the
empty string between every two characters (``1 + len(content)``); Unicode normalization forms grow a text at most
3x (NFC), 4x (NFD) or 18x (NFKC, NFKD) in code points (Unicode Standard Annex #15, "Design Goals"); a precompiled
(SentencePiece) character map at most by its longest replacement string. Every real tokenizer's pipeline is far
below the limit (BERT's 24, T5's 72, GPT-2's 4, Llama's 1 plus its prefix).
"""

from __future__ import annotations

import base64
import json
import struct
from typing import NamedTuple

MAX_GROWTH = 128  # times: a prompt of the server's largest size stays a few hundred MB of normalized text at worst
MAX_EXTRA = 1 << 16  # characters a pipeline may add whatever the text's length (prefixes)
MAX_NESTING = 16  # Sequence levels
UNICODE_FORMS = {"NFC": 3, "NFD": 4, "NFKC": 18, "NFKD": 18}


class Growth(NamedTuple):
    """An upper bound on a step's output length: ``factor * input + extra`` characters."""

    factor: float
    extra: float

    def then(self, after: "Growth") -> "Growth":
        """This step followed by ``after``."""
        return Growth(self.factor * after.factor, self.extra * after.factor + after.extra)


SAME = Growth(1, 0)


class UnboundedGrowth(ValueError):
    """A step whose growth cannot be bounded, or is past the limit."""


def growth_refusal(tokenizer_json: str | bytes) -> str | None:
    """Why a tokenizer.json must not be used (a step that grows text past the limits, or one that cannot be
    bounded), or None. The text is parsed here; a file that is not JSON is left to the tokenizer library's own
    error."""
    try:
        config = json.loads(tokenizer_json)
    except (ValueError, RecursionError):
        return None
    if not isinstance(config, dict):
        return None
    try:
        encoding = _step("normalizer", config.get("normalizer"), NORMALIZERS, 0).then(
            _step("pre-tokenizer", config.get("pre_tokenizer"), PRE_TOKENIZERS, 0)
        )
        _check("its normalizer and pre-tokenizer", encoding)
        _check("its decoder", _step("decoder", config.get("decoder"), DECODERS, 0))
    except UnboundedGrowth as err:
        return str(err)
    return None


def _check(what: str, growth: Growth) -> None:
    if growth.factor > MAX_GROWTH or growth.extra > MAX_EXTRA:
        raise UnboundedGrowth(
            f"{what} can make a text {growth.factor:.3g} times longer plus {growth.extra:.0f} characters, or more "
            f"(the limit is {MAX_GROWTH} times plus {MAX_EXTRA}): a hostile or broken tokenizer, refused "
            "before any text goes through it"
        )


def _step(role: str, spec, table: dict, depth: int) -> Growth:
    """The bound of one step (``spec``: its JSON object; None: no such step) of a ``role``."""
    if spec is None:
        return SAME
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "Sequence":
        if depth >= MAX_NESTING:
            raise UnboundedGrowth(f"its {role} nests Sequences more than {MAX_NESTING} deep")
        steps = next((v for k, v in spec.items() if k != "type" and isinstance(v, list)), [])
        total = SAME
        for inner in steps:
            total = total.then(_step(role, inner, table, depth + 1))
            _check(f"its {role}", total)  # stop at once: a long chain's bound would overflow
        return total
    rule = table.get(kind)
    if rule is None:
        raise UnboundedGrowth(f"its {role} has a step of type {kind!r:.60}, whose growth cannot be bounded")
    growth = rule(spec)
    _check(f"its {role} step {kind}", growth)
    return growth


def _text(value) -> str:
    return value if isinstance(value, str) else ""


def _replace(spec: dict) -> Growth:
    """``Replace``: a string pattern of p characters replaced by c grows at most c/p times; a regex (or an empty
    string) may match the empty string between every two characters: 1 + c times, plus c at the end."""
    content = len(_text(spec.get("content")))
    pattern = spec.get("pattern") if isinstance(spec.get("pattern"), dict) else {}
    literal = pattern.get("String")
    if isinstance(literal, str) and literal:
        return Growth(max(1.0, content / len(literal)), 0)
    return Growth(1 + content, content) if content else SAME


def _bert(spec: dict) -> Growth:
    """BertNormalizer: a space on each side of a CJK character (3x), accents stripped after NFD (4x), lowercase
    (2x: U+0130 is two code points lowercased)."""
    factor = 3 if spec.get("handle_chinese_chars", True) else 1
    if spec.get("strip_accents") or (spec.get("strip_accents") is None and spec.get("lowercase", True)):
        factor *= UNICODE_FORMS["NFD"]
    return Growth(factor * (2 if spec.get("lowercase", True) else 1), 0)


def _precompiled(spec: dict) -> Growth:
    """A SentencePiece character map: each input character (or grapheme) becomes at most its longest replacement.
    The blob is a 4-byte little-endian trie size, the trie, then the replacements, each ending with a NUL."""
    try:
        blob = base64.b64decode(_text(spec.get("precompiled_charsmap")), validate=True)
        (trie_size,) = struct.unpack_from("<I", blob)
        pool = blob[4 + trie_size :]
    except (ValueError, struct.error):
        raise UnboundedGrowth("its normalizer has a precompiled_charsmap that cannot be read") from None
    longest = max((len(s.decode("utf-8", "replace")) for s in pool.split(b"\0")), default=1)
    return Growth(max(1, longest), 0)


def _fixed(factor: float):
    return lambda spec: Growth(factor, 0)


def _prepend(key: str):
    return lambda spec: Growth(1, len(_text(spec.get(key))))


NORMALIZERS = {
    "Replace": _replace,
    "Prepend": _prepend("prepend"),
    "BertNormalizer": _bert,
    "Precompiled": _precompiled,
    "ByteLevel": _fixed(4),  # each byte of a character becomes a character
    "Lowercase": _fixed(2),
    "Strip": _fixed(1),
    "StripAccents": _fixed(1),
    "Nmt": _fixed(1),
    **{form: _fixed(factor) for form, factor in UNICODE_FORMS.items()},
}
PRE_TOKENIZERS = {
    "ByteLevel": lambda spec: Growth(4, 1),  # a byte a character (and a prefix space)
    "Metaspace": lambda spec: Growth(2, 1),  # the replacement may be prepended to every split, each >= 1 character
    **{
        kind: _fixed(1)  # these only split (or drop) text
        for kind in (
            "BertPreTokenizer",
            "CharDelimiterSplit",
            "Digits",
            "FixedLength",
            "Punctuation",
            "Split",
            "UnicodeScripts",
            "Whitespace",
            "WhitespaceSplit",
        )
    },
}
DECODERS = {
    "Replace": _replace,
    "WordPiece": lambda spec: Growth(2, 0),  # a space before each token
    "BPEDecoder": lambda spec: Growth(2, 0) if not _text(spec.get("suffix")) else SAME,  # "" -> " " everywhere
    "Metaspace": _fixed(1),
    **{kind: _fixed(1) for kind in ("ByteLevel", "ByteFallback", "CTC", "Fuse", "Strip")},  # these shrink text
}
