"""Two vocabularies side by side: what a draft with its own tokenizer needs to draft for a target (the cross-tokenizer
drafters, runtime/drafters/cross_vocab.py) and what the build reports about such a pair (builder/pairing.py).

Tokens are compared by their bytes (llguidance reads them from each tokenizer: byte-level BPE's "Ġ" and
SentencePiece's "▁" both become a space, byte-fallback tokens their byte), so the intersection is "the same text":
a draft token and a target token that decode to the same bytes are one token of both (Timor et al., ICML 2025, call
drafting inside it token-level intersection, TLI). Special tokens pair only with special tokens of the same text
(``<|im_end|>`` is one token of both SmolLM2 and Qwen2.5), never with ordinary text that happens to spell them.

Text moves between the two through bytes: the committed target tokens' bytes are decoded as UTF-8 up to the last
complete character and re-encoded with the draft's tokenizer (``split_utf8``); a token that ends inside a character
waits for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def token_table(fast) -> tuple[list[bytes], np.ndarray]:
    """(bytes of every id, which ids are special) of a ``tokenizers.Tokenizer``; ids the vocabulary does not hold
    (llguidance pads some to a round size) get empty bytes."""
    import llguidance

    raw = llguidance.LLTokenizer(fast.to_str())
    size = fast.get_vocab_size(with_added_tokens=True)
    special = np.zeros(size, bool)
    for token_id, added in fast.get_added_tokens_decoder().items():
        if token_id < size and added.special:
            special[token_id] = True
    table = [raw.decode_bytes([i]) if fast.id_to_token(i) is not None else b"" for i in range(size)]
    return table, special


def split_utf8(data: bytes) -> tuple[str, bytes]:
    """(text, carry): ``data`` decoded up to its last complete character; ``carry`` is a trailing character's first
    bytes still waiting for the rest (at most 3). Bytes that can never form a character decode as U+FFFD."""
    cut = len(data)
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for its lead
            continue
        if 0xC2 <= byte <= 0xF4:  # a lead byte (the others never start a character)
            needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            if needed > back:
                cut = len(data) - back
        break
    return data[:cut].decode("utf-8", errors="replace"), data[cut:]


@dataclass
class VocabBridge:
    """The target's and a draft's vocabularies: each id's bytes, the one-to-one intersection both ways (-1: none)
    and each side's encoder."""

    target_fast: object  # tokenizers.Tokenizer
    draft_fast: object
    target_bytes: list[bytes]
    draft_bytes: list[bytes]
    draft_to_target: np.ndarray  # [draft vocab] target id of the same token, or -1
    target_to_draft: np.ndarray  # [target vocab] draft id of the same token, or -1

    @classmethod
    def between(
        cls, target_fast, draft_fast, target_vocab: int | None = None, draft_vocab: int | None = None
    ) -> "VocabBridge":
        """The bridge of two fast tokenizers; ``*_vocab``: ids at or past it are left out (rows of an engine's
        output head: a padded head's extra rows, or a tokenizer longer than the head)."""
        target_bytes, target_special = token_table(target_fast)
        draft_bytes, draft_special = token_table(draft_fast)
        return cls.from_tables(
            target_fast,
            draft_fast,
            (target_bytes, target_special),
            (draft_bytes, draft_special),
            target_vocab,
            draft_vocab,
        )

    @classmethod
    def from_tables(
        cls,
        target_fast,
        draft_fast,
        target_table: tuple[list[bytes], np.ndarray],
        draft_table: tuple[list[bytes], np.ndarray],
        target_vocab: int | None = None,
        draft_vocab: int | None = None,
    ) -> "VocabBridge":
        """The bridge of two vocabularies given as (bytes of every id, which ids are special) (``token_table``)."""
        (target_bytes, target_special), (draft_bytes, draft_special) = target_table, draft_table
        target_vocab = len(target_bytes) if target_vocab is None else min(target_vocab, len(target_bytes))
        draft_vocab = len(draft_bytes) if draft_vocab is None else min(draft_vocab, len(draft_bytes))
        by_text = {}
        for t in range(target_vocab):
            if target_bytes[t]:
                by_text.setdefault((target_bytes[t], bool(target_special[t])), t)  # the lowest id of a duplicate
        draft_to_target = np.full(len(draft_bytes), -1, np.int64)
        target_to_draft = np.full(len(target_bytes), -1, np.int64)
        for d in range(draft_vocab):
            t = by_text.get((draft_bytes[d], bool(draft_special[d])), -1) if draft_bytes[d] else -1
            if t >= 0 and target_to_draft[t] < 0:
                draft_to_target[d], target_to_draft[t] = t, d
        return cls(target_fast, draft_fast, target_bytes, draft_bytes, draft_to_target, target_to_draft)

    @property
    def shared(self) -> int:
        """Tokens in the intersection."""
        return int((self.draft_to_target >= 0).sum())

    def overlap(self, target_ids) -> float:
        """Share of these target tokens (text tokenized for the target) that the intersection holds: how much of
        the target's own output a TLI draft can propose at all."""
        ids = np.asarray(list(target_ids), np.int64)
        ids = ids[(ids >= 0) & (ids < len(self.target_to_draft))]
        return float((self.target_to_draft[ids] >= 0).mean()) if len(ids) else 0.0

    def bytes_of(self, target_ids) -> bytes:
        """The bytes of target tokens, concatenated."""
        return b"".join(self.target_bytes[t] if 0 <= t < len(self.target_bytes) else b"" for t in target_ids)

    def draft_bytes_of(self, draft_ids) -> bytes:
        return b"".join(self.draft_bytes[d] if 0 <= d < len(self.draft_bytes) else b"" for d in draft_ids)

    def draft_ids(self, text: str) -> list[int]:
        """``text`` as the draft tokenizes it (special tokens written out in it are recognised; none added)."""
        return self.draft_fast.encode(text, add_special_tokens=False).ids if text else []

    def target_ids(self, text: str) -> list[int]:
        """``text`` as the target tokenizes it (special tokens written out in it are recognised; none added)."""
        return self.target_fast.encode(text, add_special_tokens=False).ids if text else []
