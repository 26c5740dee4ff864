"""Log-probabilities under speculation: the target's own, for every emitted token, equal to what target-only
decoding reads for the same tokens (|delta| <= 1e-4 on real engines; exact on the scripted ones)."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import BigramEngine, random_table
from runtime.errors import RequestError
from runtime.decoding.sampling import SamplingParams
from runtime.decoding.config import DecodeConfig
from batch_run import BatchRun
from runtime.drafters.model import ModelDrafter

PROMPTS = ["The quick brown", "def add(a, b):", "Speculative decoding"]


def target_only_logprobs(generator, prompt_ids: list[int], tokens: list[int]) -> np.ndarray:
    """log p(tokens[i] | prompt, tokens[:i]) from the target fed one token per call, as target-only decoding is."""
    engine = generator.target
    cache = engine.new_cache(1)
    if len(prompt_ids) > 1:
        engine.forward(cache, np.array([prompt_ids[:-1]], np.int64))
    last, out = prompt_ids[-1], []
    for token in tokens:
        logits = engine.forward(cache, np.array([[last]], np.int64))[0, -1].astype(np.float64)
        shifted = logits - logits.max()
        out.append(shifted[token] - np.log(np.exp(shifted).sum()))
        last = token
    return np.array(out)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("constrained", [False, True], ids=["free", "json"])
def test_speculative_logprobs_equal_target_only(generator, temperature, constrained):
    fmt = {"type": "json_object"} if constrained else None
    answers = generator.generate(  # plan off: drafts every step (the tiny pair's measured costs may keep it from it)
        PROMPTS, max_new_tokens=40, temperature=temperature, seed=3, logprobs=3, response_format=fmt, plan=False
    )
    drafted = 0
    for prompt, answer in zip(PROMPTS, answers):
        drafted += answer.stats.num_accepted_tokens
        assert len(answer.logprobs) == len(answer.token_ids) == len(answer.top_logprobs)
        want = target_only_logprobs(generator, generator.tokenizer.encode(prompt), answer.token_ids)
        assert np.abs(np.array(answer.logprobs) - want).max() <= 1e-4
        for token, logprob, top in zip(answer.token_ids, answer.logprobs, answer.top_logprobs):
            assert len(top) == 3 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
            if temperature == 0.0 and not constrained:  # greedy picks the target's most likely token
                assert top[0][0] == token and abs(top[0][1] - logprob) < 1e-12
    assert drafted > 0  # accepted draft tokens carried log-probabilities from the verify pass


def test_greedy_logprobs_of_speculative_and_target_only_runs_agree(generator):
    spec = generator.generate(PROMPTS, max_new_tokens=40, logprobs=0)
    alone = generator.generate(PROMPTS, max_new_tokens=40, logprobs=0, mode="target")
    for a, b in zip(spec, alone):
        assert a.token_ids == b.token_ids
        assert np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max() <= 1e-4
        assert a.top_logprobs == [[] for _ in a.token_ids]


def test_no_logprobs_unless_asked(generator):
    answer = generator.generate("x", max_new_tokens=4)
    assert answer.logprobs is None and answer.top_logprobs is None


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True, "3"])
def test_bad_logprobs_are_request_errors(generator, bad):
    with pytest.raises(RequestError, match="logprobs"):
        generator.generate("x", max_new_tokens=4, logprobs=bad)


def test_scripted_logprobs_are_exact_whatever_is_accepted():
    """Over many sampled rows (drafts accepted and rejected), each token's log-probability is the bigram target's
    log-softmax after the token before it."""
    table = random_table(6, 1)
    loop = BatchRun(
        BigramEngine(table),
        ModelDrafter(BigramEngine(random_table(6, 2))),
        [[0]] * 50,
        DecodeConfig(12, 3, SamplingParams(1.0), seed=1, logprobs=2),
    )
    for _ in loop.run():
        pass
    logsoft = table - np.log(np.exp(table).sum(axis=1, keepdims=True))
    for row in loop.rows:
        previous = [0] + row.generated[:-1]
        assert np.allclose(row.logprobs, logsoft[previous, row.generated], atol=1e-12)
        assert all(
            [t for t, _ in top] == list(np.argsort(-logsoft[p], kind="stable")[:2])
            for p, top in zip(previous, row.top_logprobs)
        )


# --- the OpenAI server -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_bundle):
    openai = pytest.importorskip("openai")
    from test_openai_server import _Server
    from runtime.api import SpeculativeGenerator
    from runtime.serving.openai_server import create_app
    from runtime.core.scheduler import Scheduler

    generator = SpeculativeGenerator.from_bundle(tiny_bundle, threads=1)
    scheduler = Scheduler(generator, max_batch=4).start()
    server = _Server(create_app(scheduler, "tiny"))
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    server.close()
    scheduler.stop()


MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.mark.parametrize("fmt", [None, {"type": "json_object"}], ids=["free", "json"])
def test_chat_logprobs_whole_and_streamed_are_the_targets(served, generator, fmt):
    client = served
    extra = {} if fmt is None else {"response_format": fmt}
    want = generator.generate([MESSAGES], max_new_tokens=24, chat=True, logprobs=2, response_format=fmt)[0]
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2, **extra
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == len(want.token_ids)
    assert np.abs(np.array([c.logprob for c in content]) - np.array(want.logprobs)).max() <= 1e-4
    assert [c.token for c in content] == [generator.tokenizer.decode([t]) for t in want.token_ids]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    streamed = []
    for chunk in client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        **extra,
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_completion_logprobs(served, generator):
    out = served.completions.create(model="tiny", prompt="The quick brown", max_tokens=12, temperature=0, logprobs=3)
    want = generator.generate("The quick brown", max_new_tokens=12, logprobs=3)
    lp = out.choices[0].logprobs
    assert np.abs(np.array(lp.token_logprobs) - np.array(want.logprobs)).max() <= 1e-4
    assert len(lp.tokens) == len(want.token_ids) == len(lp.top_logprobs)
    if "\ufffd" not in "".join(lp.tokens):  # a token that ends inside a UTF-8 character shows as U+FFFD alone
        assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(top) <= 3 for top in lp.top_logprobs)
    plain = served.completions.create(model="tiny", prompt="The quick brown", max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_bad_logprobs_requests_are_400s(served):
    import openai

    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        served.chat.completions.create(model="tiny", messages=MESSAGES, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        served.chat.completions.create(model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=21)


def test_token_bytes_are_the_tokens_own_even_inside_a_character(generator):
    """An emoji spans several byte tokens: each decodes alone to U+FFFD, its bytes rebuild the text exactly."""
    tokenizer = generator.tokenizer
    text = "naïve 😀 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the case the bytes field exists for
