"""The arrows between the packages (README's layout): builder -> runtime <- triton_repo, bench on top of all.

- ``runtime`` imports nothing from ``builder``, ``bench`` or ``triton_repo``. One exception: the ``COMMANDS`` table of
  ``runtime/cli.py``, which names the other packages' click commands so ``draftsmith`` can offer them (imported by
  name when the CLI starts; a missing package drops its commands).
- ``builder`` imports nothing from ``bench``, and nothing from ``triton_repo`` outside ``builder/cli.py``
  (``build-engines --triton-repo`` is glue at the top).
- ``triton_repo`` imports nothing from ``bench`` or ``builder``.

Imports count wherever they are: module level, inside functions, ``importlib.import_module("...")`` and
``__import__("...")`` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "builder", "runtime", "triton_repo")

FORBIDDEN = {  # package -> {other package: files of the package allowed to import it}
    "runtime": {"builder": set(), "bench": set(), "triton_repo": set()},
    "builder": {"bench": set(), "triton_repo": {"builder/cli.py"}},
    "triton_repo": {"bench": set(), "builder": set()},
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
    tree = ast.parse("def f():\n    from bench.speed import bench\n    import importlib\n"
                     "    importlib.import_module('builder.distill')\n    __import__('triton_repo.cli')\n")
    assert [m for _, m in imported_modules(tree)] == ["bench.speed", "importlib", "builder.distill", "triton_repo.cli"]


def test_the_runtime_names_other_packages_only_in_its_command_table():
    """Every string in runtime/ that names a module of bench, builder or triton_repo sits in the command table, and
    that table registers commands of those packages only (nothing of the runtime's own loads through it)."""
    path, name = ROOT / COMMAND_TABLE[0], COMMAND_TABLE[1]
    lines, modules = command_table(path, name)
    assert modules and all(m.split(".")[0] in ("bench", "builder", "triton_repo") for m in modules)
    others = tuple(p for p in PACKAGES if p != "runtime")
    stray = []
    for file in python_files("runtime"):
        rel = file.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(".")[0] in others
                    and "." in node.value and " " not in node.value
                    and not (rel == COMMAND_TABLE[0] and node.lineno in lines)):
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
