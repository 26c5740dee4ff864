"""The pipeline's inputs: the prompt corpus, its train/held-out split, and the samples every later stage fills, with
the padded batches they are fed in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from runtime.text.prompt_files import parse_prompts

COMPLETION_MARK = "@completion"  # first line of a corpus block: a raw text completion, not a chat turn


class DistillError(RuntimeError):
    """Distillation cannot go on; the message says why and what to do."""


@dataclass
class Prompt:
    text: str
    completion: bool = False  # True: fed as raw text; False: through the chat template when the tokenizer has one


@dataclass
class Sample:
    """One prompt with the target's continuation and sparse teacher distributions for every next-token position."""

    prompt: list[int]
    continuation: list[int]
    top_ids: np.ndarray | None = None  # [L-1-rows_from, K] int64: the target's top-k next tokens at rows_from..L-2
    top_probs: np.ndarray | None = None  # [L-1-rows_from, K] float32: their probabilities (temperature 1)
    rows_from: int = 0  # the first position with a teacher row (a prompt's rows are kept once, not per sample)
    features: np.ndarray | None = None  # [L-1, H] float16: the target's final hidden state at positions 0..L-2

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.continuation


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """The shipped corpus, or a user's file: blocks separated by ``---`` lines, or one prompt per line.

    A block whose first line is ``@completion`` is fed as raw text (code to continue); the others go through the
    target's chat template when it has one.
    """
    if path is None:
        text = resources.files("builder").joinpath("data/distill_prompts.txt").read_text(encoding="utf-8")
    else:
        path = Path(path)
        if not path.is_file():
            raise DistillError(f"{path}: no such prompt file")
        text = path.read_text(encoding="utf-8")
    prompts = []
    for block in parse_prompts(text):
        first, _, rest = block.partition("\n")
        if first.strip() == COMPLETION_MARK:
            if rest.strip():
                prompts.append(Prompt(rest, completion=True))
        else:
            prompts.append(Prompt(block))
    if len(prompts) < 2:
        raise DistillError(
            f"{path or 'the shipped corpus'}: need at least 2 prompts (some are held out), found {len(prompts)}"
        )
    return prompts


# the shipped held-out sets (builder/data/NAME.txt): name -> whether its prompts are raw completions. No corpus a
# distillation trains on holds them (tests/test_distill_corpus.py), and the bench measures them (--workload NAME)
HELDOUT_SETS = {"heldout-code": True, "heldout-chat": False}


def load_heldout(names: list[str]) -> list[Prompt]:
    """Held-out prompts: each name a shipped set (HELDOUT_SETS) or a prompt file (``load_prompts``' format)."""
    prompts: list[Prompt] = []
    for name in names:
        if name in HELDOUT_SETS:
            text = resources.files("builder").joinpath(f"data/{name}.txt").read_text(encoding="utf-8")
            prompts += [Prompt(block, completion=HELDOUT_SETS[name]) for block in parse_prompts(text)]
        else:
            prompts += load_prompts(name)
    return prompts


def split_prompts(prompts: list, heldout: float, seed: int) -> tuple[list, list]:
    """(train, held out): a seeded shuffle; at least one prompt on each side."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    n_held = min(len(prompts) - 1, max(1, round(heldout * len(prompts))))
    held = sorted(order[:n_held])
    train = sorted(order[n_held:])
    return [prompts[i] for i in train], [prompts[i] for i in held]


def encode(tokenizer, prompt: Prompt, chat: bool | None, max_tokens: int) -> list[int]:
    use_chat = bool((not prompt.completion) if chat is None else chat) and bool(
        getattr(tokenizer, "chat_template", None)
    )
    if use_chat:  # transformers renders templates in jinja2's sandbox, as runtime.text.tokenizer does
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = prompt.text
    # as the runtime encodes prompts: a rendered chat prompt carries its own special tokens (Tokenizer.encode_chat)
    ids = tokenizer(text, add_special_tokens=not use_chat)["input_ids"]
    return list(ids[-max_tokens:])


def pad(rows: list[list[int]], pad: int = 0):
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def batches(samples: list[Sample], tokens: int, shuffle: random.Random | None):
    """Right-padded batches of about ``tokens`` tokens (padding included), similar lengths together."""
    if shuffle is None:
        order = sorted(samples, key=lambda s: len(s.ids))
    else:
        order = list(samples)
        shuffle.shuffle(order)
        # sort within windows so batches hold similar lengths but their order stays random
        window = 64
        order = [
            s for i in range(0, len(order), window) for s in sorted(order[i : i + window], key=lambda s: len(s.ids))
        ]
    batch: list[Sample] = []
    chunks = []
    for s in order:
        width = max([len(s.ids)] + [len(b.ids) for b in batch])
        if batch and width * (len(batch) + 1) > tokens:
            chunks.append(batch)
            batch = []
        batch.append(s)
    if batch:
        chunks.append(batch)
    if shuffle is not None:
        shuffle.shuffle(chunks)
    return chunks
