"""A bundle is what its manifest says and only that: every path stays inside the bundle, the bundle holds exactly
the files it lists, external data stays inside it; one test per hostile input (runtime/bundle.py and the loader's
checks of it)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bundle_edits import CODE, copy_of, edit_manifest, first_logits, rehash
from builder.errors import BuildError
from runtime.api import SpeculativeGenerator
from runtime.bundle import BundleError, load_manifest


@pytest.mark.parametrize("hostile", ["absolute engine", "dot-dot engine", "absolute vocab_map", "dot-dot vocab_map"])
def test_paths_in_the_manifest_that_leave_the_bundle_are_refused(tiny_bundle, tmp_path, hostile):
    """An engine or vocabulary map named by an absolute path or '..' would load a file the manifest never hashed."""
    root = copy_of(tiny_bundle, tmp_path / "b")
    outside = copy_of(tiny_bundle / "target", tmp_path / "outside")
    (outside / "map.json").write_text(json.dumps({"kept_ids": list(range(320))}))
    field, where = hostile.split()[1], {"absolute": str(outside), "dot-dot": "../outside"}[hostile.split()[0]]
    value = f"{where}/model.onnx" if field == "engine" else f"{where}/map.json"
    edit_manifest(root, lambda data: data["draft"].update({field: value}))
    with pytest.raises(BundleError, match=f"draft.{field}.*(absolute path|'\\.\\.')"):
        SpeculativeGenerator.from_bundle(root, threads=1)


def test_an_unlisted_engine_behind_a_symbolic_link_is_refused(tiny_bundle, tmp_path):
    """engine names a link inside the bundle that leads to a model outside it, which the manifest does not list."""
    root = copy_of(tiny_bundle, tmp_path / "b")
    outside = copy_of(tiny_bundle / "draft", tmp_path / "outside")
    (root / "target" / "evil.onnx").symlink_to(outside / "model.onnx")
    edit_manifest(root, lambda data: data["target"].update(engine="target/evil.onnx"))
    with pytest.raises(BundleError, match="target/evil.onnx: not listed in the manifest"):
        SpeculativeGenerator.from_bundle(root, threads=1)
    with pytest.raises(BundleError, match="target/evil.onnx: (not listed|resolves to .* outside)"):
        SpeculativeGenerator.from_bundle(root, threads=1, verify=False)


def test_a_folder_linked_out_of_the_bundle_is_refused_even_unverified(tiny_bundle, tmp_path):
    """target/ replaced by a link to a folder elsewhere: with verify=False nothing is hashed, yet nothing outside
    the bundle may load."""
    root = copy_of(tiny_bundle, tmp_path / "b")
    outside = tmp_path / "elsewhere"
    (root / "target").rename(outside)
    (root / "target").symlink_to(outside, target_is_directory=True)
    with pytest.raises(BundleError, match="target/model.onnx: resolves to .* outside the bundle"):
        SpeculativeGenerator.from_bundle(root, threads=1, verify=False)
    with pytest.raises(BundleError, match="outside the bundle"):
        load_manifest(root)


def test_unlisted_files_are_refused_and_each_is_named(tiny_bundle, tmp_path):
    root = copy_of(tiny_bundle, tmp_path / "b")
    extras = [
        "target/extra.onnx",
        "draft/model.onnx.data",
        "tokenizer/template.jinja",
        "tokenizer/manifest.json",
        "notes.txt",
    ]
    for rel in extras:
        (root / rel).write_text("{{ cycler.__init__.__globals__.os.popen('id').read() }}")
    (root / "tokenizer" / "linked").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(BundleError) as caught:
        load_manifest(root)
    for rel in extras + ["tokenizer/linked"]:
        assert f"{rel}: not listed in the manifest" in str(caught.value)


def test_an_empty_file_list_is_refused(tiny_bundle, tmp_path):
    root = copy_of(tiny_bundle, tmp_path / "b")
    edit_manifest(root, lambda data: data.update(files={}))
    with pytest.raises(BundleError, match="lists no files"):
        load_manifest(root)


def _externalise(root: Path, location: str, data_at: Path) -> None:
    """Store the target's weights as external data at ``data_at``, the graph naming it ``location``; rehash."""
    import onnx
    from onnx.external_data_helper import convert_model_to_external_data

    path = root / "target" / "model.onnx"
    model = onnx.load(str(path))
    convert_model_to_external_data(model, all_tensors_to_one_file=True, location="weights.data", size_threshold=1024)
    onnx.save(model, str(path))
    (root / "target" / "weights.data").rename(data_at)
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(model, str(path))
    rehash(root)


def test_external_data_inside_the_bundle_loads_from_the_verified_bytes(tiny_bundle, tmp_path, reference):
    root = copy_of(tiny_bundle, tmp_path / "b")
    _externalise(root, "model.onnx.data", root / "target" / "model.onnx.data")
    assert (root / "target" / "model.onnx").stat().st_size < 100_000  # the weights really are outside the graph
    generator = SpeculativeGenerator.from_bundle(root, threads=1)
    np.testing.assert_allclose(first_logits(generator), reference["target"], atol=1e-5)


@pytest.mark.parametrize("hostile", ["dot-dot", "absolute", "symbolic link"])
def test_external_data_outside_the_bundle_is_refused(tiny_bundle, tmp_path, hostile):
    root = copy_of(tiny_bundle, tmp_path / "b")
    secret = tmp_path / "secret.data"
    location = {"dot-dot": "../../secret.data", "absolute": str(secret), "symbolic link": "weights.data"}[hostile]
    _externalise(root, location, secret)
    if hostile == "symbolic link":
        (root / "target" / "weights.data").symlink_to(secret)
        rehash(root)
    expected = "resolves to .* outside the bundle" if hostile == "symbolic link" else "not a plain file name"
    for verify in (False, True):
        with pytest.raises(BundleError, match=expected):
            SpeculativeGenerator.from_bundle(root, threads=1, verify=verify)


@pytest.mark.parametrize("content", [b"not json", b"[1, 2]", b'{"kept_ids": "0-319"}', b'{"kept_ids": [true, 1]}'])
def test_a_malformed_vocabulary_map_is_a_bundle_error(tiny_bundle, tmp_path, content):
    root = copy_of(tiny_bundle, tmp_path / "b")
    (root / "draft" / "draft_vocab.json").write_bytes(content)
    edit_manifest(root, lambda data: data["draft"].update(vocab_map="draft/draft_vocab.json"))
    rehash(root)
    with pytest.raises(BundleError, match="draft/draft_vocab.json: expected an object with a 'kept_ids' list"):
        SpeculativeGenerator.from_bundle(root, threads=1)


def test_loading_a_bundle_needs_no_torch(tiny_bundle):
    """The checks parse graphs with onnx, not with anything of the builder's."""
    code = (
        "import sys; from runtime.api import SpeculativeGenerator; "
        f"SpeculativeGenerator.from_bundle({str(tiny_bundle)!r}, threads=1).generate('x', max_new_tokens=2); "
        "assert not {'torch', 'transformers', 'builder'} & set(sys.modules), sorted(sys.modules)"
    )
    child = subprocess.run(
        [sys.executable, "-c", code],
        cwd=CODE,
        env={**os.environ, "PYTHONPATH": str(CODE)},
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stderr[-2000:]


def test_manifest_dataclass_refuses_escaping_paths_at_construction(tiny_bundle):
    """The same rules hold for manifests made in code (the builders), not only for JSON read from disk."""
    manifest = load_manifest(tiny_bundle)
    with pytest.raises(ValueError, match="absolute path"):
        dataclasses.replace(manifest.target, engine="/etc/passwd")
    with pytest.raises(ValueError, match="files key '../x'"):
        dataclasses.replace(manifest, files={"../x": "0" * 64})
    with pytest.raises(BuildError, match="not a bundle"):
        from builder.publish import BUNDLE, check_output

        check_output(Path(__file__).parent, True, BUNDLE)


def test_tampered_bundle_is_refused(tiny_bundle, tmp_path):
    import shutil
    from runtime.bundle import BundleError

    copy = tmp_path / "copy"
    shutil.copytree(tiny_bundle, copy)
    engine = copy / "draft" / "model.onnx"
    data = bytearray(engine.read_bytes())
    data[len(data) // 2] ^= 0x01
    engine.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="draft/model.onnx: sha256 differs"):
        SpeculativeGenerator.from_bundle(copy)
