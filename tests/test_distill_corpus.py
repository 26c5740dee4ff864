"""The held-out prompt sets are apart from every prompt a distillation trains on, so acceptance measured on them
(the distiller's report, ``draftsmith bench --workload heldout-code``) is measured on text the draft never saw."""

from __future__ import annotations

import pytest

from builder.distill.corpus import HELDOUT_SETS, load_heldout, load_prompts


@pytest.mark.parametrize("name", sorted(HELDOUT_SETS))
def test_no_heldout_prompt_is_in_the_distillation_corpus(name):
    """Not one held-out prompt's first line (its signature or question, what the prefill corpus is screened by,
    builder/distill/prefill.py) appears anywhere in the shipped training prompts."""
    corpus = "\n".join(prompt.text for prompt in load_prompts())
    held = load_heldout([name])
    assert len(held) >= 20
    shared = [p.text.splitlines()[0] for p in held if p.text.splitlines()[0].strip() in corpus]
    assert not shared, shared


def test_heldout_sets_are_completions_for_code_and_chat_turns_for_chat():
    assert all(p.completion for p in load_heldout(["heldout-code"]))
    assert not any(p.completion for p in load_heldout(["heldout-chat"]))


def test_the_bench_measures_the_heldout_sets():
    from bench.workloads import CHAT_BY_DEFAULT, load_workload

    for name in HELDOUT_SETS:
        loaded, prompts = load_workload(name)
        assert loaded == name and [p.text for p in load_heldout([name])] == prompts
    assert "heldout-chat" in CHAT_BY_DEFAULT and "heldout-code" not in CHAT_BY_DEFAULT
