"""Hardening IV (issue 48), part A, the request side: counted repetitions bounded before a constraint compiles, the
first mask made on the grammar pool, a per-row grammar time budget, and the 500s a client could still cause (a lone
surrogate in a constraint or any other string; a tool call nested a thousand deep in the model's output).

``HOSTILE`` counts the distinct hostile inputs sent here, by class; the tokenizer and template ones are counted in
tests/test_bundle_hostile.py and tests/test_chat_template.py."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from runtime.decoding import grammar  # noqa: E402
from runtime.decoding.grammar import Constraint, GrammarCompiler, json_schema  # noqa: E402
from runtime.decoding.grammar_bounds import MAX_EXPANDED, lark_size, regex_size, schema_size  # noqa: E402
from runtime.errors import RequestError  # noqa: E402
from runtime.serving.openai_protocol import ToolMode  # noqa: E402
from runtime.serving.openai_responses import ResponseShape, tool_calls  # noqa: E402
from runtime.serving.openai_server import LOOPBACK_HOSTS, create_app  # noqa: E402
from runtime.serving.scheduler import Scheduler  # noqa: E402

MODEL = "tiny"
HOSTILE: dict[str, set] = {}


def hostile(kind: str, value) -> None:
    HOSTILE.setdefault(kind, set()).add(json.dumps(value, sort_keys=True, default=repr))


@pytest.fixture(scope="module")
def scheduler(generator):
    scheduler = Scheduler(generator, max_batch=4).start()
    yield scheduler
    scheduler.stop()


@pytest.fixture(scope="module")
def app(scheduler):
    return create_app(scheduler, MODEL, allowed_hosts=LOOPBACK_HOSTS)


def call(app, method: str, path: str, **options) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return await client.request(method, path, **options)

    return asyncio.run(run())


def raw_post(app, path: str, body: dict) -> httpx.Response:
    """``body`` as a client would send it: json.dumps writes a lone surrogate as the escape \\ud800."""
    return call(app, "POST", path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def completion(fmt: dict, **extra) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, "response_format": fmt, **extra}


def with_tool(parameters: dict, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
        "tool_choice": "required",
        **extra,
    }


# --- item 1: counted repetitions are bounded before compiling --------------------------------------------------

REGEXES = [
    "a{250000}",  # the issue's: 0.7-0.9 s for its first mask, 150-220 ms each after, on the scheduler thread
    "a{499998}",
    "(a{500}){500}",
    "((a{50}){50}){50}",
    "[ab]{100000}",
    "(?:ab|cd){6000}",
    "(a{3000}|b{3000}|c{3000}|d{3000})",
    "(a{3000}|a{3000}b|a{3000}c|a{3000}d)",
    "a{5000}b{5001}",
    "a{10001}",
    "a{2,20000}",
    "a{20000,}",
    "x{99999999999999999999}",
    "\\d{20000}",
    "\\p{L}{20000}",
    "(?i)(hello){3000}",
    "(?x) a { 2 5 0 0 0 }",
    "(?P<n>[0-9]{200}){200}",
    "[[:alpha:]]{50000}",
    "[a-z&&[^q]]{50000}",
    "a{ 20000 }",
    "a{020000}",
]
GRAMMARS = [
    "start: /a{250000}/",
    'start: "a"{250000}',
    'start: A\nA: "a"{250000}',
    'start: B{500}\nB: "x"{500}',
    'start: b{500}\nb: "x"{500}',
    'start: b ~ 250000\nb: "a"',
    'start: b ~ 10 .. 250000\nb: "a"',
    'start: %json {"type": "string", "pattern": "a{250000}"}',
    'start: c{20}\nc: d{20}\nd: e{30}\ne: "q"',
    'root ::= "a"{250000}',  # GBNF, converted to Lark by llguidance
    'root ::= [ab]{300} [cd]{300} ("e"{200}){100}',
    '%ignore /a{250000}/\nstart: "x"',
]
SCHEMA_PATTERNS = [
    {"type": "string", "pattern": "a{250000}"},
    {"type": "string", "pattern": "^(a{500}){500}$"},
    {"type": "object", "patternProperties": {"^(k{300}){300}$": {"type": "integer"}}},
    {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "z{1000}"} for i in range(11)}},
    {"type": "array", "items": {"anyOf": [{"type": "string", "pattern": "[xy]{100000}"}]}},
    {"type": "object", "properties": {"a": {"propertyNames": {"pattern": "n{20000}"}}}},
]
BIG_FORMATS = (
    [{"type": "regex", "regex": r} for r in REGEXES]
    + [{"type": "grammar", "grammar": g} for g in GRAMMARS]
    + [{"type": "json_schema", "json_schema": {"name": "x", "schema": s}} for s in SCHEMA_PATTERNS]
)


@pytest.mark.parametrize("fmt", BIG_FORMATS, ids=range(len(BIG_FORMATS)))
def test_a_counted_repetition_past_the_bound_is_a_400_naming_response_format(app, fmt):
    hostile("response_format repetition", fmt)
    response = call(app, "POST", "/v1/completions", json=completion(fmt))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format"
    assert f"to more than {MAX_EXPANDED} positions" in error["message"]


@pytest.mark.parametrize("schema", SCHEMA_PATTERNS[:4], ids=range(4))
def test_a_tools_pattern_past_the_bound_is_a_400_naming_tools(app, schema):
    parameters = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    hostile("tool pattern", parameters)
    response = call(app, "POST", "/v1/chat/completions", json=with_tool(parameters))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools"
    assert "expand to more than" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "regex", "regex": "[0-9]{3}-[0-9]{4}"},
        {"type": "regex", "regex": "(a{90}){100}"},
        {"type": "grammar", "grammar": 'start: B{90}\nB: "x"{100}'},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "maxLength": 100000}}},
    ],
)
def test_constraints_within_the_bound_are_served(app, fmt):
    response = call(app, "POST", "/v1/completions", json=completion(fmt))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "pattern,size",
    [
        ("abc", 3),
        ("a{10}b{10}", 20),
        ("(ab|cd){5}", 20),
        ("((a{10}){10}){10}", 1000),
        ("[a-z]{7}", 7),
        ("[]a]{4}", 4),
        ("[[:alpha:]x]{6}", 6),
        ("\\x{41}{9}", 9),
        ("\\p{Greek}{3}", 3),
        ("a{2,}", 3),
        ("a{3,8}?", 8),
        ("(?:a|(b{4})){2}", 10),
        ("a*b+c?", 3),
        ("(?x) a{3} # a comment with ( and {9}\n b", 4),
    ],
)
def test_regex_size_counts_each_position_once_per_repetition(pattern, size):
    assert regex_size(pattern) == size


def test_lark_and_schema_sizes_follow_references_and_add_patterns():
    assert lark_size('start: a b\na: "xy"{3}\nb: /[0-9]{4}/ | C\nC: "q"') == (11, "start")
    assert lark_size('start: "(" start ")" | "x"') == (4, "start")  # recursion is the parser's: counted once
    schema = {"properties": {"a": {"pattern": "a{7}"}, "b": {"items": {"pattern": "b{5}"}}}}
    assert schema_size(schema)[0] == 12


@pytest.fixture(scope="module")
def compiler(generator):
    return generator.grammar_compiler()


def test_the_first_mask_is_computed_where_the_grammar_compiles(compiler):
    """Compiling (on a server's grammar pool) computes the first mask; a row started from it (on the scheduler
    thread) computes none for its first step, and its mask is the one the matcher gives."""
    compiled = [None]
    worker = threading.Thread(target=lambda: compiled.__setitem__(0, compiler.compile(Constraint("regex", "ab+c"))))
    worker.start()
    worker.join()
    row = compiled[0].start()
    first = row.mask_after([])
    assert row.mask_count == 0 and row.seconds == 0.0
    fresh = grammar.GrammarRow(compiled[0].template.deep_copy(), compiled[0].width)
    assert (fresh.mask_after([]) == first).all() and fresh.mask_count == 1


def test_a_row_past_its_grammar_budget_fails_alone(generator, monkeypatch):
    """A constrained row whose grammar work passes its budget ends with a RequestError saying so; the plain rows
    batched with it finish."""
    monkeypatch.setattr(grammar, "GRAMMAR_SECONDS", 0.0)
    monkeypatch.setattr(grammar, "GRAMMAR_SECONDS_PER_TOKEN", 0.0)
    scheduler = Scheduler(generator, max_batch=4)
    fmt = {"type": "regex", "regex": "[a-z ]{1,40}"}
    handles = [
        scheduler.submit("The quick brown fox", max_new_tokens=6),
        scheduler.submit("hello", max_new_tokens=6, response_format=fmt),
        scheduler.submit("def add(a, b):", max_new_tokens=6),
    ]
    while scheduler.step():
        pass
    assert handles[0].result().token_ids and handles[2].result().token_ids
    with pytest.raises(RequestError, match="grammar engine spent .* budget"):
        handles[1].result()


def test_a_grammar_over_budget_through_the_server_is_a_400_naming_response_format(app, monkeypatch):
    monkeypatch.setattr(grammar, "GRAMMAR_SECONDS", 0.0)
    monkeypatch.setattr(grammar, "GRAMMAR_SECONDS_PER_TOKEN", 0.0)
    response = call(app, "POST", "/v1/completions", json=completion({"type": "regex", "regex": "[a-z ]{1,40}"}))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"
    assert "grammar engine spent" in response.json()["error"]["message"]
    plain = call(app, "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert plain.status_code == 200


# --- item 7: a lone surrogate anywhere, a tool call nested a thousand deep -------------------------------------

LONE = "\ud800"
SURROGATE_BODIES = [
    ("/v1/completions", completion({"type": "regex", "regex": LONE})),
    ("/v1/completions", completion({"type": "regex", "regex": "a" + LONE + "b{2}"})),
    ("/v1/completions", completion({"type": "grammar", "grammar": f'start: "{LONE}"'})),
    ("/v1/completions", completion({"type": "grammar", "grammar": "start: /\udfff+/"})),
    ("/v1/completions", completion({"type": "json_schema", "json_schema": {"name": "x", "schema": {"pattern": LONE}}})),
    ("/v1/completions", completion({"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": LONE}}})),
    ("/v1/completions", completion({"type": "json_schema", "json_schema": {"name": LONE, "schema": {}}})),
    (
        "/v1/completions",
        completion({"type": "json_schema", "json_schema": {"name": "x", "description": LONE, "schema": {}}}),
    ),
    ("/v1/completions", completion({"type": "json_schema", "json_schema": {"name": "x", "schema": {LONE: 1}}})),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": LONE}),
    ("/v1/completions", {"model": LONE, "prompt": "hi", "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, LONE: 1}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": {LONE: 1}}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": ["ok", "\udc00"]}),
    ("/v1/completions", completion({"type": LONE})),
    ("/v1/chat/completions", with_tool({"type": "object", "properties": {"x": {"type": "string", "pattern": LONE}}})),
    ("/v1/chat/completions", with_tool({"type": "object", "properties": {LONE: {"type": "string"}}})),
    ("/v1/chat/completions", with_tool({"type": "object", "description": LONE})),
    ("/v1/chat/completions", with_tool({"type": "object", "enum": [{"a": LONE}]})),
    (
        "/v1/chat/completions",
        with_tool({"type": "object"}, tool_choice={"type": "function", "function": {"name": LONE}}),
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi", "name": LONE}]},
    ),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [{"role": LONE, "content": "hi"}]}),
]


@pytest.mark.parametrize("path,body", SURROGATE_BODIES, ids=range(len(SURROGATE_BODIES)))
def test_a_lone_surrogate_in_any_field_is_a_4xx_never_a_500(app, path, body):
    hostile("lone surrogate", [path, body])
    response = raw_post(app, path, body)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["message"]
    good = call(app, "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert good.status_code == 200


def test_a_surrogate_in_a_constraint_names_the_field(app):
    response = raw_post(app, "/v1/completions", completion({"type": "regex", "regex": "x" + LONE}))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "response_format" and "not valid Unicode" in error["message"]


def nested_arguments(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize("depth", [900, 1000, 1500, 5000, 100_000])
@pytest.mark.parametrize("named", [True, False], ids=["named", "any"])
def test_a_tool_call_nested_deep_in_the_output_finishes_cleanly(depth, named):
    """The model's output is text the grammar allowed: JSON nested far past Python's recursion limit is still
    answered as the tool call it is, its arguments the model's own text."""
    arguments = nested_arguments(depth)
    hostile("deep tool call", [depth, named])
    mode = ToolMode({"f": {"type": "object"}}, named="f" if named else None)
    text = arguments if named else '{"name": "f", "arguments": ' + arguments + "}"
    calls = tool_calls(mode, text, "call_1")
    assert calls is not None and calls[0].function.name == "f"
    assert calls[0].function.arguments.replace(" ", "") == arguments.replace(" ", "")


def test_a_deep_tool_call_cut_by_max_tokens_is_content(tokenizer_shape):
    """Unbalanced (cut by max_tokens): no tool call, the text as content, as for a shallow one."""
    text = '{"name": "f", "arguments": ' + '{"a": ' * 3000
    assert tool_calls(ToolMode({"f": {"type": "object"}}), text, "call_1") is None
    generation = type("G", (), {"text": text, "token_ids": [1], "logprobs": None, "top_logprobs": None})()
    generation.finish_reason = "length"
    choice = tokenizer_shape.choice(generation)
    assert choice.message.content == text and choice.finish_reason == "length"


@pytest.fixture
def tokenizer_shape(generator):
    return ResponseShape(True, generator.tokenizer, None, ToolMode({"f": {"type": "object"}}), "call_1")


def test_a_deep_tool_call_through_the_response_shape_whole_and_streamed(tokenizer_shape):
    text = '{"name": "f", "arguments": ' + nested_arguments(2000) + "}"
    generation = type("G", (), {"text": text, "token_ids": [1], "logprobs": None, "top_logprobs": None})()
    generation.finish_reason = "stop"
    choice = tokenizer_shape.choice(generation)
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "f"
    chunk = tokenizer_shape.chunk("", [], None, None, reason="tool_calls", final=generation)
    assert chunk.delta.tool_calls[0].function.arguments.startswith('{"a": {"a": ')
    json.dumps(choice.model_dump(mode="json"))  # the response serialises


@pytest.mark.parametrize("source", ["\ud800", "ok\udfff", "\ud83d"])
def test_a_constraint_with_a_lone_surrogate_is_a_request_error(source):
    hostile("constraint surrogate", source)
    with pytest.raises(RequestError, match="not valid Unicode"):
        Constraint("regex", source)


def test_compiling_a_surrogate_grammar_is_a_request_error(generator):
    compiler: GrammarCompiler = generator.grammar_compiler()
    with pytest.raises(RequestError):
        compiler.compile(json_schema({"const": "\ud800"}))


def test_hostile_input_count():
    """Run last in this file: the distinct hostile inputs above, by class."""
    if len(HOSTILE) < 4:
        pytest.skip("counts only when the whole file runs")
    total = sum(len(v) for v in HOSTILE.values())
    print({k: len(v) for k, v in HOSTILE.items()}, total)
    assert total >= 60


def test_the_load_tool_sends_a_hostile_format_beside_its_clients(scheduler):
    """``openai-load --hostile-format``: one more client sends the issue's regex in a loop; the server refuses each
    at once (400) and the clients' requests all finish."""
    from bench.openai_load import run_load
    from test_openai_server import _Server

    server = _Server(create_app(scheduler, MODEL))
    try:
        report = run_load(
            server.url,
            clients=2,
            duration=60,
            max_requests=4,
            max_tokens=8,
            cancel_fraction=0.0,
            hostile_format={"type": "regex", "regex": "a{250000}"},
        )
    finally:
        server.close()
    assert report["sent"] == 4 and report["failed"] == 0 and report["lost"] == 0
    hostile_client = report["hostile_format"]
    assert hostile_client["sent"] >= 1 and set(hostile_client["by_status"]) == {"400"}
    assert "expands to more than" in hostile_client["first_error"]
