"""The prompts a bench run decodes: the built-in workloads (bench/prompts/), the distiller's held-out sets, or a
prompt file; and which of them go through the chat template by default. Shared by ``draftsmith bench``, the tree
headroom probe (bench/tree.py) and the distiller's tests, so the prompts stay one definition."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import click

from builder.distill.corpus import HELDOUT_SETS, load_heldout
from runtime.text.prompt_files import parse_prompts

BUILTIN_WORKLOADS = ("code", "chat", "reasoning", "json")  # json: with --response-format prompts/json_event.json
# prompts no distillation trains on (builder/data/heldout-*.txt, the distiller's held-out sets): measure drafts there
HELDOUT_WORKLOADS = tuple(HELDOUT_SETS)
CHAT_BY_DEFAULT = ("chat", "reasoning", "json", "heldout-chat")  # through the chat template unless --no-chat


def load_workload(spec: str) -> tuple[str, list[str]]:
    """A built-in workload name or a prompt file; returns (name, prompts)."""
    if spec in BUILTIN_WORKLOADS:
        text = resources.files("bench").joinpath("prompts", f"{spec}.txt").read_text(encoding="utf-8")
        return spec, parse_prompts(text)
    if spec in HELDOUT_WORKLOADS:
        return spec, [prompt.text for prompt in load_heldout([spec])]
    path = Path(spec)
    if not path.is_file():
        raise click.BadParameter(
            f"{spec!r} is neither a built-in workload ({', '.join(BUILTIN_WORKLOADS + HELDOUT_WORKLOADS)}) nor a "
            "prompt file",
            param_hint="--workload",
        )
    prompts = parse_prompts(path.read_text(encoding="utf-8"))
    if not prompts:
        raise click.BadParameter(f"{spec}: no prompts found", param_hint="--workload")
    return path.stem, prompts
