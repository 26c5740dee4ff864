"""Constrained decoding (runtime/decoding/grammar.py): exact against the constrained target, greedy and sampled, with
grammar-forced drafts, model drafts and model-free drafts; bounds on client schemas."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fakes import BigramEngine, DraftCounts, random_table, total_variation, tv_bound
from door_path import submit
from runtime.errors import RequestError
from runtime.decoding.grammar import (
    MAX_DEPTH,
    MAX_SOURCE_BYTES,
    Constraint,
    GrammarCompiler,
    GrammarRow,
    constrain,
    json_schema,
    parse_response_format,
)
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.decoding.sampling import SamplingParams, probabilities
from runtime.decoding.config import DecodeConfig
from batch_run import BatchRun
from runtime.drafters.model import ModelDrafter

EOS = 0  # the byte tokenizer's only special token; ids 1..256 are the bytes (ByteLevel alphabet order)
SAMPLED = SamplingParams(temperature=1.0)
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def byte_tokenizer() -> str:
    """tokenizer.json text of a byte-level BPE with no merges: one token per byte, so a bigram table over its 257
    ids is a language model llguidance can constrain."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=257,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["ab"], trainer)
    assert tok.get_vocab_size() == 257
    return tok.to_str()


@pytest.fixture(scope="module")
def compiler(byte_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(byte_tokenizer, 257, (EOS,))


def ids(compiler, text: str) -> list[int]:
    return compiler.tokenizer.tokenize_str(text)


def text_of(compiler, tokens: list[int]) -> str:
    return compiler.tokenizer.decode_str([t for t in tokens if t != EOS])


def loop_for(
    compiler, constraint, prompts, params, k=3, draft_seed=2, drafter="model", max_new_tokens=8, forced=True, seed=7
):
    target = BigramEngine(random_table(257, 1))
    draft = {
        "model": lambda: ModelDrafter(BigramEngine(random_table(257, draft_seed))),
        "lookup": lambda: PromptLookupDrafter(257),
        "none": lambda: None,
    }[drafter]()
    config = DecodeConfig(
        max_new_tokens,
        k,
        params,
        (EOS,),
        seed=seed,
        grammar=compiler.compile(constraint),
        forced_drafts=forced,
        logprobs=2,
    )
    return BatchRun(target, draft, prompts, config)


def run(loop) -> list:
    for _ in loop.run():
        pass
    return loop.rows


# --- exactness ----------------------------------------------------------------------------------------------------


def exact_law(compiler, constraint, table: np.ndarray, start: int, params: SamplingParams) -> dict:
    """P(output token sequence) under the constrained target alone, by walking every path of the grammar: at each
    state the target's law after the last token, masked (a row ends at EOS or where the grammar is complete)."""
    law: dict[tuple, float] = {}
    stack = [(compiler.compile(constraint).template.deep_copy(), start, (), 1.0)]
    while stack:
        matcher, last, prefix, mass = stack.pop()
        if matcher.is_stopped():
            law[prefix] = law.get(prefix, 0.0) + mass
            continue
        mask = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)[:257] != 0
        p = probabilities(constrain(table[last], mask), params)
        for token in np.flatnonzero(p > 0):
            token = int(token)
            if token == EOS:
                law[prefix + (token,)] = law.get(prefix + (token,), 0.0) + mass * p[token]
                continue
            child = matcher.deep_copy()
            assert child.consume_token(token)
            stack.append((child, token, prefix + (token,), mass * p[token]))
    return law


REGEX = Constraint("regex", "x[abc]{2,3}")  # forced "x", then 2 or 3 free choices, then EOS or the end


@pytest.mark.parametrize("drafter,forced", [("model", True), ("model", False), ("lookup", True)])
def test_sampled_constrained_speculation_follows_the_constrained_target(compiler, drafter, forced):
    n = 4000
    loop = loop_for(compiler, REGEX, [[ids(compiler, "a")[0]]] * n, SAMPLED, drafter=drafter, forced=forced)
    rows = run(loop)
    law = exact_law(compiler, REGEX, random_table(257, 1), ids(compiler, "a")[0], SAMPLED)
    assert abs(sum(law.values()) - 1) < 1e-6 and len(law) > 20  # float32 laws: products sum to 1 within ~1e-7
    outcomes = sorted(law)
    index = {o: i for i, o in enumerate(outcomes)}
    observed = np.zeros(len(outcomes))
    for row in rows:
        assert tuple(row.generated) in index, text_of(compiler, row.generated)  # every output matches the grammar
        observed[index[tuple(row.generated)]] += 1
    exact = np.array([law[o] for o in outcomes])
    assert total_variation(observed / n, exact) < tv_bound(exact, n)
    if drafter == "model":  # drafts of several tokens were accepted and rejected
        assert DraftCounts.of(rows).multi_token_steps_decided_both_ways()
    first = rows[0].stats
    if forced:  # the forced "x" was proposed without a draft call and always accepted
        assert all(r.stats.accepted_per_position[0] >= 1 for r in rows[:50])
    assert first.num_steps < len(rows[0].generated) + 1


def test_an_unmasked_target_fails_the_law_test(compiler, monkeypatch):
    """The check above can fail: verifying against the unconstrained target leaves the grammar."""
    monkeypatch.setattr("runtime.decoding.step.constrain", lambda logits, masks: logits)
    loop = loop_for(compiler, REGEX, [[ids(compiler, "a")[0]]] * 200, SAMPLED, forced=False)
    with pytest.raises((AssertionError, RuntimeError, RequestError)):
        rows = run(loop)
        law = exact_law(compiler, REGEX, random_table(257, 1), ids(compiler, "a")[0], SAMPLED)
        assert all(tuple(r.generated) in law for r in rows)


SCHEMA = json_schema(
    {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "tag": {"enum": ["ab", "cd"]}, "ok": {"type": "boolean"}},
        "required": ["id", "tag", "ok"],
        "additionalProperties": False,
    }
)


@pytest.mark.parametrize(
    "constraint",
    [REGEX, SCHEMA, Constraint("json_object"), Constraint("lark", 'start: "v=" NUM ";"\nNUM: /[0-9]{1,4}/')],
    ids=["regex", "json_schema", "json_object", "lark"],
)
@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_greedy_constrained_speculation_equals_constrained_target_only(compiler, constraint, drafter):
    prompts = [[t] for t in range(1, 257, 9)]
    spec = run(loop_for(compiler, constraint, prompts, GREEDY, k=4, drafter=drafter, max_new_tokens=40))
    alone = run(loop_for(compiler, constraint, prompts, GREEDY, drafter="none", max_new_tokens=40, forced=False))
    assert [r.generated for r in spec] == [r.generated for r in alone]
    assert sum(r.stats.num_steps for r in spec) < sum(r.stats.num_steps for r in alone)  # speculation did work
    for s, a in zip(spec, alone):  # the target's log-probabilities of the same tokens, exactly
        assert np.abs(np.array(s.logprobs) - np.array(a.logprobs)).max(initial=0) <= 1e-12
        assert s.top_logprobs == a.top_logprobs
    if constraint.kind == "json_schema":
        for row in spec:
            if row.finished == "stop":
                value = json.loads(text_of(compiler, row.generated))
                assert set(value) == {"id", "tag", "ok"} and value["tag"] in ("ab", "cd")


def test_logprobs_are_the_targets_log_softmax(compiler):
    table = random_table(257, 1)
    row = run(loop_for(compiler, SCHEMA, [[5]], SAMPLED, max_new_tokens=30))[0]
    previous = [5] + row.generated[:-1]
    for last, token, logprob, top in zip(previous, row.generated, row.logprobs, row.top_logprobs):
        shifted = table[last] - table[last].max()
        want = shifted - np.log(np.exp(shifted).sum())
        assert abs(logprob - want[token]) < 1e-12
        assert [t for t, _ in top] == list(np.argsort(-want, kind="stable")[:2])


def test_forced_drafts_need_no_draft_call_and_raise_acceptance(compiler):
    """On a schema's fixed structure the forced tokens are proposed without the draft: with a draft model, the same
    text and steps in fewer draft calls (its masked draws there are the forced tokens anyway); with no draft model,
    fewer steps than target-only."""
    prompts = [[t] for t in range(1, 257, 17)]
    with_forced = loop_for(compiler, SCHEMA, prompts, GREEDY, k=4, max_new_tokens=60)
    without = loop_for(compiler, SCHEMA, prompts, GREEDY, k=4, max_new_tokens=60, forced=False)
    a, b = run(with_forced), run(without)
    assert [r.generated for r in a] == [r.generated for r in b]
    assert sum(r.stats.num_steps for r in a) <= sum(r.stats.num_steps for r in b)
    assert with_forced.drafter.calls < 0.8 * without.drafter.calls
    forced_only = run(loop_for(compiler, SCHEMA, prompts, GREEDY, k=4, max_new_tokens=60, drafter="none"))
    alone = run(loop_for(compiler, SCHEMA, prompts, GREEDY, k=4, max_new_tokens=60, drafter="none", forced=False))
    assert [r.generated for r in forced_only] == [r.generated for r in a]
    assert sum(r.stats.num_steps for r in forced_only) < 0.8 * sum(r.stats.num_steps for r in alone)


def test_the_matcher_rolls_back_with_the_caches(compiler):
    """After every step the matcher holds exactly the emitted tokens: a fresh matcher fed them agrees (a row made
    without the compiled first mask: its matcher is fed here directly, past the row)."""
    loop = loop_for(compiler, SCHEMA, [[3], [40]], SAMPLED, k=4, max_new_tokens=40)
    compiled = compiler.compile(SCHEMA)
    for step in loop.run():
        for row, _ in step:
            fresh = GrammarRow(compiled.template.deep_copy(), compiled.width, compiled.eos_ids)
            assert fresh.matcher.consume_tokens(row.generated) or row.finished
            if not row.finished:
                np.testing.assert_array_equal(fresh.mask_after([]), row.grammar.mask_after([]))
                assert row.grammar.tentative == []


# --- response_format and bounds -----------------------------------------------------------------------------------


def test_response_formats():
    assert parse_response_format(None) is None and parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}) == Constraint("json_object")
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    got = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert got.kind == "json_schema" and json.loads(got.source) == schema
    assert parse_response_format({"type": "regex", "regex": "a+"}) == Constraint("regex", "a+")
    assert parse_response_format({"type": "grammar", "grammar": 'start: "a"'}).kind == "lark"
    for bad, words in [
        ({"type": "xml"}, "must be one of"),
        ({"type": "json_schema"}, "takes the fields"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "with 'schema'"),
        ({"type": "regex", "regex": ""}, "non-empty"),
        ("json", "expected an object"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be an object"),
    ]:
        with pytest.raises(RequestError, match=words):
            parse_response_format(bad)


def test_schema_bounds_are_checked_before_compiling():
    deep: dict = {"type": "string"}
    for _ in range(MAX_DEPTH):
        deep = {"type": "array", "items": deep}
    with pytest.raises(RequestError, match="nests"):
        json_schema(deep)
    wide = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(2000)}}
    with pytest.raises(RequestError, match=f"limit is {MAX_SOURCE_BYTES}"):
        json_schema(wide)
    with pytest.raises(RequestError, match="limit is"):
        Constraint("regex", "a" * (MAX_SOURCE_BYTES + 1))


@pytest.mark.parametrize(
    "constraint,words",
    [
        (json_schema({"type": "frobnicate"}), "Invalid type"),
        (Constraint("regex", "a(b"), "regex"),
        (Constraint("lark", "start: undefined_rule"), "undefined_rule"),
        (json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]}), "nowhere"),
    ],
)
def test_a_constraint_that_cannot_compile_is_a_request_error_naming_why(compiler, constraint, words):
    with pytest.raises(RequestError, match="cannot be compiled") as err:
        compiler.compile(constraint)
    assert words.lower() in str(err.value).lower()


def test_a_pathological_regex_is_built_lazily_and_masks_every_step(compiler):
    """An automaton that explodes ((a|b)*a(a|b){40} has 2^40 DFA states) is built lazily under the lexer's fuel: the
    compile answers, and each of 60 steps gets a mask that allows the text's next byte and refuses the rest of the
    alphabet but 'a' and 'b' (an eager build would not end; the fuel would stop a step with an error). What it costs:
    ``python -m bench.guards``."""
    a, b = ids(compiler, "a")[0], ids(compiler, "b")[0]
    row = compiler.compile(Constraint("regex", "(a|b)*a(a|b){40}")).start()
    drafted: list[int] = []
    for token in ids(compiler, "ab" * 30):
        mask = row.mask_after(drafted)
        assert mask is not None and mask[token]
        assert set(np.flatnonzero(mask)) <= {a, b, EOS}
        drafted.append(token)
    assert len(drafted) == 60


# --- the tiny bundle: real engines, a real BPE tokenizer, schemas of every shape -------------------------------------


def constrained_answers(
    generator, schema: dict, temperature: float, mode: str = "speculative", seed: int = 0, max_new_tokens: int = 100
):
    fmt = {"type": "json_schema", "json_schema": {"name": "case", "schema": schema, "strict": True}}
    return generator.generate(
        ["JSON:", "The fox"],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        mode=mode,
        response_format=fmt,
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_completed_answer_validates_against_its_schema(generator, temperature):
    """54 schemas of 11 shapes, two prompts each: every answer that completed (finish "stop") parses and validates;
    one cut by max_tokens is finish "length" (the constraint cannot shorten a long string the model insists on)."""
    import jsonschema
    from schemas import schema_cases

    completed = invalid = 0
    for case, (shape, schema) in enumerate(schema_cases()):
        for answer in constrained_answers(generator, schema, temperature, seed=case):
            assert answer.finish_reason in ("stop", "length"), answer.finish_reason
            if answer.finish_reason != "stop":
                continue
            completed += 1
            try:
                jsonschema.validate(json.loads(answer.text), schema)
            except (ValueError, jsonschema.ValidationError) as err:
                invalid += 1
                print(shape, schema, repr(answer.text), err)
    assert invalid == 0
    assert completed >= 0.75 * 2 * len(schema_cases())


def test_greedy_constrained_speculation_equals_target_only_on_the_tiny_bundle(generator):
    from schemas import schema_cases

    for shape, schema in schema_cases()[::3]:
        spec = constrained_answers(generator, schema, 0.0)
        alone = constrained_answers(generator, schema, 0.0, mode="target")
        assert [a.token_ids for a in spec] == [a.token_ids for a in alone], shape


def test_a_schema_that_cannot_compile_is_a_request_error(generator):
    with pytest.raises(RequestError, match="cannot be compiled: .*frobnicate"):
        generator.generate(
            "x",
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "frobnicate"}}},
        )


# --- the OpenAI server: response_format, tools, through the official client ---------------------------------------

openai_client = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 10},
        "day": {"type": "integer", "minimum": 1, "maximum": 31},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["title", "day", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Give me the event as JSON."}]


@pytest.fixture(scope="module")
def served(tiny_bundle):
    from test_openai_server import _Server
    from runtime.api import SpeculativeGenerator
    from runtime.serving.openai_server import create_app
    from runtime.core.scheduler import Scheduler

    generator = SpeculativeGenerator.from_bundle(tiny_bundle, threads=1)
    scheduler = Scheduler(generator, max_batch=4).start()
    server = _Server(create_app(scheduler, "tiny"))
    yield server, openai_client.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    server.close()
    scheduler.stop()


def test_chat_json_schema_answers_validate_and_equal_generate(served, generator):
    import jsonschema

    _, client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "event", "schema": EVENT, "strict": True}}
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=80, temperature=0, response_format=fmt
    )
    want = generator.generate([MESSAGES], max_new_tokens=80, chat=True, response_format=fmt)[0]
    assert out.choices[0].message.content == want.text
    if out.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(want.text), EVENT)
    sampled = [
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=80, temperature=1.0, seed=s, response_format=fmt
        ).choices[0]
        for s in range(6)
    ]
    completed = [c for c in sampled if c.finish_reason == "stop"]
    assert completed
    for choice in completed:
        jsonschema.validate(json.loads(choice.message.content), EVENT)


def test_completions_json_object_and_a_bad_schema(served):
    _, client = served
    out = client.completions.create(
        model="tiny",
        prompt="JSON:",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    with pytest.raises(openai_client.BadRequestError, match="cannot be compiled: .*frobnicate"):
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
        )
    with pytest.raises(openai_client.BadRequestError, match="response_format.type"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, response_format={"type": "xml"})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_tool_calls_are_constrained_to_the_parameters(served, stream):
    import jsonschema

    _, client = served
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        calls, reason = [], None
        kwargs = dict(
            model="tiny", messages=MESSAGES, max_tokens=80, temperature=0, tools=[WEATHER, TIME], tool_choice=choice
        )
        if stream:
            parts: dict = {}
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                delta = chunk.choices[0].delta
                for call in delta.tool_calls or []:
                    part = parts.setdefault(call.index, {"name": "", "arguments": ""})
                    part["name"] += call.function.name or ""
                    part["arguments"] += call.function.arguments or ""
                reason = chunk.choices[0].finish_reason or reason
            calls = list(parts.values())
        else:
            out = client.chat.completions.create(**kwargs)
            reason = out.choices[0].finish_reason
            calls = [
                {"name": c.function.name, "arguments": c.function.arguments}
                for c in out.choices[0].message.tool_calls or []
            ]
            assert (out.choices[0].message.content is None) == bool(calls)
        if reason == "length":
            continue  # cut by max_tokens: no complete call to return
        assert reason == "tool_calls" and len(calls) == 1
        assert calls[0]["name"] in schemas if choice == "required" else calls[0]["name"] == "get_time"
        jsonschema.validate(json.loads(calls[0]["arguments"]), schemas[calls[0]["name"]])


def test_tool_choice_auto_and_mistakes_are_400s_saying_why(served):
    _, client = served
    with pytest.raises(openai_client.BadRequestError, match="tool_choice 'auto'.*not supported"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER])
    with pytest.raises(openai_client.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai_client.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tool_choice="required")
    plain = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="none", max_tokens=4
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content is not None


def test_bench_on_the_json_workload_with_a_response_format(tiny_bundle, tmp_path):
    from click.testing import CliRunner
    from runtime.cli import main

    out = tmp_path / "bench.json"
    from pathlib import Path

    event = Path(__file__).resolve().parent.parent / "bench" / "prompts" / "json_event.json"
    args = [
        "bench",
        str(tiny_bundle),
        "--workload",
        "json",
        "--response-format",
        str(event),
        "--k",
        "2",
        "--prompts",
        "2",
        "--max-new-tokens",
        "24",
        "--threads",
        "1",
        "--no-peers",
        "--no-memory",
        "--no-limit",
        "--quiet",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["settings"]["response_format"]["type"] == "json_schema" and report["settings"]["forced_drafts"]
    speculative = [r for r in report["results"] if r["mode"] == "speculative"]
    assert speculative and all(r["identical_to_target"] == 1.0 for r in speculative)
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}}')
    result = CliRunner().invoke(main, args[:5] + [str(bad)] + args[6:])
    assert result.exit_code == 2 and "cannot be compiled" in result.output


def test_tensorrt_llm_guide_inputs_map_to_constraints():
    from runtime.decoding.grammar import trtllm_guide

    assert trtllm_guide(None, None) is None
    assert trtllm_guide("json", None) == Constraint("json_object")
    assert json.loads(trtllm_guide("json_schema", '{"type": "integer"}').source) == {"type": "integer"}
    assert trtllm_guide("regex", "[0-9]+") == Constraint("regex", "[0-9]+")
    assert trtllm_guide("ebnf_grammar", "root ::= [0-9]+") == Constraint("lark", "root ::= [0-9]+")
    for kind, guide, words in [
        (None, "x", "needs 'guided_decoding_guide_type'"),
        ("xml", "x", "must be one of"),
        ("regex", None, "is required"),
        ("json_schema", "{not json", "not a JSON schema"),
        ("json_schema", "[" * 100000 + "]" * 100000, "limit is"),
    ]:
        with pytest.raises(RequestError, match=words):
            trtllm_guide(kind, guide)


def test_scheduled_constrained_requests_equal_their_lone_runs(generator):
    """In-flight batching ("exact"): constrained requests batched with others (free ones, other schemas) get what
    each gets alone, greedy and seeded-sampled, their logprobs too."""
    from runtime.core.scheduler import Scheduler
    from schemas import schema_cases

    cases = schema_cases()[::9]
    requests = [
        dict(
            prompt=p,
            max_new_tokens=60,
            temperature=t,
            seed=s,
            logprobs=1,
            response_format={"type": "json_schema", "json_schema": {"schema": schema}},
        )
        for s, ((_, schema), p, t) in enumerate(zip(cases, ["JSON:", "The fox", "x", "def f():"] * 2, [0.0, 1.0] * 4))
    ]
    requests.append(
        dict(prompt="The fox", max_new_tokens=30, temperature=0.0, seed=None, logprobs=None, response_format=None)
    )
    scheduler = Scheduler(generator, max_batch=4).start()
    try:
        handles = [submit(scheduler, r["prompt"], **{k: v for k, v in r.items() if k != "prompt"}) for r in requests]
        results = [h.result() for h in handles]
    finally:
        scheduler.stop()
    for request, got in zip(requests, results):
        alone = generator.generate(request.pop("prompt"), **request)
        assert (got.token_ids, got.text, got.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)
        assert got.logprobs == alone.logprobs
    with pytest.raises(RequestError, match="cannot be compiled"):
        submit(Scheduler(generator), "x", response_format={"type": "regex", "regex": "a(b"})


# --- Triton: tensorrtllm_backend's guided-decoding inputs on a real tritonserver -----------------------------------


@pytest.fixture(scope="module")
def triton(tiny_bundle, tmp_path_factory):
    pytest.importorskip("tritonclient.grpc")
    import test_triton_server as helpers
    from conftest import has_tritonserver

    if not has_tritonserver():
        pytest.skip("needs nvidia-pytriton's tritonserver")
    handle = helpers._serve(tiny_bundle, tmp_path_factory.mktemp("triton-guided") / "repo", max_batch_size=4)
    yield helpers, handle
    handle.stop()


@pytest.mark.triton
def test_triton_guided_decoding_inputs_constrain_the_answer(triton, generator):
    helpers, server = triton
    body = {
        "text_input": "JSON:",
        "max_tokens": 60,
        "guided_decoding_guide_type": "json_schema",
        "guided_decoding_guide": json.dumps(EVENT),
    }
    want = generator.generate(
        "JSON:", max_new_tokens=60, response_format={"type": "json_schema", "json_schema": {"schema": EVENT}}
    )
    assert helpers.http_generate(server, body)["text_output"] == want.text
    regex = helpers.http_generate(
        server,
        {
            "text_input": "x",
            "max_tokens": 8,
            "guided_decoding_guide_type": "regex",
            "guided_decoding_guide": "[0-9]{3}",
        },
    )
    assert regex["text_output"].isdigit() and len(regex["text_output"]) == 3
    error = helpers.http_error(
        server,
        {
            "text_input": "x",
            "max_tokens": 8,
            "guided_decoding_guide_type": "json_schema",
            "guided_decoding_guide": '{"type": "frobnicate"}',
        },
    )
    assert "cannot be compiled" in error
