"""A bundle is what its manifest says and only that, what loads is what was hashed, and replacing a bundle (or a draft,
or a Triton repository) never loses the user's folder: one test per hostile input or failure point.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from builder.build import build

from builder.errors import BuildError
from builder.cli import main as build_engines
from runtime.api import SpeculativeGenerator
from runtime.bundle import BuildSpec, BundleError, Manifest, hash_tree, load_manifest

ROOT = Path(__file__).resolve().parents[1]
CODE = Path(sys.modules["builder"].__file__).resolve().parents[1]  # the checkout whose builder the tests import
PROMPT = "The quick brown"


def copy_of(bundle: Path, dest: Path) -> Path:
    shutil.copytree(bundle, dest, symlinks=True)
    return dest


def edit_manifest(root: Path, change) -> None:
    """Apply ``change`` to the raw manifest data (a hostile author writes whatever JSON they like)."""
    data = json.loads((root / "manifest.json").read_text())
    change(data)
    (root / "manifest.json").write_text(json.dumps(data))


def rehash(root: Path) -> None:
    """List and hash every file as it now is: a hostile author makes the manifest vouch for their files."""
    edit_manifest(root, lambda data: data.update(files=hash_tree(root)))


def first_logits(generator: SpeculativeGenerator, role: str = "target") -> np.ndarray:
    engine = getattr(generator, role)
    ids = np.asarray([generator.tokenizer.encode(PROMPT)], dtype=np.int64)
    return engine.forward(engine.new_cache(1), ids)


@pytest.fixture(scope="module")
def reference(tiny_bundle):
    """The pristine bundle's target and draft logits on PROMPT."""
    generator = SpeculativeGenerator.from_bundle(tiny_bundle, threads=1)
    return {role: first_logits(generator, role) for role in ("target", "draft")}


# --- 3. every path stays inside the bundle ------------------------------------------------------------------------


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


# --- 4. the bundle holds exactly the files it lists ---------------------------------------------------------------


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


# --- 5. external data stays inside the bundle ---------------------------------------------------------------------


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


def _tiny_graph_with(tensor_place: str, location: str):
    """A model with one external-data tensor placed in an initializer, a sparse initializer, a Constant node, a
    subgraph or a function; or an EPContext node."""
    from onnx import TensorProto, helper

    tensor = helper.make_tensor("W", TensorProto.FLOAT, [1], [0.0])
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    out = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    graph_in, nodes, inits, sparse, functions = [], [], [], [], []
    if tensor_place == "initializer":
        inits, nodes = [tensor], [helper.make_node("Identity", ["W"], ["Y"])]
    elif tensor_place == "sparse initializer":
        indices = helper.make_tensor("I", TensorProto.INT64, [1], [0])
        sparse = [helper.make_sparse_tensor(tensor, indices, [4])]
        nodes = [helper.make_node("Identity", ["W"], ["Y"])]
    elif tensor_place == "constant":
        nodes = [helper.make_node("Constant", [], ["Y"], value=tensor)]
    elif tensor_place == "subgraph":
        branch = helper.make_graph([helper.make_node("Constant", [], ["Y"], value=tensor)], "branch", [], [out])
        graph_in = [helper.make_tensor_value_info("C", TensorProto.BOOL, [])]
        nodes = [helper.make_node("If", ["C"], ["Y"], then_branch=branch, else_branch=branch)]
    elif tensor_place == "function":
        body = helper.make_node("Constant", [], ["Z"], value=tensor)
        functions = [helper.make_function("local", "F", [], ["Z"], [body], [helper.make_opsetid("", 18)])]
        nodes = [helper.make_node("F", [], ["Y"], domain="local")]
    elif tensor_place == "EPContext":
        nodes = [
            helper.make_node("EPContext", [], ["Y"], domain="com.microsoft", ep_cache_context=location, embed_mode=0)
        ]
    graph = helper.make_graph(nodes, "g", graph_in, [out], inits, sparse_initializer=sparse)
    model = helper.make_model(
        graph, functions=functions, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("local", 1)]
    )
    return model.SerializeToString()


@pytest.mark.parametrize("place", ["initializer", "sparse initializer", "constant", "subgraph", "function"])
@pytest.mark.parametrize("location", ["../x.data", "/etc/passwd", "*/_ORT_MEM_ADDR_/*", "a/../../x", "C:\\x.data"])
def test_every_tensor_of_the_graph_is_checked_for_its_data_location(place, location):
    """Not only initializers: constants, subgraphs and functions can hold external data too; ONNX Runtime's
    in-memory address tag would read raw process memory."""
    from runtime.engines.onnx_checks import external_data_locations

    with pytest.raises(BundleError, match="W.*not a plain file name"):
        external_data_locations(_tiny_graph_with(place, location), "target/model.onnx")
    assert external_data_locations(_tiny_graph_with(place, "model.onnx.data"), "t") == {"model.onnx.data"}


def test_an_epcontext_node_is_refused():
    from runtime.engines.onnx_checks import external_data_locations

    with pytest.raises(BundleError, match="EPContext"):
        external_data_locations(_tiny_graph_with("EPContext", "../engine.bin"), "target/model.onnx")


def test_a_graph_that_does_not_parse_is_a_bundle_error():
    from runtime.engines.onnx_checks import external_data_locations

    with pytest.raises(BundleError, match="not a valid ONNX model"):
        external_data_locations(b"\xff\xff\xff\xff not protobuf", "target/model.onnx")


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


# --- 6. what loads is what was hashed ------------------------------------------------------------------------------


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


# --- 7. a replace that is interrupted between its renames loses nothing -------------------------------------------


def _prepared_partial(tiny_bundle: Path, out: Path) -> Path:
    """A finished build's folder beside ``out`` (a copy of the tiny bundle with a mark in its report)."""
    tmp = copy_of(tiny_bundle, out.parent / f".{out.name}.partial-testtest")
    edit_manifest(tmp, lambda data: data["report"].update(generation="new"))
    return tmp


def test_a_finished_staging_folder_is_not_a_bundle_until_it_is_published(tiny_bundle, tmp_path):
    """Between its manifest and the rename a build's staging folder holds every file: a kill there must still not
    leave something a loader takes (the random-kill test in test_faults hit this window)."""
    tmp = _prepared_partial(tiny_bundle, tmp_path / "out")
    with pytest.raises(BundleError, match="staging folder, not a bundle"):
        load_manifest(tmp)
    assert load_manifest(tmp, staging=True).report["generation"] == "new"  # what the build checks before publishing


def test_a_failed_second_rename_puts_the_old_bundle_back(tiny_bundle, tmp_path, monkeypatch):
    from builder import publish

    out = copy_of(tiny_bundle, tmp_path / "out")
    tmp = _prepared_partial(tiny_bundle, out)
    manifest = Manifest.from_json((tmp / "manifest.json").read_text())
    real, calls = os.rename, []

    def second_rename_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(5, "Input/output error (injected)")
        real(src, dst)

    monkeypatch.setattr(os, "rename", second_rename_fails)
    with pytest.raises(OSError, match="injected"):
        publish.finish_bundle(tmp, manifest, out, lambda name: None)
    monkeypatch.undo()
    assert load_manifest(out).report.get("generation") is None  # the old bundle, complete
    assert not list(tmp_path.glob(".out.old-*"))


def _kill_during_finish(tiny_bundle: Path, out: Path, when: str) -> None:
    """Run the builder's final step in a child that SIGKILLs itself after the first rename or during the old
    bundle's removal, as an OOM kill or a power cut would."""
    tmp = _prepared_partial(tiny_bundle, out)
    script = textwrap.dedent(f"""
        import os, shutil, signal
        from pathlib import Path
        from builder import publish
        from runtime.bundle import Manifest
        tmp, out = Path({str(tmp)!r}), Path({str(out)!r})
        real_rename, real_rmtree = os.rename, shutil.rmtree
        def rename(src, dst):
            real_rename(src, dst)
            if {when!r} == "between renames":
                os.kill(os.getpid(), signal.SIGKILL)
        def rmtree(path, *args, **kwargs):
            if ".old-" in str(path) and {when!r} == "before cleanup":
                os.kill(os.getpid(), signal.SIGKILL)
            real_rmtree(path, *args, **kwargs)
        os.rename, shutil.rmtree = rename, rmtree
        publish.finish_bundle(tmp, Manifest.from_json((tmp / "manifest.json").read_text()), out, lambda name: None)
    """)
    child = subprocess.run(
        [sys.executable, "-c", script],
        cwd=CODE,
        env={**os.environ, "PYTHONPATH": str(CODE)},
        capture_output=True,
        text=True,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]


def _next_run(tiny_pair, out: Path, force: bool = True) -> None:
    """The next build-engines run on ``out``, stopped at its first stage (all the recovery happens before)."""

    def stop(name):
        raise KeyboardInterrupt(name)

    with pytest.raises(KeyboardInterrupt):
        build(BuildSpec(target=str(tiny_pair[0]), draft="self"), out, force=force, on_stage=stop)


def test_a_build_killed_between_the_renames_is_recovered_by_the_next_run(tiny_bundle, tiny_pair, tmp_path, caplog):
    out = copy_of(tiny_bundle, tmp_path / "out")
    _kill_during_finish(tiny_bundle, out, "between renames")
    assert not out.exists() and len(list(tmp_path.glob(".out.old-*"))) == 1  # the window: no bundle at out
    with pytest.raises(BundleError, match="interrupted set the previous one aside in .*out.old-"):
        load_manifest(out)  # a loader meanwhile says where the bundle is
    _next_run(tiny_pair, out)
    assert load_manifest(out).report.get("generation") is None  # the old bundle is back, whole
    assert "put" in caplog.text and "back from .out.old-" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_build_killed_after_the_renames_keeps_the_new_bundle(tiny_bundle, tiny_pair, tmp_path, caplog):
    out = copy_of(tiny_bundle, tmp_path / "out")
    _kill_during_finish(tiny_bundle, out, "before cleanup")
    _next_run(tiny_pair, out)
    assert load_manifest(out).report["generation"] == "new"
    assert "removed .out.old-" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_every_file_is_fsynced_before_the_bundle_is_renamed_into_place(tiny_bundle, tmp_path, monkeypatch):
    from builder import publish

    out = tmp_path / "out"
    tmp = _prepared_partial(tiny_bundle, out)
    manifest = Manifest.from_json((tmp / "manifest.json").read_text())
    files = {str(p.resolve()) for p in tmp.rglob("*") if p.is_file()}
    events, real_fsync, real_rename = [], os.fsync, os.rename
    monkeypatch.setattr(
        os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))
    )
    monkeypatch.setattr(os, "rename", lambda src, dst: (events.append(("rename", str(src))), real_rename(src, dst)))
    publish.finish_bundle(tmp, manifest, out, lambda name: None)
    rename_at = events.index(("rename", str(tmp)))
    synced = {path for kind, path in events[:rename_at] if kind == "fsync"}
    assert files <= synced and str(tmp.resolve()) in synced
    assert ("fsync", str(tmp_path.resolve())) in events[rename_at:]  # the parent folder, after the rename


# --- 8. partial folders of dead builds are removed, and the user is told -------------------------------------------


def test_stale_partial_folders_are_removed_and_live_ones_kept(tiny_pair, tmp_path, caplog):
    from builder.publish import lock as _lock

    out = tmp_path / "out"
    dead = [tmp_path / ".out.partial-dead0001", tmp_path / ".out.partial-dead0002"]
    for folder in dead:
        (folder / "target").mkdir(parents=True)
        (folder / "target" / "model.onnx").write_bytes(b"\0" * 2_000_000)
    live = tmp_path / ".out.partial-live0001"
    live.mkdir()
    other = tmp_path / ".other.partial-dead0003"  # another output's: not ours to judge
    other.mkdir()
    held = _lock(live, blocking=False)  # a build still running holds its folder
    try:
        _next_run(tiny_pair, out, force=False)
    finally:
        os.close(held)
    assert not any(folder.exists() for folder in dead) and live.is_dir() and other.is_dir()
    for folder in dead:
        assert f"removed {folder.name} (2.0 MB), left by a build" in caplog.text


# --- 9. --force / --overwrite replace only what we made ------------------------------------------------------------


def _user_folder(path: Path) -> dict[str, str]:
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("months of work")
    (path / "sub" / "data.csv").write_text("1,2,3")
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def _contents(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("hostile", ["user folder", "unparsable manifest", "manifest of something else"])
def test_force_refuses_a_folder_that_is_not_a_bundle(tiny_pair, tmp_path, hostile):
    out = tmp_path / "work"
    _user_folder(out)
    if hostile == "unparsable manifest":
        (out / "manifest.json").write_text("{ not json")
    elif hostile == "manifest of something else":
        (out / "manifest.json").write_text(json.dumps({"name": "my web app", "version": "1.0"}))
    before = _contents(out)
    result = CliRunner().invoke(
        build_engines, ["--target", str(tiny_pair[0]), "--draft", "self", "--out", str(out), "--force"]
    )
    assert result.exit_code != 0
    assert "is not a bundle" in result.output and "nothing was touched" in result.output
    assert _contents(out) == before and [p.name for p in tmp_path.iterdir()] == ["work"]


def test_overwrite_refuses_a_folder_that_is_not_a_generated_repository(tiny_bundle, tmp_path):
    from runtime.cli import main as draftsmith

    for out in (tmp_path / "work", copy_of(tiny_bundle, tmp_path / "bundle")):  # a user's folder; the bundle itself
        if out.name == "work":
            _user_folder(out)
        before = _contents(out)
        result = CliRunner().invoke(draftsmith, ["triton-repo", str(tiny_bundle), str(out), "--overwrite"])
        assert result.exit_code != 0 and "is not a repository written by draftsmith" in result.output
        assert _contents(out) == before


def test_overwrite_replaces_a_repository_written_before_the_marker(tiny_bundle, tmp_path):
    from triton_repo.generate import MARKER, RepoOptions, write_repository

    out = write_repository(tiny_bundle, tmp_path / "repo", RepoOptions(copy_bundle=False, bundle_mount="/bundles/t"))
    (out / MARKER).unlink()  # an older Draftsmith's repository: only our four model folders
    write_repository(tiny_bundle, out, overwrite=True)
    assert (out / MARKER).is_file() and (out / "speculative" / "bundle" / "manifest.json").is_file()


# --- 10. distill --force swaps the draft in whole -------------------------------------------------------------------


@pytest.fixture
def old_draft(tmp_path):
    from conftest import make_model, make_tokenizer, tiny_config

    folder = tmp_path / "draft"
    make_tokenizer(folder)
    make_model(folder, tiny_config(layers=1), seed=9)
    (folder / "distill_report.json").write_text(json.dumps({"generation": "old"}))
    return folder


def test_an_interrupted_distill_force_keeps_the_old_draft(tiny_pair, old_draft, tmp_path, monkeypatch):
    from builder.distill import save
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe

    before = {p.name: p.read_bytes() for p in old_draft.iterdir()}
    (tmp_path / "prompts.txt").write_text("\n".join(f"the quick brown fox {i}" for i in range(12)))

    def save_then_die(draft, tokenizer, out, kept, report):
        draft.save_pretrained(str(out))  # the weights are written; the process dies before the rest
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(save, "save_draft", save_then_die)  # publish_draft calls it there
    with pytest.raises(KeyboardInterrupt):
        distill_draft(
            DistillRecipe(init="layers=1", prompts=tmp_path / "prompts.txt", max_new_tokens=4, train_steps=1),
            str(tiny_pair[0]),
            old_draft,
            force=True,
            quiet=True,
        )
    assert {p.name: p.read_bytes() for p in old_draft.iterdir()} == before  # untouched: no new weights, old report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "prompts.txt"]


def test_distill_force_refuses_a_folder_that_is_not_a_draft(tiny_pair, tmp_path):
    from builder.distill.corpus import DistillError
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe

    out = tmp_path / "work"
    before = _user_folder(out)
    with pytest.raises(DistillError, match="is not a draft folder .*nothing was touched"):
        distill_draft(DistillRecipe(init="layers=1", train_steps=1), str(tiny_pair[0]), out, force=True, quiet=True)
    assert _contents(out) == before


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


# --- distill --force replaces only what the distiller wrote, never the target -------------------------------------


def _copy_model(source: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(source, dest)
    return dest


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(f"the quick brown fox {i}" for i in range(12)))
    return path


# (what --out is, relative to the target) -> how the test lays it out
BAD_OUTS = [
    "the target itself",
    "the target, spelt with ./",
    "the target through a symbolic link",
    "a folder holding the target",
    "a new folder inside the target",
    "another model folder",
    "an init checkpoint",
    "the folder holding a .gguf target",
    "a model folder with only a weights file",
]


@pytest.mark.parametrize("case", BAD_OUTS)
def test_distill_force_never_replaces_the_target_or_a_model_it_did_not_write(tiny_pair, tmp_path, prompt_file, case):
    from builder.distill.corpus import DistillError
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe

    models = tmp_path / "models"
    target = _copy_model(tiny_pair[0], models / "target")
    init = "layers=1"
    if case == "the target itself":
        out = target
    elif case == "the target, spelt with ./":
        out = Path(str(models) + "/./target/")
    elif case == "the target through a symbolic link":
        out = tmp_path / "link"
        out.symlink_to(target, target_is_directory=True)
    elif case == "a folder holding the target":
        out = models
    elif case == "a new folder inside the target":
        out = target / "draft"
    elif case == "another model folder":
        out = _copy_model(tiny_pair[1], tmp_path / "my-draft")
    elif case == "an init checkpoint":
        out = _copy_model(tiny_pair[1], tmp_path / "init")
        init = str(out)
    elif case == "the folder holding a .gguf target":
        gguf = models / "target.gguf"
        gguf.write_bytes(b"GGUF")
        target, out = gguf, models
    else:
        out = tmp_path / "weights"
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out / "model.safetensors").write_bytes(b"\0" * 64)
    before = _contents(models), _contents(out.resolve()) if out.exists() else None
    with pytest.raises(DistillError, match="nothing was touched|symbolic link"):
        distill_draft(
            DistillRecipe(init=init, prompts=prompt_file, max_new_tokens=4, train_steps=1),
            str(target),
            out,
            force=True,
            quiet=True,
        )
    assert (_contents(models), _contents(out.resolve()) if out.exists() else None) == before


def test_distill_force_replaces_its_own_draft(tiny_pair, old_draft, prompt_file):
    """The marker is the distiller's own report: a draft it wrote is replaced (and says so in its new report)."""
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe

    distill_draft(
        DistillRecipe(init="layers=1", prompts=prompt_file, max_new_tokens=4, train_steps=1),
        str(tiny_pair[0]),
        old_draft,
        force=True,
        quiet=True,
    )
    assert json.loads((old_draft / "distill_report.json").read_text()).get("generation") != "old"


# --- publish checks --out again under the lock, just before the rename --------------------------------------------


@pytest.mark.parametrize(
    "force,appeared",
    [(False, "a user's folder"), (True, "a user's folder"), (True, "a symbolic link"), (False, "a file")],
)
def test_publish_refuses_what_appeared_at_out_during_the_build(tmp_path, force, appeared):
    from builder import publish as publishing

    kind = publishing.Kind("result", lambda f: None if (f / "ours").is_file() else "not ours", ValueError)
    out = tmp_path / "out"
    with publishing.staging(out, force, kind) as tmp:
        (tmp / "ours").write_text("new")
        if appeared == "a user's folder":  # made while the build ran, after staging checked out
            _user_folder(out)
        elif appeared == "a symbolic link":
            (tmp_path / "elsewhere").mkdir()
            out.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
        else:
            out.write_text("notes")
        before = _contents(out) if out.is_dir() else out.read_text()
        with pytest.raises(ValueError, match=str(out)):
            publishing.publish(tmp, out)
    assert (_contents(out) if out.is_dir() else out.read_text()) == before


# --- triton-repo --overwrite writes the new repository beside the old one, then swaps -----------------------------


@pytest.mark.parametrize("failure", ["max_tokens_limit past the context", "the bundle copy fails"])
def test_a_failed_overwrite_keeps_the_old_repository(tiny_bundle, tmp_path, monkeypatch, failure):
    from triton_repo.generate import RepoOptions, RepositoryError, write_repository

    out = write_repository(tiny_bundle, tmp_path / "repo", RepoOptions(copy_bundle=False, bundle_mount="/b"))
    before = _contents(out)
    options = RepoOptions()
    if failure == "max_tokens_limit past the context":
        options = RepoOptions(max_tokens_limit=load_manifest(tiny_bundle).max_context + 1)
    else:  # no hard link across devices, and a copy that comes out short (a disk that filled, a file cut)
        import errno

        def cross_device(src, dst, *args, **kwargs):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        def short_copy(src, dst, *args, **kwargs):
            data = Path(src).read_bytes()
            Path(dst).write_bytes(data[: len(data) // 2])

        monkeypatch.setattr(os, "link", cross_device)
        monkeypatch.setattr(shutil, "copy2", short_copy)
    with pytest.raises(RepositoryError, match="" if failure.startswith("max") else "does not verify"):
        write_repository(tiny_bundle, out, options, overwrite=True)
    monkeypatch.undo()
    assert _contents(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["repo"]
    write_repository(tiny_bundle, out, RepoOptions(copy_bundle=False, bundle_mount="/c"), overwrite=True)
    assert "/c" in (out / "speculative" / "config.pbtxt").read_text()


# --- tokenizer steps that grow their input are refused at load ----------------------------------------------------


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


# --- 6b. One verified load, and a tokenizer folder reads only a tokenizer -----------------------------------------


def test_open_generator_loads_what_it_verified(tiny_bundle, tmp_path, monkeypatch):
    """open_generator verified the bundle, then loaded it again with verify=False: an engine swapped in between
    loaded unchecked. Now the loader verifies the bytes it loads."""
    import runtime.trtllm.engine
    from runtime.trtllm.engine import open_generator

    root = copy_of(tiny_bundle, tmp_path / "b")
    swapped = (root / "draft" / "model.onnx").read_bytes()  # another valid engine
    real = runtime.trtllm.engine.load_manifest

    def verify_then_swap(path, verify=True):
        manifest = real(path, verify=verify)
        (root / "target" / "model.onnx").write_bytes(swapped)
        return manifest

    monkeypatch.setattr(runtime.trtllm.engine, "load_manifest", verify_then_swap)
    with pytest.raises(BundleError, match="target/model.onnx: sha256 differs from the manifest"):
        open_generator(root, threads=1)


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
