"""What loads is what was hashed (runtime/core/loaded.py): a file swapped after verification is refused, a session
is made from the verified bytes, a tokenizer folder reads only a tokenizer's files, within their bound."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from bundle_edits import copy_of, edit_manifest, first_logits, rehash
from runtime.api import SpeculativeGenerator
from runtime.bundle import BundleError


def _swap_after_verification(monkeypatch, swaps: dict[Path, bytes]) -> None:
    """Verification passes on the original files; then they change on disk (an rsync in place, a --force)."""
    import runtime.core.loaded

    real = runtime.core.loaded.load_manifest

    def verify_then_swap(root, verify=True):
        manifest = real(root, verify=verify)
        for path, data in swaps.items():
            path.write_bytes(data)
        return manifest

    monkeypatch.setattr(runtime.core.loaded, "load_manifest", verify_then_swap)


@pytest.mark.parametrize("swapped", ["target/model.onnx", "tokenizer/tokenizer.json", "draft/draft_vocab.json"])
def test_a_file_swapped_after_verification_is_refused(tiny_bundle, tmp_path, monkeypatch, swapped):
    root = copy_of(tiny_bundle, tmp_path / "b")
    (root / "draft" / "draft_vocab.json").write_text(json.dumps({"kept_ids": list(range(320))}))
    edit_manifest(root, lambda data: data["draft"].update(vocab_map="draft/draft_vocab.json"))
    rehash(root)
    replacement = {
        "target/model.onnx": (root / "draft" / "model.onnx").read_bytes(),  # another valid engine
        "tokenizer/tokenizer.json": (root / "tokenizer" / "tokenizer.json")
        .read_bytes()
        .replace(b'"<|im_end|>"', b'"<|im_END|>"'),
        "draft/draft_vocab.json": json.dumps({"kept_ids": list(range(319, -1, -1))}).encode(),
    }[swapped]
    _swap_after_verification(monkeypatch, {root / swapped: replacement})
    with pytest.raises(BundleError, match=f"{swapped}: sha256 differs from the manifest: it changed after"):
        SpeculativeGenerator.from_bundle(root, threads=1)


def test_a_swap_after_reading_cannot_reach_the_session(tiny_bundle, tmp_path, monkeypatch, reference):
    """The file changes after it was read and hashed, while the session is being made: the session comes from the
    verified bytes, so its logits are the original target's."""
    import runtime.engines.loading
    import runtime.engines.fused

    root = copy_of(tiny_bundle, tmp_path / "b")
    draft_bytes = (root / "draft" / "model.onnx").read_bytes()
    real = runtime.engines.fused.make_session

    def swap_then_make(model, *args, **kwargs):
        (root / "target" / "model.onnx").write_bytes(draft_bytes)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(runtime.engines.fused, "make_session", swap_then_make)
    monkeypatch.setattr(runtime.engines.loading, "make_session", swap_then_make)
    generator = SpeculativeGenerator.from_bundle(root, threads=1)
    np.testing.assert_allclose(first_logits(generator), reference["target"], atol=1e-6)
    assert not np.allclose(reference["draft"], reference["target"], atol=1e-3)  # the swap would have shown


def _tokenizer_in(root: Path, folder: str) -> None:
    """The draft's tokenizer files put straight into ``folder`` (an engine's), which the manifest then names."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "draft" / "tokenizer" / name, root / folder / name)
    edit_manifest(root, lambda data: data["draft"].update(tokenizer=folder))
    rehash(root)


@pytest.mark.parametrize("folder", ["draft", "target"])
def test_a_tokenizer_folder_naming_an_engines_folder_reads_no_engine(tiny_cross_bundle, tmp_path, monkeypatch, folder):
    """A manifest naming "draft" as the draft's tokenizer folder made the loader read every file under draft/,
    model.onnx included, into memory; only the files a tokenizer is made of are read."""
    import runtime.core.loaded

    root = copy_of(tiny_cross_bundle, tmp_path / "b")
    _tokenizer_in(root, folder)
    read, real = [], runtime.core.loaded.read_verified

    def recording(root_, manifest, rel, *args, **kwargs):
        read.append(rel)
        return real(root_, manifest, rel, *args, **kwargs)

    monkeypatch.setattr(runtime.core.loaded, "read_verified", recording)
    generator = SpeculativeGenerator.from_bundle(root, threads=1)
    assert generator.bridge is not None
    mine = [rel for rel in read if rel.startswith(folder + "/")]
    assert mine == [f"{folder}/tokenizer.json", f"{folder}/tokenizer_config.json"], read


@pytest.mark.parametrize("where", ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"])
def test_a_tokenizer_file_over_its_bound_is_refused_without_reading_it_whole(tiny_bundle, tmp_path, where):
    from runtime.core.loaded import MAX_TOKENIZER_FILE_BYTES

    root = copy_of(tiny_bundle, tmp_path / "b")
    with open(root / where, "r+b") as handle:  # sparse: no disk spent
        handle.truncate(MAX_TOKENIZER_FILE_BYTES + 4096)
    rehash(root)
    with pytest.raises(BundleError, match=f"{where}: over the {MAX_TOKENIZER_FILE_BYTES} bytes"):
        SpeculativeGenerator.from_bundle(root, threads=1)
