"""No import circle between folders: inside every package, its folders and modules form layers.

tests/test_layout.py keeps the modules free of circles; this test keeps the folders free of them too, so a folder can
be read, tested or moved with only what lies below it (a drafter without the schema, a server without the Python API).

The node rule. Inside each directory (a package) the nodes are its children: every subdirectory, with all that lies
beneath it, is one node, and every module directly in the directory is a node of its own (``runtime/api.py``,
``runtime/__init__.py``). An import from file A to file B is an arrow between the two children of their deepest
common directory that hold them: ``runtime/serving/x.py`` importing ``runtime/core/request.py`` is the arrow
``runtime/serving/ -> runtime/core/request.py``, ``runtime/drafters/model.py`` importing ``runtime/engines/base.py`` is
``runtime/drafters/ -> runtime/engines/``, and ``builder/...`` importing ``runtime/...`` is ``builder/ -> runtime/``.
A circle among the children of one directory is a circle between folders (or between a folder and a module beside
it: ``request.py`` importing ``serving/`` while ``serving/`` imports ``request.py`` is one). Why a module beside the
folders is a node of its own rather than all of a directory's modules one node: ``runtime/errors.py`` (imported by
nearly every folder) and ``runtime/api.py`` (which imports the scheduler) are separate layers of the runtime, not one
room; joining them would only report the directory as a whole, never a tie a change could cut.

Which imports count is tests/test_layout.py's ``arrows``: module-level and function-level imports alike (a lazy
import only moves a circle from import time to call time), ``importlib.import_module``/``__import__`` with a literal
name, and the package ``__init__.py`` files Python runs on the way. Imports under ``if TYPE_CHECKING:`` count too (the
project has none; a type-only import still ties two folders for the reader).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import test_layout
from test_layout import arrows, import_circles, module_name

Tie = tuple[str, str]  # (the importing file:line, the module it imports)


def node_pair(source: Path, target: Path, root: Path) -> tuple[str, str]:
    """The children of ``source``'s and ``target``'s deepest common directory that hold them, as paths: a directory
    ends in ``/`` (``runtime/serving/``), a module is its file (``runtime/api.py``)."""
    a, b = source.relative_to(root).parts, target.relative_to(root).parts
    common = 0
    while a[common] == b[common]:  # two different files: they part before either path ends
        common += 1

    def child(parts: tuple[str, ...]) -> str:
        name = "/".join(parts[: common + 1])
        return name if len(parts) == common + 1 else name + "/"

    return child(a), child(b)


def folder_graph(modules: dict[str, Path], root: Path) -> tuple[dict[str, dict[str, int]], dict[Tie, list[str]]]:
    """The arrows between sibling nodes (see the module docstring), and for each the file imports that make it."""
    graph: dict[str, dict[str, int]] = defaultdict(dict)
    ties: dict[Tie, list[str]] = defaultdict(list)
    for path in modules.values():
        for imported, line in arrows(path, modules).items():
            a, b = node_pair(path, modules[imported], root)
            graph[a][b] = line
            ties[a, b].append(f"{path.relative_to(root).as_posix()}:{line} -> {imported}")
    return graph, ties


def folder_circles(modules: dict[str, Path], root: Path) -> list[str]:
    """Each circle between sibling nodes, described by the file imports that close it."""
    graph, ties = folder_graph(modules, root)
    described = []
    for circle in import_circles(graph):
        members = set(circle)
        inside = [tie for (a, b), found in sorted(ties.items()) if a in members and b in members for tie in found]
        described.append(f"{' <-> '.join(circle)}: " + " ; ".join(inside))
    return described


def test_no_import_circle_between_folders():
    """builder/, runtime/, triton_repo/ and bench/: every directory's children are layers, none imports upward."""
    assert folder_circles(test_layout.project_modules(), test_layout.ROOT) == []


def test_the_folder_guard_finds_a_circle_no_module_circle_shows(tmp_path, monkeypatch):
    """``pkg/sub/a.py -> pkg/top.py -> pkg/sub/b.py``: no module circle import each other, yet the folder ``sub/`` and
    the module ``top.py`` beside it do (a lazy import counts). Arrows inside one node (``sub/a.py -> sub/b.py``)
    and down the layers (``pkg/user.py -> pkg/sub/``) are none."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text(
        "from pkg.sub.b import h\n\n\ndef f():\n    from pkg.top import g\n    return g, h\n"
    )
    (package / "sub" / "b.py").write_text("h = 1\n")
    (package / "top.py").write_text("from pkg.sub.b import h as g\n")
    (package / "user.py").write_text("from pkg.sub import a\n")
    monkeypatch.setattr(test_layout, "ROOT", tmp_path)
    modules = {module_name(p): p for p in sorted(package.rglob("*.py"))}
    assert import_circles({name: arrows(path, modules) for name, path in modules.items()}) == []
    assert folder_circles(modules, tmp_path) == [
        "pkg/sub/ <-> pkg/top.py: pkg/sub/a.py:5 -> pkg.top ; pkg/top.py:1 -> pkg.sub ; pkg/top.py:1 -> pkg.sub.b"
    ]


def test_a_node_is_a_sibling_folder_or_module_under_the_common_directory():
    root = Path("/r")
    assert node_pair(root / "runtime/serving/x.py", root / "runtime/request.py", root) == (
        "runtime/serving/",
        "runtime/request.py",
    )
    assert node_pair(root / "runtime/engines/gguf_ops/build.py", root / "runtime/engines/__init__.py", root) == (
        "runtime/engines/gguf_ops/",
        "runtime/engines/__init__.py",
    )
    assert node_pair(root / "builder/build.py", root / "runtime/drafters/registry.py", root) == ("builder/", "runtime/")
