"""No dead code in the packages: vulture over builder/, runtime/, triton_repo/, bench/ and deploy/ (not tests/, so
a function only tests call counts as dead too) finds nothing but the names tests/vulture_allowlist.py gives a
reason for."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("builder", "runtime", "triton_repo", "bench", "deploy")
ALLOWLIST = ROOT / "tests" / "vulture_allowlist.py"
MIN_CONFIDENCE = 60  # every kind vulture reports: functions, classes, methods, attributes, variables, imports
ENTRY = re.compile(r"^_\.(\w+)\s*(#\s*(.*))?$")


def entries() -> list[tuple[int, str, str]]:
    """(line, name, reason) of each allow-list entry."""
    found = []
    for number, line in enumerate(ALLOWLIST.read_text().splitlines(), 1):
        match = ENTRY.match(line.strip())
        if match:
            found.append((number, match.group(1), (match.group(3) or "").strip()))
    return found


def test_the_packages_have_no_dead_code():
    if importlib.util.find_spec("vulture") is None:
        pytest.skip("vulture is not installed (scripts/setup.sh installs it with the [test] extra)")
    done = subprocess.run(
        [sys.executable, "-m", "vulture", *PACKAGES, str(ALLOWLIST.relative_to(ROOT))]
        + [f"--min-confidence={MIN_CONFIDENCE}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode in (0, 3), done.stderr  # 3: dead code found
    assert done.stdout == "", (
        "dead code (remove it; or, only where a framework reads it by name or the docs name it as API, add it to "
        f"tests/vulture_allowlist.py with the reason):\n{done.stdout}"
    )


def test_every_allowlist_entry_says_why_and_still_names_code():
    source = "\n".join(path.read_text() for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py")))
    lines = [line for line in ALLOWLIST.read_text().splitlines() if line.startswith("_.")]
    listed = entries()
    assert len(listed) == len(lines) > 0, "one `_.name  # reason` a line"
    assert [f"line {n}: {name}" for n, name, reason in listed if len(reason) < 10] == [], "an entry without a reason"
    names = [name for _, name, _ in listed]
    assert sorted({n for n in names if names.count(n) > 1}) == [], "listed twice"
    stale = [name for name in names if not re.search(rf"\b{re.escape(name)}\b", source)]
    assert stale == [], f"allow-listed but no longer in {', '.join(PACKAGES)}: remove the entries"
