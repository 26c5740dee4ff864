"""Click options that mean the same in every command serving through the scheduler (``draftsmith serve-openai`` and
``draftsmith triton-repo``), defined once so the flag, its default and its help never part. Only click is imported
here: ``triton_repo/cli.py`` reads it at import time without loading the scheduler, and ``runtime/cli.py`` (which
imports ``triton_repo.cli`` through its command table) is no place the triton side could import from."""

from __future__ import annotations

import click

plan_option = click.option(
    "--plan/--no-plan",
    "plan",
    default=True,
    show_default=True,
    help="Plan each step's draft lengths (0 included) from the call costs measured at start and each "
    "request's acceptance; --no-plan: every request drafts its k.",
)
"""``--plan/--no-plan``: the scheduler's ``plan`` (runtime/core/scheduler.py). Shared by serve-openai and
triton-repo, whose schedulers plan alike."""
