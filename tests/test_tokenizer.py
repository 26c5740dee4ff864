"""The tokenizer's text side (runtime/text/tokenizer.py): incremental decoding never splits a character."""

from __future__ import annotations


def test_stream_never_splits_a_multibyte_character(generator):
    """Byte-level tokens can carry half a character; no streamed piece may end inside one."""
    tok = generator.tokenizer
    ids = tok.encode("日本語のテキスト 🙂🚀 café")
    from runtime.text.tokenizer import IncrementalDecoder

    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push([i]) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) < len(ids)  # some tokens were held back: they were partial characters
