"""Tokenizer steps that grow their input are refused at load (runtime/text/tokenizer_growth.py), in a bundle's
tokenizer, a cross bundle's draft tokenizer, and a build's target before any heavy work; real tokenizers' pipelines
are within the bound."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from builder.build import build
from bundle_edits import copy_of, rehash
from runtime.api import SpeculativeGenerator
from runtime.bundle import BuildSpec, BundleError, load_manifest


def _doubling(letter: str, times: int) -> dict:
    return {
        "type": "Sequence",
        "normalizers": [{"type": "Replace", "pattern": {"String": letter}, "content": letter * 2}] * times,
    }


def _nested(depth: int) -> dict:
    """A normalizer of empty Sequences nested ``depth`` deep (each level a step to read)."""
    value: dict = {"type": "Sequence", "normalizers": []}
    for _ in range(depth - 1):
        value = {"type": "Sequence", "normalizers": [value]}
    return value


def _charsmap(longest: int) -> str:
    """A SentencePiece precompiled character map whose one replacement is ``longest`` characters."""
    import base64

    return base64.b64encode((0).to_bytes(4, "little") + b"x" * longest + b"\0").decode()


# (the part of tokenizer.json, its hostile value): each can make a text grow past MAX_GROWTH times, or adds more
# than MAX_EXTRA characters, or cannot be bounded at all.
GROWING = [
    ("normalizer", _doubling("e", 24)),  # the issue's: encode("e") would be 16.7M characters
    ("normalizer", _doubling("a", 40)),  # never finishes
    ("normalizer", {"type": "Replace", "pattern": {"String": "a"}, "content": "a" * 200}),
    (
        "normalizer",
        {"type": "Sequence", "normalizers": [{"type": "Replace", "pattern": {"Regex": "b?"}, "content": "xy"}] * 6},
    ),
    ("normalizer", {"type": "Replace", "pattern": {"String": ""}, "content": "z" * 300}),
    ("normalizer", {"type": "Prepend", "prepend": "p" * 70_000}),
    ("normalizer", {"type": "Sequence", "normalizers": [{"type": "BertNormalizer"}] * 3}),
    ("normalizer", {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "NFKD"}]}),
    ("normalizer", {"type": "Sequence", "normalizers": [{"type": "ByteLevel"}] * 5}),
    ("normalizer", {"type": "Precompiled", "precompiled_charsmap": _charsmap(1000)}),
    ("normalizer", {"type": "Precompiled", "precompiled_charsmap": "not base64 at all!"}),
    ("normalizer", {"type": "Frobnicate"}),
    ("normalizer", _nested(17)),
    ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [{"type": "ByteLevel", "add_prefix_space": False}] * 10}),
    ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [{"type": "Metaspace", "replacement": "▁"}] * 8}),
    (
        "decoder",
        {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "a"}, "content": "aa"}] * 20},
    ),
    ("decoder", {"type": "Sequence", "decoders": [{"type": "BPEDecoder", "suffix": ""}] * 10}),
    ("decoder", {"type": "Sequence", "decoders": [{"type": "WordPiece", "prefix": "##"}] * 8}),
]


def _hostile_tokenizer(folder: Path, part: str, value: dict) -> None:
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    data[part] = value
    (folder / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")


@pytest.mark.parametrize("part,value", GROWING, ids=range(len(GROWING)))
def test_a_bundle_tokenizer_that_grows_text_is_refused_naming_the_file(tiny_bundle, tmp_path, part, value):
    root = copy_of(tiny_bundle, tmp_path / "b")
    _hostile_tokenizer(root / "tokenizer", part, value)
    rehash(root)
    with pytest.raises(BundleError, match=f"{root}/tokenizer/tokenizer.json: its {part.replace('_', '-')}"):
        SpeculativeGenerator.from_bundle(root, threads=1)


def test_a_cross_bundles_draft_tokenizer_that_grows_text_is_refused(tiny_cross_bundle, tmp_path):
    root = copy_of(tiny_cross_bundle, tmp_path / "b")
    folder = load_manifest(root).draft.tokenizer
    _hostile_tokenizer(root / folder, "normalizer", _doubling("e", 24))
    rehash(root)
    with pytest.raises(BundleError, match=f"{root}/{folder}/tokenizer.json: its normalizer"):
        SpeculativeGenerator.from_bundle(root, threads=1)


def test_real_tokenizer_pipelines_are_within_the_bound(tiny_bundle):
    """The shapes real tokenizers have (GPT-2/SmolLM2/Qwen byte-level, Llama's prefix and replace, BERT's, T5's
    precompiled map) load; the tiny bundle's tokenizer too."""
    from runtime.text.tokenizer_growth import growth_refusal

    nfkc_map = _charsmap(18)  # NFKC's longest decomposition (U+FDFA) is 18 characters
    shapes = [
        {"normalizer": {"type": "NFC"}, "pre_tokenizer": {"type": "ByteLevel"}, "decoder": {"type": "ByteLevel"}},
        {
            "normalizer": {
                "type": "Sequence",
                "normalizers": [
                    {"type": "Prepend", "prepend": "▁"},
                    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
                ],
            },
            "decoder": {
                "type": "Sequence",
                "decoders": [
                    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                    {"type": "ByteFallback"},
                    {"type": "Fuse"},
                    {"type": "Strip", "content": " ", "start": 1, "stop": 0},
                ],
            },
        },
        {
            "normalizer": {"type": "BertNormalizer"},
            "pre_tokenizer": {"type": "BertPreTokenizer"},
            "decoder": {"type": "WordPiece"},
        },
        {
            "normalizer": {
                "type": "Sequence",
                "normalizers": [
                    {"type": "Precompiled", "precompiled_charsmap": nfkc_map},
                    {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
                ],
            },
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁"},
            "decoder": {"type": "Metaspace", "replacement": "▁"},
        },
    ]
    for shape in shapes:
        assert growth_refusal(json.dumps(shape)) is None, shape
    assert growth_refusal((tiny_bundle / "tokenizer" / "tokenizer.json").read_bytes()) is None


def test_a_build_refuses_a_tokenizer_that_grows_text_before_any_heavy_work(tiny_pair, tmp_path):
    """A tiny checkpoint whose normalizer doubles a letter 24 times (a build of it grew past 16 GB in 3.5 minutes,
    sending its evaluation text through): refused at the pair stage, naming the file, before any engine is made."""
    from builder.checkpoint import CheckpointError

    target = tmp_path / "hostile"
    shutil.copytree(tiny_pair[0], target)
    _hostile_tokenizer(target, "normalizer", _doubling("e", 24))
    stages: list[str] = []

    def record(name: str) -> None:
        stages.append(name)
        if name not in ("resolve", "pair"):
            raise AssertionError(f"the build went on to {name!r} with the hostile tokenizer")

    with pytest.raises(CheckpointError, match=f"{target}/tokenizer.json: its normalizer"):
        build(BuildSpec(target=str(target), draft="self", k=2, max_context=64), tmp_path / "out", on_stage=record)
    assert stages == ["resolve", "pair"] and not (tmp_path / "out").exists()
