"""Publishing a result folder whole: written into a hidden folder beside its place, then renamed into it.

Neither the build's nor the distiller's: a bundle (``builder.build``) and a distilled draft (``builder.distill.save``)
are published the same way, each naming what it is (a ``Kind``). An interrupted run leaves at most a hidden
``.NAME.partial-*`` folder, which no loader takes for a result and the next run removes (``staging``); replacing a
result sets the old one aside in ``.NAME.old-*`` first, which the next run puts back if the swap did not finish
(``publish``, ``recover``).

A bundle's kind (``BUNDLE``) and its last step (``finish_bundle``: hashed, its manifest written last and loaded back,
then published) are here too: the ONNX Runtime build (``builder.build``) and the TensorRT-LLM build
(``builder.trtllm.build``) end their bundles the same way.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from builder.errors import BuildError
from builder.progress import Stage
from runtime.bundle import MANIFEST, Manifest, hash_tree, load_manifest

log = logging.getLogger(__name__)
Replaceable = Callable[[Path], "str | None"]  # why a folder may not be replaced (None: it may)


@dataclasses.dataclass(frozen=True)
class Kind:
    """What is published.

    Attributes:
        name: how messages call it ("bundle", "draft folder").
        problem: why an existing folder may not be replaced by one (None: it is one of ours and may be).
        error: the exception a refusal raises, the caller's own (its CLI already catches it).
    """

    name: str
    problem: Replaceable
    error: type[Exception]


# staging folder -> (force, kind) its ``staging`` checked ``out`` with: ``publish`` checks again under the lock, for a
# build runs for minutes and anything may appear at ``out`` meanwhile.
_STAGED: dict[Path, tuple[bool, Kind]] = {}


def check_output(out: Path, force: bool, kind: Kind) -> None:
    """Refuse an existing ``out`` unless ``force``, and even then anything ``kind.problem`` finds a reason against:
    --force replaces a previous result, never an arbitrary folder."""
    if not (out.exists() or out.is_symlink()) or (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):
        return  # nothing there, or an empty folder: nothing to lose
    what = kind.name
    if not force:
        raise kind.error(
            f"{out} already exists; pass --force to replace it (the old {what} stays until the new one is complete)"
        )
    if out.is_symlink() or not out.is_dir():
        raise kind.error(
            f"{out} exists and is not a directory (or is a symbolic link); --force replaces only a "
            f"{what} folder. Choose another output path."
        )
    problem = kind.problem(out)
    if problem:
        raise kind.error(
            f"{out} is not a {what} ({problem}); --force replaces only a {what} or an empty folder, so "
            "nothing was touched. Choose another output path, or move that folder away yourself."
        )


@contextmanager
def staging(out: Path, force: bool, kind: Kind) -> Iterator[Path]:
    """A new hidden folder beside ``out`` to write a result into; removed on the way out unless ``publish`` moved it.

    While it exists this process holds a lock on it (flock, released by the kernel if the process dies), which is
    how a later run tells a live run's folder from a dead one's. Before making it, under the parent folder's lock:
    a swap a killed run left half done is undone and stale partial folders are removed (``recover``, which says so),
    and ``out`` is checked again (``check_output``).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out.parent, blocking=True):
        recover(out)
        check_output(out, force, kind)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        held = lock(tmp, blocking=False)
    _STAGED[tmp] = (force, kind)
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a result is read by servers running as other users
        yield tmp
    finally:
        _STAGED.pop(tmp, None)
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        os.close(held)


def publish(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out``, replacing what is there, recoverably.

    Files and folders are fsynced first. Under the parent folder's lock ``out`` is checked again as ``staging``
    checked it (``check_output``): a folder, file or link that appeared there while the result was being made is
    refused, not replaced. An existing ``out`` is renamed into ``.NAME.old-*``, then ``tmp`` to ``out``, then the old
    one is deleted. If the second rename fails the old one is put back at once; if the process dies between the
    renames, the next ``staging`` for ``out`` puts it back (``recover``).
    """
    _fsync_tree(tmp)
    with locked(out.parent, blocking=True):
        if tmp in _STAGED:
            check_output(out, *_STAGED[tmp])
        old = None
        try:
            if out.exists() or out.is_symlink():
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                os.rename(out, old / out.name)
                _fsync_dir(out.parent)
            os.rename(tmp, out)
        except BaseException:
            if old is not None:
                if (old / out.name).exists() and not (out.exists() or out.is_symlink()):
                    os.rename(old / out.name, out)
                shutil.rmtree(old, ignore_errors=True)
            raise
        _fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def recover(out: Path) -> None:
    """Undo what killed runs left beside ``out``, saying what was done (call under the parent folder's lock).

    A ``.NAME.old-*`` folder is the previous ``out`` set aside by a replace: put back when ``out`` is missing (the
    process died between the renames), deleted otherwise (it died after them). A ``.NAME.partial-*`` folder no live
    process holds (see ``staging``) is a dead run's and is deleted.
    """
    for old in _leftovers(out, "old"):
        previous = old / out.name
        if not (out.exists() or out.is_symlink()) and previous.is_dir():
            os.rename(previous, out)
            _fsync_dir(out.parent)
            log.warning("put %s back from %s: a replace was interrupted between its two renames", out, old.name)
        else:
            log.warning("removed %s, the leftover of a replace of %s that had finished", old.name, out)
        shutil.rmtree(old, ignore_errors=True)
    for partial in _leftovers(out, "partial"):
        try:
            held = lock(partial, blocking=False)
        except BlockingIOError:
            continue  # a live run is writing it
        try:
            size = sum(p.stat().st_size for p in partial.rglob("*") if p.is_file() and not p.is_symlink())
            shutil.rmtree(partial, ignore_errors=True)
        finally:
            os.close(held)
        log.warning(
            "removed %s (%.1f MB), left by a build of %s that was killed or ran out of memory",
            partial.name,
            size / 1e6,
            out,
        )


def lock(folder: Path, blocking: bool) -> int:
    """An open descriptor of ``folder`` holding an exclusive flock on it; BlockingIOError if another holds it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def locked(folder: Path, blocking: bool) -> Iterator[None]:
    """``lock`` for the length of a ``with`` block."""
    fd = lock(folder, blocking)
    try:
        yield
    finally:
        os.close(fd)


def _leftovers(out: Path, kind: str) -> list[Path]:
    """The real folders beside ``out`` named as ``tempfile.mkdtemp`` names our ``.NAME.{kind}-*`` ones."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.{kind}-[A-Za-z0-9_]{{8}}")
    if not out.parent.is_dir():
        return []
    return sorted(p for p in out.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink())


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder below ``root`` (and ``root``): a rename must not land before the data."""
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- bundles: their kind, and how each build ends one ----------------------------------------------------------------


def bundle_problem(folder: Path) -> str | None:
    """Why --force may not replace ``folder`` (None: a bundle, i.e. a manifest.json that parses as one, of any schema
    version)."""
    manifest = folder / MANIFEST
    if manifest.is_symlink() or not manifest.is_file():
        return f"it holds no {MANIFEST}"
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"its {MANIFEST} does not parse ({err})"
    if not isinstance(data, dict) or not isinstance(data.get("schema_version"), int) or "files" not in data:
        return f"its {MANIFEST} is not a bundle manifest"
    return None


BUNDLE = Kind("bundle", bundle_problem, BuildError)


def finish_bundle(tmp: Path, manifest: Manifest, out: Path, stage: Stage) -> Manifest:
    """Hash, write the manifest last, check the result loads, then publish it at ``out``. The
    TensorRT-LLM build ends its bundles the same way (builder/trtllm/build.py)."""
    stage("manifest")
    complete = dataclasses.replace(manifest, files=hash_tree(tmp))
    (tmp / MANIFEST).write_text(complete.to_json(), encoding="utf-8")
    load_manifest(tmp, verify=True, staging=True)
    publish(tmp, out)
    return complete
