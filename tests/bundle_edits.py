"""Copies of a bundle edited as a hostile author would edit them (the manifest rewritten, the files rehashed), and a
user's folder that --force / --overwrite must never replace: what the bundle, loader, publish, tokenizer and
Triton-repository tests share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

import builder
from runtime.api import SpeculativeGenerator
from runtime.bundle import hash_tree


CODE = Path(builder.__file__).resolve().parents[1]  # the checkout whose builder the tests import
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


def _user_folder(path: Path) -> dict[str, str]:
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("months of work")
    (path / "sub" / "data.csv").write_text("1,2,3")
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def _contents(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}
