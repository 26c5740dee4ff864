"""Training pairs from batched prefill: the target's engine reads windows of existing text whole, and every position's
hidden state comes out of the calls at once.

Generating text costs the target one call per token; on 2 cores a 1.5B target makes ~30-70 tokens a second that way
even in batches of 32 rows, because each step's matmuls see only as many rows as the batch. A prefill call of a
512-token window gives its matmuls 512 rows, which is what a CPU's int8 kernels run fastest, and it needs no head
(``score=False``): a feature draft learns from the hidden states, and the next-token law over the kept vocabulary is
those states times the head's rows (builder/distill/feature_draft.py). So the bulk of the pairs comes from text that
exists: source files and documents of the installed Python packages (``python:NAME``), or files and folders the
recipe names.

Text sources are data from outside: only regular files with a known text suffix are read (links are not followed),
each at most ``MAX_FILE_BYTES``, decoded as UTF-8 with bad bytes dropped. A file holding any of the held-out prompts'
first lines is skipped, so the held-out evaluation never measures text the draft was trained on.
"""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from builder.distill.corpus import DistillError, Sample

TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")
MAX_FILE_BYTES = 400_000
PYTHON_PREFIX = "python:"


def text_files(sources: list[str]) -> list[Path]:
    """The files of ``sources`` in a fixed order: ``python:NAME`` is the installed package NAME's folder; a path is a
    file, or a folder walked for files with TEXT_SUFFIXES."""
    files: list[Path] = []
    for source in sources:
        root = _source_root(source)
        if root.is_file():
            files.append(root)
            continue
        for folder, dirs, names in os.walk(root):  # os.walk does not follow links to folders
            dirs.sort()
            for name in sorted(names):
                path = Path(folder) / name
                if name.endswith(TEXT_SUFFIXES) and path.is_file() and not path.is_symlink():
                    files.append(path)
    return files


def _source_root(source: str) -> Path:
    if source.startswith(PYTHON_PREFIX):
        name = source[len(PYTHON_PREFIX) :]
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise DistillError(f"prefill_text: {source}: no installed Python package named {name!r}")
        return Path(list(spec.submodule_search_locations)[0])
    path = Path(source)
    if not path.exists() or path.is_symlink():
        raise DistillError(f"prefill_text: {source}: no such file or folder (links are not followed)")
    return path


def read_text(path: Path) -> str:
    """A file's text, at most MAX_FILE_BYTES of it."""
    with open(path, "rb") as handle:
        return handle.read(MAX_FILE_BYTES).decode("utf-8", errors="ignore")


def text_windows(
    tokenizer, files: list[Path], length: int, count: int, *, seed: int, per_file: int = 2, exclude: list[str] = ()
) -> list[list[int]]:
    """Up to ``count`` windows of ``length`` token ids: files taken in a seeded order, at most ``per_file`` windows
    from each, spread over it (so a budget cut still sees many sources), none from a file holding a line of
    ``exclude``."""
    order = list(files)
    random.Random(seed).shuffle(order)
    marks = [line.strip() for text in exclude for line in text.splitlines()[:1] if len(line.strip()) >= 12]
    windows: list[list[int]] = []
    for path in order:
        if len(windows) >= count:
            break
        text = read_text(path)
        if not text.strip() or any(mark in text for mark in marks):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        fits = len(ids) // length
        if not fits:
            continue
        picks = np.linspace(0, fits - 1, min(per_file, fits)).round().astype(int)
        windows += [list(ids[i * length : (i + 1) * length]) for i in sorted(set(picks.tolist()))]
    return windows[:count]


def prefill_samples(
    engine, windows: list[list[int]], *, rows: int, advance: Callable[[int], None] = lambda n: None
) -> Iterator[tuple[list[int], list[Sample]]]:
    """(window indices, their samples with the target's hidden states) for ``rows`` windows at a time, one engine
    call each without the head, every window. Windows of one call must be equally long (``text_windows`` makes them
    so)."""
    for start in range(0, len(windows), rows):
        part = windows[start : start + rows]
        tokens = np.asarray(part, np.int64)
        cache = engine.new_cache(len(part))
        engine.prefill(cache, tokens)
        hidden = cache.extra.get("hidden")
        if hidden is None:
            raise DistillError("the target engine returns no hidden states (build it with this Draftsmith)")
        samples = [Sample([], list(w), features=hidden[b, : len(w) - 1].astype(np.float16)) for b, w in enumerate(part)]
        advance(len(part))
        yield list(range(start, start + len(part))), samples
