"""triton-repo --overwrite (triton_repo/generate.py) replaces only a repository draftsmith wrote, and writes the new
one beside the old before swapping: a failed overwrite keeps the old repository."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from bundle_edits import _contents, _user_folder, copy_of
from runtime.bundle import load_manifest


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
