"""The arrows between the packages (README's layout): builder -> runtime <- triton_repo, runtime <- deploy, bench on
top of all.

- ``runtime`` imports nothing from ``builder``, ``bench``, ``triton_repo`` or ``deploy``. One exception: the
  ``COMMANDS`` table of ``runtime/cli.py``, which names the other packages' click commands so ``draftsmith`` can offer
  them (imported by name when the CLI starts; a missing package drops its commands).
- ``builder`` imports nothing from ``bench`` or ``deploy``, and nothing from ``triton_repo`` outside
  ``builder/cli.py`` (``build-engines --triton-repo`` is glue at the top).
- ``triton_repo`` imports nothing from ``bench``, ``builder`` or ``deploy``.
- ``deploy`` imports nothing from ``bench``, ``builder`` or ``triton_repo`` (a pod's init container names
  triton_repo's repository writer in its command line; that is no import).

Imports count wherever they are: module level, inside functions, ``importlib.import_module("...")`` and
``__import__("...")`` with a literal name.

And no import circle between the project's modules (``test_no_import_circle``). A lazy import inside a function counts
as an arrow like any other: it only moves the circle from import time to call time, and a circle of modules means
neither can be read, tested or moved without the other. An arrow goes to the module named (``import a.b.c``,
``from a.b import c`` where ``c`` is a submodule: ``a/b/c.py``), or to the package's ``__init__.py`` for a name it
defines (``from a.b import name``), and to every package ``__init__.py`` Python runs on the way (``import a.b.c``
runs ``a/__init__.py`` and ``a/b/__init__.py`` first), also from inside the package. So a package ``__init__.py``
that imports its own modules is a circle with each of them that imports a sibling: a package file hands on no names
and imports nothing heavy, and every module imports a name from the module that defines it.

Public seams (``test_no_private_name_crosses_a_module``, ``test_no_re_export``): no module of the packages uses
another module's private name (``from m import _x``, ``m._x`` or ``C._x`` after ``import m`` / ``from m import C``;
tests and scripts may), and none hands on names it imports (``# noqa: F401``, a bare ``# noqa`` on an import,
``import x as x``, an imported name in ``__all__``). A name another module needs is public, with a docstring saying
why it is shared.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "builder", "deploy", "runtime", "triton_repo")

FORBIDDEN = {  # package -> {other package: files of the package allowed to import it}
    "runtime": {"builder": set(), "bench": set(), "triton_repo": set(), "deploy": set()},
    "builder": {"bench": set(), "triton_repo": {"builder/cli.py"}, "deploy": set()},
    "triton_repo": {"bench": set(), "builder": set(), "deploy": set()},
    "deploy": {"bench": set(), "builder": set(), "triton_repo": set()},
}
COMMAND_TABLE = ("runtime/cli.py", "COMMANDS")  # the runtime's one exception: its table of other packages' commands


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module name) of every import in ``tree``, relative imports resolved only by their level."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def module_name(path: Path) -> str:
    """``builder/distill/save.py`` -> ``builder.distill.save``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in python_files(package)}


def imported_from(node: ast.ImportFrom, path: Path) -> str:
    """The dotted module ``node`` imports from, a relative import resolved against ``path``'s package."""
    base = node.module or ""
    if node.level:
        here = module_name(path)
        parts = (here if path.name == "__init__.py" else here.rpartition(".")[0]).split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
    return base


def arrows(path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The project modules ``path`` imports (see the module docstring for which), each with its first line."""
    here = module_name(path)
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        parts = name.split(".")
        for depth in range(1, len(parts)):  # the packages Python runs first (a package importing its own module: not
            outer = ".".join(parts[:depth])  # an arrow to itself)
            if outer in modules and outer != here:
                found.setdefault(outer, line)
        if name in modules:  # outside modules (numpy, ...) are no arrows; a module importing itself is a circle
            found.setdefault(name, line)

    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = imported_from(node, path)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in modules else base, node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.Call):
            for line, name in imported_modules(ast.Module(body=[ast.Expr(node)], type_ignores=[])):
                add(name, line)
    return found


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with a circle in them (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(node: str) -> None:  # the project has ~100 modules: recursion depth is no concern
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, {}):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, {}):
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def command_table(path: Path, name: str) -> tuple[set[int], list[str]]:
    """The lines of the module-level assignment ``name`` in ``path`` and the module names its tuples hold."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            modules = [entry.elts[0].value for entry in node.value.elts]
            return set(range(node.lineno, node.end_lineno + 1)), modules
    raise AssertionError(f"{path}: no {name} table")


def python_files(package: str):
    yield from sorted((ROOT / package).rglob("*.py"))


def violations(package: str) -> list[str]:
    problems = []
    for path in python_files(package):
        rel = path.relative_to(ROOT).as_posix()
        for line, module in imported_modules(ast.parse(path.read_text(encoding="utf-8"), rel)):
            top = module.split(".")[0]
            allowed = FORBIDDEN[package].get(top)
            if allowed is not None and rel not in allowed:
                problems.append(f"{rel}:{line} imports {module}")
    return problems


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_against_the_arrows(package):
    assert violations(package) == []


def test_the_guard_sees_imports_inside_functions_and_by_name():
    tree = ast.parse(
        "def f():\n    from bench.speed import bench\n    import importlib\n"
        "    importlib.import_module('builder.distill')\n    __import__('triton_repo.cli')\n"
    )
    assert [m for _, m in imported_modules(tree)] == ["bench.speed", "importlib", "builder.distill", "triton_repo.cli"]


def test_the_runtime_names_other_packages_only_in_its_command_table():
    """Every string in runtime/ that names a module of bench, builder, deploy or triton_repo sits in the command
    table, and that table registers commands of those packages only (nothing of the runtime's own loads through it)."""
    path, name = ROOT / COMMAND_TABLE[0], COMMAND_TABLE[1]
    lines, modules = command_table(path, name)
    assert modules and all(m.split(".")[0] in ("bench", "builder", "deploy", "triton_repo") for m in modules)
    others = tuple(p for p in PACKAGES if p != "runtime")
    stray = []
    for file in python_files("runtime"):
        rel = file.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.split(".")[0] in others
                and "." in node.value
                and " " not in node.value
                and not (rel == COMMAND_TABLE[0] and node.lineno in lines)
            ):
                stray.append(f"{rel}:{node.lineno} {node.value!r}")
    assert stray == []


def test_every_registered_command_exists():
    """The table's entries import and hold click commands: a moved module must not silently drop a command."""
    import importlib

    import click

    _, modules = command_table(ROOT / COMMAND_TABLE[0], COMMAND_TABLE[1])
    from runtime.cli import COMMANDS

    assert [m for m, _ in COMMANDS] == modules
    for module, attribute in COMMANDS:
        assert isinstance(getattr(importlib.import_module(module), attribute), click.Command), (module, attribute)


def test_no_import_circle():
    """No two modules of the project import each other, directly or round a loop, at module level or in a function."""
    modules = project_modules()
    graph = {name: arrows(path, modules) for name, path in modules.items()}
    described = []
    for circle in import_circles(graph):
        members = set(circle)
        ties = [
            f"{modules[a].relative_to(ROOT)}:{line} -> {b}"
            for a in circle
            for b, line in graph[a].items()
            if b in members
        ]
        described.append(" ; ".join(ties))
    assert described == []


def test_the_circle_guard_sees_a_lazy_import_and_resolves_relative_ones(tmp_path, monkeypatch):
    """A circle closed only by an import inside a function, and one through ``from . import``, are both found."""
    import test_layout

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import thing\n")
    (package / "b.py").write_text("def thing():\n    from pkg import a\n    return a\n")
    (package / "c.py").write_text("from . import d\n")
    (package / "d.py").write_text("from .c import x\n")
    (package / "e.py").write_text("from pkg.a import thing\n")  # imports the circle, is not in it
    monkeypatch.setattr(test_layout, "ROOT", tmp_path)
    modules = {module_name(p): p for p in sorted(package.glob("*.py"))}
    graph = {name: arrows(path, modules) for name, path in modules.items()}
    assert graph["pkg.b"] == {"pkg": 2, "pkg.a": 2} and graph["pkg.c"] == {"pkg": 1, "pkg.d": 1}
    assert import_circles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_a_package_init_counts_as_a_module_on_the_way(tmp_path, monkeypatch):
    """``import a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` first: arrows to both, from inside the package
    too. A package file handing on its modules' names is a circle with every one of them that imports a sibling; one
    importing only a module that imports no sibling is none, and importing its own module is no arrow to itself."""
    import test_layout

    facade, quiet, nested = tmp_path / "facade", tmp_path / "quiet", tmp_path / "outer" / "inner"
    for folder in (facade, quiet, nested):
        folder.mkdir(parents=True)
    (facade / "__init__.py").write_text("from facade.stage import run\n")
    (facade / "stage.py").write_text("from facade.corpus import Sample\n")
    (facade / "corpus.py").write_text("Sample = tuple\n")
    (quiet / "__init__.py").write_text("from quiet.leaf import x\n")
    (quiet / "leaf.py").write_text("x = 1\n")
    (tmp_path / "outer" / "__init__.py").write_text("")
    (nested / "__init__.py").write_text("")
    (nested / "m.py").write_text("")
    (tmp_path / "user.py").write_text("import outer.inner.m\n")
    monkeypatch.setattr(test_layout, "ROOT", tmp_path)
    modules = {module_name(p): p for p in sorted(tmp_path.rglob("*.py"))}
    graph = {name: arrows(path, modules) for name, path in modules.items()}
    assert graph["user"] == {"outer": 1, "outer.inner": 1, "outer.inner.m": 1}
    assert graph["facade"] == {"facade.stage": 1} and graph["facade.stage"] == {"facade": 1, "facade.corpus": 1}
    assert graph["quiet"] == {"quiet.leaf": 1} and graph["quiet.leaf"] == {}
    assert import_circles(graph) == [["facade", "facade.stage"]]


LONG_MODULE = 450  # lines; a longer module says why at its top


def test_every_long_module_says_why_at_its_top():
    """A module over LONG_MODULE lines states, in its docstring, why it is one module ("Longer than most
    modules: ..."); tests are exempt."""
    unexplained = []
    for package in PACKAGES + ("scripts",):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if text.count("\n") > LONG_MODULE and "Longer than most modules" not in (
                ast.get_docstring(ast.parse(text)) or ""
            ):
                unexplained.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert unexplained == []


LONG_FUNCTION = 80  # lines, from its def to its last line; a longer function in runtime/ or builder/ says why
STATED = re.compile(r"Longer than 80 lines:\s*\S")  # the phrase, then a reason


def long_functions(package: str) -> list[str]:
    """The functions of ``package`` (methods and nested ones too) over LONG_FUNCTION lines whose docstring does not
    state why with "Longer than 80 lines:" and a reason."""
    unexplained = []
    for path in python_files(package):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > LONG_FUNCTION and not STATED.search(ast.get_docstring(node) or ""):
                    unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return unexplained


@pytest.mark.parametrize("package", ["builder", "runtime"])
def test_every_long_function_says_why(package):
    """Short, verb-named steps: a function in runtime/ or builder/ over LONG_FUNCTION lines states in its docstring
    why it is one function ("Longer than 80 lines: ...")."""
    assert long_functions(package) == []


def test_the_function_guard_counts_lines_and_reads_the_reason(tmp_path, monkeypatch):
    import test_layout

    body = "".join(f"    x{i} = {i}\n" for i in range(LONG_FUNCTION))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        f"def short():\n{body[: -len(body.splitlines(True)[-1])]}"  # exactly LONG_FUNCTION lines
        f"def long():\n{body}"
        f"def stated():\n    '''Longer than 80 lines: one table.'''\n{body}"
        f"def phrase_only():\n    '''Longer than 80 lines:'''\n{body}"
        f"class C:\n    async def method(self):\n{''.join('    ' + line for line in body.splitlines(True))}"
    )
    monkeypatch.setattr(test_layout, "ROOT", tmp_path)
    assert [line.split(" ")[1] for line in long_functions("pkg")] == ["long", "phrase_only", "method"]


# --- public seams ---------------------------------------------------------------------------------------------------

# What the runtime files being rewritten (issue 39: runtime/api.py, scheduler.py, lookup.py, ...) still hold, each
# entry to delete with the line it names; test_the_allow_lists_hold_only_what_remains fails on a stale one.
REEXPORTS_LEFT: dict[tuple[str, str], str] = {}  # (file, module the names come from): why the line is still there
PRIVATE_USES_LEFT: set[tuple[str, str]] = set()  # (file, "module.name._private")
NOQA_F401 = re.compile(r"#\s*noqa\s*:[^#\n]*\bF401\b|#\s*noqa\b(?!\s*:)", re.IGNORECASE)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def owner(dotted: str, modules: dict[str, Path]) -> str | None:
    """The project module ``dotted`` is or is defined in (its longest prefix that is a module); None outside."""
    parts = dotted.split(".")
    return next((".".join(parts[:end]) for end in range(len(parts), 0, -1) if ".".join(parts[:end]) in modules), None)


def dotted_name(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names and attributes; None for anything else (a call, a subscript, ...)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id] + parts[::-1]) if isinstance(node, ast.Name) else None


def private_uses(path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, ``module.name._private``) for every private name of another project module ``path`` uses: imported
    (``from m import _x``) or reached through an imported module, class or function (``m._x``, ``C._x``)."""
    here = module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found, bound = [], {}  # bound: local name -> the dotted project name an import binds it to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = imported_from(node, path)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if owner(target, modules) is None:
                    continue
                bound[alias.asname or alias.name] = target
                if is_private(alias.name) and owner(target, modules) != here:
                    found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if owner(alias.name, modules) is not None:
                    bound[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
                    if any(is_private(part) for part in alias.name.split(".")) and alias.name != here:
                        found.append((node.lineno, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            chain = dotted_name(node.value)
            head, _, rest = (chain or "").partition(".")
            if head in bound:
                target = bound[head] + (f".{rest}" if rest else "")
                if owner(target, modules) not in (None, here):
                    found.append((node.lineno, f"{target}.{node.attr}"))
    return found


def re_exports(path: Path) -> list[tuple[int, str]]:
    """(line, module the names come from) for every import ``path`` hands on: marked ``# noqa: F401`` (or a bare
    ``# noqa``), aliased to its own name (``import x as x``, ``from m import y as y``), or listed in ``__all__``."""
    text = path.read_text(encoding="utf-8")
    lines, tree = text.splitlines(), ast.parse(text, str(path))
    found, imported = [], {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            source = imported_from(node, path) if isinstance(node, ast.ImportFrom) else node.names[0].name
            if any(NOQA_F401.search(line) for line in lines[node.lineno - 1 : node.end_lineno]):
                found.append((node.lineno, source))
            for alias in node.names:
                if alias.asname == alias.name:  # the re-export idiom (``import a.b as b`` is none: b is a.b)
                    found.append((node.lineno, source))
                if node in tree.body:
                    imported[alias.asname or alias.name.split(".")[0]] = (node.lineno, source)
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AugAssign)) and "__all__" in [
            getattr(t, "id", None) for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        ]:
            names = [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
            found += [imported[name] for name in names if name in imported]
    return sorted(set(found))


def seam_problems() -> tuple[list[str], list[str], set, set]:
    """Private uses and re-exports outside the allow-lists, and the allow-list entries that matched something."""
    modules = project_modules()
    private, exports, used_private, used_exports = [], [], set(), set()
    for path in sorted(modules.values()):
        rel = path.relative_to(ROOT).as_posix()
        for line, target in private_uses(path, modules):
            if (rel, target) in PRIVATE_USES_LEFT:
                used_private.add((rel, target))
            else:
                private.append(f"{rel}:{line} uses {target}")
        for line, source in re_exports(path):
            if (rel, source) in REEXPORTS_LEFT:
                used_exports.add((rel, source))
            else:
                exports.append(f"{rel}:{line} hands on names of {source}")
    return private, exports, used_private, used_exports


def test_no_private_name_crosses_a_module():
    """A name another module needs is public (a real seam, its docstring says why); a private one stays home."""
    assert seam_problems()[0] == []


def test_no_re_export():
    """Every module imports a name from the module that defines it: nothing hands on what it imports."""
    assert seam_problems()[1] == []


def test_the_allow_lists_hold_only_what_remains():
    """An entry whose line is gone is deleted (the lists only shrink)."""
    _, _, used_private, used_exports = seam_problems()
    assert sorted(PRIVATE_USES_LEFT - used_private) == [] and sorted(set(REEXPORTS_LEFT) - used_exports) == []


def test_the_seam_guards_see_private_names_and_re_exports(tmp_path, monkeypatch):
    import test_layout

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("class C:\n    _z = 1\n\n\ndef _x():\n    return C._z, __name__\n")
    (package / "b.py").write_text(
        "import pkg.a\nfrom pkg import a as m\nfrom pkg.a import C, _x\nfrom . import a\n\n"
        "def f(self):\n    return pkg.a._x, m._y, C._z, a._w, self._own, m.__doc__, _x\n"
    )
    (package / "c.py").write_text(
        "import json as json\nfrom pkg.a import C  # noqa: F401\nimport os.path as path\n"
        "from pkg.a import (_x,  # noqa\n                   C as C)\n"
        "from pkg.b import f\n__all__ = ['f', 'g']\n\n\ndef g():\n    return 1\n"
    )
    monkeypatch.setattr(test_layout, "ROOT", tmp_path)
    modules = {module_name(p): p for p in sorted(package.glob("*.py"))}
    assert private_uses(package / "a.py", modules) == []  # its own privates
    assert sorted(private_uses(package / "b.py", modules)) == [
        (3, "pkg.a._x"),
        (7, "pkg.a.C._z"),
        (7, "pkg.a._w"),
        (7, "pkg.a._x"),
        (7, "pkg.a._y"),
    ]
    assert re_exports(package / "c.py") == [(1, "json"), (2, "pkg.a"), (4, "pkg.a"), (6, "pkg.b")]
    assert re_exports(package / "b.py") == []
