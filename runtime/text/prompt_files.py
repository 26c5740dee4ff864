"""Prompt files: the one format of the bench's workloads and the distillation corpus.

It lives on the light side because both the bench and the builder read it, and each may import the runtime but not
the other.
"""

from __future__ import annotations


def parse_prompts(text: str) -> list[str]:
    """Prompts separated by lines holding only ``---``; a first block made only of ``#`` lines is a comment.
    A file without any ``---`` line holds one prompt per non-empty line."""
    lines = text.splitlines()
    if not any(line.strip() == "---" for line in lines):
        return [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    blocks, current = [], []
    for line in lines:
        if line.strip() == "---":
            blocks.append(current)
            current = []
        else:
            current.append(line)
    blocks.append(current)
    if blocks and all(not line.strip() or line.startswith("#") for line in blocks[0]):
        blocks = blocks[1:]
    prompts = ["\n".join(block).strip("\n") for block in blocks]
    return [p for p in prompts if p.strip()]
