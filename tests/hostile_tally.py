"""A tally of the distinct hostile inputs a test file sends, by class: the issues' tables report these counts, and the
file's last test checks that its whole corpus was sent (a table cut short, or a class no longer sent, fails it)."""

from __future__ import annotations

import json

import pytest


class HostileTally(dict):
    """class -> the distinct inputs of that class sent, as canonical JSON. Call it with each hostile input a test
    sends: ``hostile("tool schema", schema)``."""

    def __call__(self, kind: str, value) -> None:
        self.setdefault(kind, set()).add(json.dumps(value, sort_keys=True, default=repr))

    def check(self, classes: int, at_least: int) -> None:
        """A file's last test: skipped unless all ``classes`` classes were sent (the whole file ran), then at least
        ``at_least`` distinct inputs in all; the counts by class are printed for the issue's table."""
        if len(self) < classes:
            pytest.skip("counts only when the whole file runs")
        total = sum(len(v) for v in self.values())
        print({k: len(v) for k, v in self.items()}, total)
        assert total >= at_least
