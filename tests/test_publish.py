"""Replacing a bundle never loses the user's folder (builder/publish.py): a finished staging folder is not a bundle
until published, a replace interrupted between its renames loses nothing, every file is fsynced first, dead builds'
partial folders are removed, and --force replaces only what we made."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from builder.build import build
from builder.cli import main as build_engines
from bundle_edits import CODE, _contents, _user_folder, copy_of, edit_manifest
from runtime.bundle import BuildSpec, BundleError, Manifest, load_manifest


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
