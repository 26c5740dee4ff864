"""The OpenAI protocol against hostile requests and hostile model output (runtime/serving/openai_protocol.py and
openai_responses.py, through the server's app): every client error is a 4xx naming its field, never a 500 (a big or
deep tool schema, a response_format that cannot compile, a grammar that fails mid-decode, a lone surrogate in any
string or key); and a tool call nested far past Python's recursion limit in the model's output is still answered.

``hostile`` tallies the distinct hostile inputs sent here, by class."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from hostile_tally import HostileTally  # noqa: E402
from openai_asgi import MODEL, call, chat, completion, with_tool  # noqa: E402
from runtime.decoding.grammar import Constraint, GrammarCompiler, json_schema  # noqa: E402
from runtime.errors import RequestError  # noqa: E402
from runtime.serving.openai_protocol import ToolMode  # noqa: E402
from runtime.serving.openai_responses import ResponseShape, tool_calls  # noqa: E402

hostile = HostileTally()


def raw_post(app, path: str, body: dict) -> httpx.Response:
    """``body`` as a client would send it: json.dumps writes a lone surrogate as the escape \\ud800."""
    return call(app, "POST", path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def nested(depth: int, key: str = "a") -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {key: schema}}
    return schema


# --- every client error is a 4xx naming its field -----------------------------------------------------------------

BAD_SCHEMAS = [
    {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(700)}},
    {"type": "object", "properties": {"a": {"type": "string", "enum": ["y" * 50] * 900}}},
    nested(33),
    nested(35),
    nested(40, "b"),
    {"anyOf": [nested(34)]},
    {"type": "object", "properties": {"a": {"$ref": "#/nope"}}},
    {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}},
    {"$ref": "http://example.com/schema.json"},
    {"type": "array", "items": {"$ref": "#"}, "minItems": "three"},
    {"type": "object", "required": 5},
]
BAD_FORMATS = [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": nested(36)}},
    {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "schema": {
                "type": "object",
                "properties": {f"k{i}": {"type": "integer", "description": "z" * 60} for i in range(600)},
            },
        },
    },
    {"type": "regex", "regex": "x" * 40_000},
    {"type": "grammar", "grammar": "start: undefined_rule"},
    {"type": "grammar", "grammar": "x" * 40_000},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/missing"}}},
]


@pytest.mark.parametrize("schema", BAD_SCHEMAS, ids=range(len(BAD_SCHEMAS)))
def test_a_bad_tool_schema_is_a_400_naming_tools(app, schema):
    hostile("tool schema", schema)
    response = call(app, "POST", "/v1/chat/completions", json=chat(schema))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools"


@pytest.mark.parametrize("fmt", BAD_FORMATS, ids=range(len(BAD_FORMATS)))
def test_a_bad_response_format_is_a_400_naming_it(app, fmt):
    hostile("response format", fmt)
    response = call(
        app, "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "response_format": fmt}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_error_mid_decode_is_a_client_error_not_a_500(app, monkeypatch, stream):
    """llguidance stops a request whose grammar runs out of fuel mid-decode: that is the request's own (its grammar),
    a 400 before the first text, an invalid_request_error event after it; never "internal server error"."""
    from runtime.decoding import grammar

    def out_of_fuel(self, *args, **kwargs):
        raise RequestError("the grammar engine stopped this request: lexer fuel exhausted")

    monkeypatch.setattr(grammar.GrammarRow, "commit", out_of_fuel)
    body = {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": 8,
        "stream": stream,
        "response_format": {"type": "json_object"},
    }
    response = call(app, "POST", "/v1/completions", json=body)
    if not stream:
        assert response.status_code == 400 and "grammar" in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "response_format"
    else:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        errors = [e["error"] for e in events if "error" in e]
        assert response.status_code in (200, 400)
        if response.status_code == 200:
            assert errors and errors[0]["type"] == "invalid_request_error"
            assert errors[0]["param"] == "response_format"


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": "ab\ud800"},
        {"model": MODEL, "prompt": "ok", "stop": ["\udfff"]},
        {"model": MODEL, "prompt": "ok", "temperature": 5e-324, "max_tokens": 2},
    ],
)
def test_hostile_text_is_a_400_and_the_server_still_serves(app, body):
    import json

    raw = json.dumps(body).encode()  # json.dumps escapes the surrogates as \ud800, as a client would send them
    response = call(app, "POST", "/v1/completions", content=raw, headers={"content-type": "application/json"})
    if "temperature" in body:
        assert response.status_code == 200
    else:
        assert response.status_code == 400 and "Unicode" in response.json()["error"]["message"]
    good = call(app, "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert good.status_code == 200


# --- a lone surrogate anywhere ------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("source", ["\ud800", "ok\udfff", "\ud83d"])
def test_a_constraint_with_a_lone_surrogate_is_a_request_error(source):
    hostile("constraint surrogate", source)
    with pytest.raises(RequestError, match="not valid Unicode"):
        Constraint("regex", source)


def test_compiling_a_surrogate_grammar_is_a_request_error(generator):
    compiler: GrammarCompiler = generator.grammar_compiler()
    with pytest.raises(RequestError):
        compiler.compile(json_schema({"const": "\ud800"}))


# --- a tool call nested a thousand deep in the model's output -----------------------------------------------------


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


# --- a body's cost: bounded before it is walked, and paid off the event loop ---------------------------------------

CHAT = "/v1/chat/completions"
BODY_REFUSALS = [  # (the body, the field its 400 names, a phrase of its message)
    (chat(metadata={f"k{i}": "v" for i in range(17)}), "metadata", "17 keys; at most 16"),
    (chat(metadata={"k" * 65: "v"}), "metadata", "at most 64 characters"),
    (chat(metadata={"k": "v" * 513}), "metadata", "at most 512 characters, received 513"),
    (chat(metadata={"a": [0] * 20_000}), "metadata", "received list"),  # the issue's body, within this limit
    (chat(metadata={"a": {"b": "c"}}), "metadata", "received dict"),
    (chat(metadata={"a": 1}), "metadata", "received int"),
    (chat(metadata="tag"), "metadata", "expected an object"),
    (chat(metadata=[["k", "v"]]), "metadata", "expected an object"),
    (chat(metadata={"k": LONE}), "metadata", "metadata.k: not valid Unicode"),
    (chat(metadata={LONE: "v"}), "metadata", "not valid Unicode"),
    (chat(stop=[f"s{i}" for i in range(17)], user=LONE), "stop", "17 stop strings"),  # the count before any walk
    (chat(stop=["s"] * 10_000), "stop", "10000 stop strings"),
    (chat(stop=["x" * 257], messages=[{"role": "user", "content": LONE}]), "stop", "max_stop_word_bytes"),
]


@pytest.mark.parametrize("body,param,phrase", BODY_REFUSALS, ids=range(len(BODY_REFUSALS)))
def test_a_body_past_a_bound_is_a_400_naming_the_field(app, body, param, phrase):
    """``metadata`` is bounded as OpenAI bounds it (the server ignores it: nothing else would), and the cheap count
    limits come before anything walks the body."""
    hostile("body", body)
    response = raw_post(app, CHAT, body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and phrase in error["message"], error


RAW_REFUSALS = [  # bodies FastAPI parsed on the event loop, now parsed off it: the same answers
    (b"", "a JSON request body is required"),
    (b'{"model": "tiny", "messages": [', "not valid JSON"),
    (b'{"model": "\xff"}', "error parsing the body"),  # not UTF-8
    (b"[" * 30_000 + b"]" * 30_000, "error parsing the body"),  # past the parser's depth
    (b"[1, 2]", "body: Input should be a valid dictionary"),
]


@pytest.mark.parametrize("raw,phrase", RAW_REFUSALS, ids=range(len(RAW_REFUSALS)))
def test_a_body_that_does_not_parse_is_a_400(app, raw, phrase):
    hostile("body", raw.decode("latin-1")[:64])
    response = call(app, "POST", CHAT, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and phrase in response.json()["error"]["message"], response.text


def test_metadata_within_openais_bounds_is_accepted(app):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    assert raw_post(app, CHAT, chat(metadata=metadata)).status_code == 200


def test_the_body_is_parsed_and_checked_off_the_event_loop_and_walked_only_when_it_must(app, monkeypatch):
    """Parsing, validating and the text check cost the body's size (a 4 MB body held every connection ~1 s): they
    run on worker threads, and the walk that names a field runs only for a body that has a lone surrogate."""
    import threading

    from runtime.core import request as door
    from runtime.serving import body_parser
    from runtime.text import sent_text

    threads, walked = [], []
    parse, admit, walk = body_parser.parse_body, door.FrontDoor.admit, sent_text.invalid_text_path

    def spy(work):
        def run(*args):
            threads.append(threading.get_ident())
            return work(*args)

        return run

    monkeypatch.setattr(body_parser, "parse_body", spy(parse))
    monkeypatch.setattr(door.FrontDoor, "admit", spy(admit))
    monkeypatch.setattr(sent_text, "invalid_text_path", lambda sent: walked.append(sent) or walk(sent))
    assert raw_post(app, CHAT, chat(metadata={"k": "v"})).status_code == 200
    assert len(threads) == 2 and threading.get_ident() not in threads  # call() runs the loop on this thread
    assert not walked
    assert raw_post(app, CHAT, chat(metadata={"k": LONE})).status_code == 400 and len(walked) == 1


def test_hostile_input_count():
    """Run last in this file: the distinct hostile inputs above, by class."""
    hostile.check(classes=6, at_least=54 + len(BODY_REFUSALS) + len(RAW_REFUSALS))
