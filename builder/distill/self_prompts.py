"""Prompts the target writes itself (the Magpie method: Xu et al. 2024, "Magpie: Alignment Data Synthesis from
Scratch by Prompting Aligned LLMs with Nothing"): given only its chat template up to where a user's message starts,
an aligned chat model samples a user query. The corpus grows without a dataset and without the hub, in the target's
own idea of what users ask; the held-out split stays on the shipped prompts.
"""

from __future__ import annotations

from typing import Callable

from builder.distill.continuations import Job, generate_with_engine
from builder.distill.corpus import Prompt

MARK = "\u2063draftsmith-user-turn\u2063"  # stands for the user's message while the template renders


def user_turn_prefix(tokenizer) -> list[int] | None:
    """The token ids of the chat template rendered up to the user's message (system turn included, as the template
    writes it); None when the tokenizer has no chat template or the template hides the message."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    head, found, _ = text.partition(MARK)
    if not found or not head:
        return None
    return list(tokenizer(head, add_special_tokens=False)["input_ids"])


def self_prompts(
    engine,
    tokenizer,
    count: int,
    *,
    eos_ids: list[int],
    seed: int,
    known: list[Prompt],
    temperature: float = 1.0,
    max_tokens: int = 96,
    batch_size: int = 32,
    advance: Callable[[int], None] = lambda n: None,
) -> list[Prompt]:
    """Up to ``count`` distinct user queries sampled by the target's ``engine`` from its user-turn prefix.

    Kept: queries the model ended itself (an end-of-turn token within ``max_tokens``), of at least three words,
    not already in ``known`` or among those kept (compared case- and space-insensitively). Returns [] for a model
    without a chat template (a base model has no user turn to complete)."""
    prefix = user_turn_prefix(tokenizer)
    if prefix is None or count <= 0:
        return []
    jobs = [Job(prefix, temperature, prompt_rows=False) for _ in range(count)]
    samples = generate_with_engine(
        engine, jobs, max_tokens, top_k=1, eos_ids=eos_ids, seed=seed, batch_size=batch_size, advance=advance
    )
    eos = set(eos_ids)
    seen = {_key(p.text) for p in known}
    kept = []
    for sample in samples:
        if not sample.continuation or sample.continuation[-1] not in eos:
            continue  # cut off at max_tokens: not a whole query
        text = tokenizer.decode(sample.continuation[:-1], skip_special_tokens=True).strip()
        key = _key(text)
        if len(key.split()) < 3 or key in seen:
            continue
        seen.add(key)
        kept.append(Prompt(text))
    return kept


def _key(text: str) -> str:
    return " ".join(text.lower().split())
