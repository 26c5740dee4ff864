"""The Python API (runtime/api.py) over real (tiny) ONNX engines: greedy speculative output equals the target's,
batches equal each prompt alone, seeds reproduce, streams equal generate, bad requests are clear errors."""

from __future__ import annotations

import pytest

from runtime.errors import RequestError
from runtime.decoding.config import DecodeConfig
from batch_run import BatchRun
from runtime.drafters.model import ModelDrafter


PROMPTS = ["The quick brown", "def add(a, b):\n    return", "x", "Speculative decoding keeps the target's output"]


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_speculative_equals_target_only(generator, k):
    for prompt in PROMPTS[:2]:
        spec = generator.generate(prompt, max_new_tokens=40, k=k)
        plain = generator.generate(prompt, max_new_tokens=40, mode="target")
        assert spec.token_ids == plain.token_ids
        assert spec.text == plain.text
        assert spec.stats.num_steps < plain.stats.num_steps or spec.stats.num_accepted_tokens == 0


def test_the_pair_accepts_some_and_rejects_some(generator):
    """Otherwise the equivalence tests above would not exercise rollback."""
    stats = generator.generate(PROMPTS[0], max_new_tokens=60, k=4, plan=False).stats  # drafts every step
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("k", [1, 3])
def test_batch_equals_each_prompt_alone(generator, k):
    batch = generator.generate(PROMPTS, max_new_tokens=30, k=k)
    for prompt, result in zip(PROMPTS, batch):
        alone = generator.generate(prompt, max_new_tokens=30, mode="target")
        assert result.token_ids == alone.token_ids


def test_batch_rows_finish_at_different_times(generator):
    free = generator.generate(PROMPTS[1], max_new_tokens=30, mode="target").text
    stop = free[5:8]
    batch = generator.generate([PROMPTS[0], PROMPTS[1]], max_new_tokens=30, stop=[stop])
    assert batch[1].finish_reason == "stop" and len(batch[1].text) <= 5 + len(stop)
    assert batch[0].token_ids == generator.generate(PROMPTS[0], max_new_tokens=30, stop=[stop]).token_ids


def test_rollback_continuation_equals_fresh_run_from_accepted_prefix(generator):
    """Generation that continued after rejections equals a fresh run started from the accepted prefix."""
    tok = generator.tokenizer
    first = generator.generate(PROMPTS[0], max_new_tokens=40, k=4, plan=False)  # drafts every step
    assert first.stats.num_draft_tokens > first.stats.num_accepted_tokens  # rejections happened
    prompt_ids = tok.encode(PROMPTS[0])
    prefix = prompt_ids + first.token_ids[:20]
    loop = BatchRun(generator.target, ModelDrafter(generator.draft), [prefix], DecodeConfig(max_new_tokens=20, k=4))
    for _ in loop.run():
        pass
    assert loop.rows[0].generated == first.token_ids[20:40]


def test_sampled_generation_is_reproducible_with_a_seed(generator):
    a = generator.generate(PROMPTS[0], max_new_tokens=30, temperature=0.9, top_p=0.95, seed=3)
    b = generator.generate(PROMPTS[0], max_new_tokens=30, temperature=0.9, top_p=0.95, seed=3)
    c = generator.generate(PROMPTS[0], max_new_tokens=30, temperature=0.9, top_p=0.95, seed=4)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_seeded_requests_batched_together_sample_as_alone(generator):
    """One seed per prompt: two identical seeded requests in one batch (with another between them) each give what
    they give alone."""
    options = dict(max_new_tokens=30, temperature=0.9, top_p=0.95)
    alone = generator.generate(PROMPTS[0], seed=3, **options)
    batch = generator.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0]], seed=[3, 4, 3], **options)
    assert batch[0].token_ids == batch[2].token_ids == alone.token_ids
    assert batch[1].token_ids == generator.generate(PROMPTS[1], seed=4, **options).token_ids
    assert generator.generate(PROMPTS[0], seed=5, **options).token_ids != alone.token_ids


def test_cancelled_sequence_leaves_the_batch_at_once(generator):
    """``stream_batch(cancelled=...)``: a cancelled row finishes at the next step ("cancelled") and leaves the batch;
    the other row's tokens are those it gets alone."""
    steps = {0: 0}

    def cancelled(index):
        if index == 0:
            steps[0] += 1
        return index == 0 and steps[0] >= 2

    done = {}
    for index, _, generation in generator.stream_batch(
        [PROMPTS[1], PROMPTS[0]], cancelled=cancelled, max_new_tokens=40, mode="target"
    ):
        if generation is not None:
            done[index] = generation
    assert done[0].finish_reason == "cancelled" and done[0].stats.num_steps == 2 and len(done[0].token_ids) == 2
    assert steps[0] == 2  # never asked again: the row left the batch
    alone = generator.generate(PROMPTS[0], max_new_tokens=40, mode="target")
    assert done[1].token_ids == alone.token_ids and done[1].finish_reason == alone.finish_reason


def test_stream_concatenation_equals_generate(generator):
    for prompt in PROMPTS:
        pieces = list(generator.stream(prompt, max_new_tokens=40, k=3))
        assert "".join(pieces) == generator.generate(prompt, max_new_tokens=40, k=3).text


def test_stop_string_split_across_tokens(generator):
    full = generator.generate(PROMPTS[1], max_new_tokens=40).text
    stop = full[10:14]
    result = generator.generate(PROMPTS[1], max_new_tokens=40, stop=stop)
    assert result.finish_reason == "stop"
    assert result.text == full[: full.find(stop)]
    assert "".join(generator.stream(PROMPTS[1], max_new_tokens=40, stop=stop)) == result.text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(k=0), "k: expected greater than or equal to 1"),
        (dict(k=99), "k: expected an integer in"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.1), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(mode="fast"), "mode"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_requests_are_clear_errors(generator, kwargs, message):
    with pytest.raises(RequestError, match=message):
        generator.generate("hello", **kwargs)


def test_empty_and_overlong_prompts(generator):
    with pytest.raises(RequestError, match="non-empty"):
        generator.generate("")
    with pytest.raises(RequestError, match="context"):
        generator.generate("word " * 400)
