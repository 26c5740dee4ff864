"""Hostile and random input: any prompt, any parameters -> a result of the right shape or a RequestError."""

from __future__ import annotations

import functools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import BigramEngine, random_table
from runtime.api import SpeculativeGenerator
from runtime.errors import RequestError
from runtime.text.tokenizer import Tokenizer

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def fast_generator(tiny_bundle):
    """The tiny bundle's real tokenizer over scripted engines: property tests need thousands of fast calls."""
    tokenizer = Tokenizer(tiny_bundle / "tokenizer")
    vocab = tokenizer.vocab_size
    target = BigramEngine(random_table(vocab, 1, scale=3.0), max_context=96)
    draft = BigramEngine(random_table(vocab, 1, scale=3.0) + random_table(vocab, 2, scale=1.0), max_context=96)
    return SpeculativeGenerator(None, target, draft, tokenizer, eos_ids=(2,), max_k=8)


@SETTINGS
@given(prompt=st.text(max_size=400), max_new_tokens=st.integers(-3, 40))
def test_any_prompt(fast_generator, prompt, max_new_tokens):
    try:
        result = fast_generator.generate(prompt, max_new_tokens=max_new_tokens, k=3)
    except RequestError as err:
        assert str(err)
        assert not prompt or max_new_tokens < 1 or len(fast_generator.tokenizer.encode(prompt)) >= 96
        return
    assert isinstance(result.text, str)
    assert 1 <= len(result.token_ids) <= max_new_tokens
    assert result.finish_reason in ("stop", "length", "context")
    assert result.prompt_tokens + len(result.token_ids) <= 96


@SETTINGS
@given(
    temperature=st.floats(allow_nan=True, allow_infinity=True, width=32),
    top_k=st.one_of(st.none(), st.integers(-5, 400)),
    top_p=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32)),
    k=st.integers(-2, 12),
    seed=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    stop=st.lists(st.text(max_size=4), max_size=3),
)
def test_any_parameters(fast_generator, temperature, top_k, top_p, k, seed, stop):
    try:
        result = fast_generator.generate(
            "def add(a, b):",
            max_new_tokens=12,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            k=k,
            seed=seed,
            stop=stop,
        )
    except RequestError as err:
        bad_temperature = not math.isfinite(temperature) or temperature < 0
        bad_top_p = top_p is not None and not (0 < top_p <= 1)
        bad_top_k = top_k is not None and top_k < 0
        assert bad_temperature or bad_top_p or bad_top_k or not 1 <= k <= 8 or "" in stop, str(err)
        return
    assert 1 <= len(result.token_ids) <= 12
    for s in stop:
        assert s not in result.text


@SETTINGS
@given(prompt=st.text(min_size=1, max_size=60), seed=st.integers(0, 1000), temperature=st.sampled_from([0.0, 0.8]))
def test_stream_equals_generate_for_any_prompt(fast_generator, prompt, seed, temperature):
    options = dict(max_new_tokens=15, temperature=temperature, seed=seed, k=3)
    try:
        whole = fast_generator.generate(prompt, **options)
    except RequestError:
        return
    assert "".join(fast_generator.stream(prompt, **options)) == whole.text


# --- incremental detokenization: tokenizers' DecodeStream gives the text the windowed re-decode gave ---------------


def windowed_pieces(tokenizer, chunks: list[list[int]], window: int = 6) -> list[str]:
    """The pieces of the hand-written decoder DecodeStream replaced (re-decode a window, hold a partial character
    back, the whole decode at the end): the oracle the library must match piece for piece."""
    ids, prefix, read, text, out = [], 0, 0, "", []
    for chunk in chunks:
        ids.extend(chunk)
        before, after = tokenizer.decode(ids[prefix:read]), tokenizer.decode(ids[prefix:])
        if after.endswith("\ufffd") or len(after) < len(before) or not after.startswith(before):
            out.append("")
            continue
        out.append(after[len(before) :])
        text += out[-1]
        read, prefix = len(ids), max(0, len(ids) - window)
    full = tokenizer.decode(ids)
    out.append(full[len(text) :] if full.startswith(text) else "")
    return out


def decoder_pieces(tokenizer, chunks: list[list[int]]) -> list[str]:
    from runtime.text.tokenizer import IncrementalDecoder

    decoder = IncrementalDecoder(tokenizer)
    return [decoder.push(chunk) for chunk in chunks] + [decoder.flush()]


@functools.lru_cache(maxsize=4)
def token_sequences(tokenizer):
    """Token id lists biased towards trouble: byte tokens holding part of a UTF-8 character, special tokens (skipped
    in the text), any id, and the tokens of multilingual text and emoji (characters split across tokens)."""
    vocab = tokenizer.vocab_size
    decoded = [tokenizer.decode([i]) for i in range(vocab)]
    partial = [i for i, text in enumerate(decoded) if "\ufffd" in text]
    special = [i for i, text in enumerate(decoded) if text == ""]
    some_id = st.one_of(
        st.sampled_from(partial), st.integers(0, vocab - 1), *([st.sampled_from(special)] if special else [])
    )
    texts = st.text(st.characters(codec="utf-8", categories=["L", "N", "P", "S", "Zs"]), min_size=1, max_size=40)
    return st.one_of(
        st.lists(some_id, min_size=1, max_size=24),
        texts.map(lambda text: tokenizer.encode(text, add_special_tokens=False)).filter(bool),
    )


def chunked(draw, ids: list[int]) -> list[list[int]]:
    """``ids`` split into the pushes a speculative loop makes (1 to k + 1 tokens a step)."""
    chunks, at = [], 0
    while at < len(ids):
        n = draw(st.integers(1, 5))
        chunks.append(ids[at : at + n])
        at += n
    return chunks


def check_detokenization(tokenizer, data) -> None:
    ids = data.draw(token_sequences(tokenizer))
    chunks = chunked(data.draw, ids)
    pieces = decoder_pieces(tokenizer, chunks)
    assert pieces == windowed_pieces(tokenizer, chunks)
    assert "".join(pieces) == tokenizer.decode(ids)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_bundle):
    return Tokenizer(tiny_bundle / "tokenizer")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_stream_matches_the_windowed_decode(tiny_tokenizer, data):
    check_detokenization(tiny_tokenizer, data)


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_stream_matches_the_windowed_decode_on_smollm2(smollm2_tokenizer, data):
    """The real SmolLM2 tokenizer: 49152 byte-level BPE tokens, 314 of them parts of a UTF-8 character."""
    check_detokenization(smollm2_tokenizer, data)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_bundle):
    return Tokenizer(smollm2_bundle / "tokenizer")


def test_a_stream_that_fails_decodes_whole_from_then_on(tiny_tokenizer, monkeypatch):
    """tokenizers raises when a decoder changes text already emitted ("invalid prefix"); the decoder then decodes
    the whole sequence at each push instead, with the same text."""
    from runtime.text.tokenizer import IncrementalDecoder

    class StreamRefused:  # the tokenizer as tokenizers' DecodeStream cannot use it (every step raises); counts decodes
        def __init__(self, fast):
            self.fast, self.decodes = fast, 0

        def decode(self, *args, **kwargs):
            self.decodes += 1
            return self.fast.decode(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.fast, name)

    ids = tiny_tokenizer.encode("Ünïcödé café — 日本語 🙂", add_special_tokens=False)
    decoder = IncrementalDecoder(tiny_tokenizer)
    first = decoder.push(ids[:3])
    refused = StreamRefused(tiny_tokenizer.fast)
    monkeypatch.setattr(tiny_tokenizer, "fast", refused)
    pieces = [first] + [decoder.push([i]) for i in ids[3:]]
    assert refused.decodes == len(ids) - 3  # each push after the failure decoded the whole sequence
    assert decoder.flush() == ""  # and sent its text then: nothing was left for the end
    assert "".join(pieces) == tiny_tokenizer.decode(ids)
    assert all(not p.endswith("\ufffd") for p in pieces)


# --- corrupted manifests and configs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifest_text(tiny_bundle):
    return (tiny_bundle / "manifest.json").read_text()


@SETTINGS
@given(data=st.data())
def test_corrupted_manifest_is_a_bundle_error(manifest_text, data):
    from runtime.bundle import BundleError, Manifest

    kind = data.draw(st.sampled_from(["truncate", "flip", "replace value"]))
    if kind == "truncate":
        text = manifest_text[: data.draw(st.integers(0, len(manifest_text) - 1))]
    elif kind == "flip":
        at = data.draw(st.integers(0, len(manifest_text) - 1))
        text = manifest_text[:at] + data.draw(st.characters()) + manifest_text[at + 1 :]
    else:
        import json

        doc = json.loads(manifest_text)
        section = data.draw(st.sampled_from(["spec", "target", "draft", None]))
        holder = doc if section is None else doc[section]
        key = data.draw(st.sampled_from(sorted(holder)))
        holder[key] = data.draw(
            st.one_of(
                st.none(),
                st.integers(),
                st.text(max_size=5),
                st.lists(st.integers()),
                st.booleans(),
                st.floats(allow_nan=False),
            )
        )
        text = json.dumps(doc)
    try:
        Manifest.from_json(text)
    except BundleError as err:
        assert str(err)


@SETTINGS
@given(text=st.text(max_size=200))
def test_corrupted_config_is_a_usage_error(tmp_path_factory, text):
    from click.testing import CliRunner
    from builder.cli import main

    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text, encoding="utf-8")
    result = CliRunner().invoke(main, ["--config", str(path), "--out", str(path.parent / "o")])
    assert result.exit_code != 0
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
