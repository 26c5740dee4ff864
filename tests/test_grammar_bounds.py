"""Bounds on the grammar work one request can cause (runtime/decoding/grammar_bounds.py, the compiler of
runtime/decoding/grammar.py and the OpenAI server's grammar pool): counted repetitions refused before they compile,
the first mask made where the grammar compiles, a per-row grammar time budget, and compiles that are bounded and
single-flight.

``hostile`` tallies the distinct hostile inputs sent here, by class; the tokenizer and template ones are counted in
tests/test_bundle_hostile.py and tests/test_chat_template.py."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from door_path import submit  # noqa: E402
from hostile_tally import HostileTally  # noqa: E402
from openai_asgi import MODEL, call, completion, with_tool  # noqa: E402
from runtime.decoding import grammar  # noqa: E402
from runtime.decoding.grammar import Constraint  # noqa: E402
from runtime.decoding.grammar_bounds import MAX_EXPANDED, lark_size, regex_size, schema_size  # noqa: E402
from runtime.errors import RequestError  # noqa: E402
from runtime.serving import openai_server  # noqa: E402
from runtime.serving.openai_server import create_app  # noqa: E402
from runtime.core.scheduler import Scheduler  # noqa: E402

hostile = HostileTally()


# --- counted repetitions are bounded before compiling -------------------------------------------------------------

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


# --- the first mask where the grammar compiles, and a row's grammar time budget -----------------------------------


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
        submit(scheduler, "The quick brown fox", max_new_tokens=6),
        submit(scheduler, "hello", max_new_tokens=6, response_format=fmt),
        submit(scheduler, "def add(a, b):", max_new_tokens=6),
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


# --- grammar compiles are bounded and single-flight ---------------------------------------------------------------


def test_identical_concurrent_schemas_compile_once(generator, monkeypatch):
    from runtime.decoding.grammar import json_schema

    compiler = generator.grammar_compiler()
    count = []

    class SlowMatchers:  # llguidance's matcher, made slowly (a costly schema) and counted
        def __init__(self, real):
            self.real = real

        def __call__(self, *args, **kwargs):
            count.append(args)
            time.sleep(0.3)
            return self.real(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.real, name)

    class Llguidance:  # the compiler's public handle on llguidance, with the slow matcher
        def __init__(self, real):
            self.real, self.LLMatcher = real, SlowMatchers(real.LLMatcher)

        def __getattr__(self, name):
            return getattr(self.real, name)

    monkeypatch.setattr(compiler, "llg", Llguidance(compiler.llg))
    constraint = json_schema({"type": "object", "properties": {"single": {"type": "integer", "minimum": 7}}})
    results = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(constraint))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 6 and len({id(r) for r in results}) == 1
    assert len(count) == 1


def test_grammar_compiles_are_bounded_and_do_not_starve_plain_requests(scheduler, generator, monkeypatch):
    """Many distinct schemas at once: at most GRAMMAR_WORKERS compile together, on a pool of their own; past
    GRAMMAR_PENDING more are refused (429) before any compile; a plain request is served meanwhile."""
    gate, running, peak = threading.Event(), [0], [0]
    lock = threading.Lock()
    real = generator.compile_constraint

    def blocked(fmt):
        if fmt is None:  # an unconstrained request: nothing to compile
            return real(fmt)
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        gate.wait(20)
        with lock:
            running[0] -= 1
        return real(fmt)

    monkeypatch.setattr(generator, "compile_constraint", blocked)
    monkeypatch.setattr(openai_server, "GRAMMAR_PENDING", 6, raising=False)
    app = create_app(scheduler, MODEL)
    count = 10

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000", timeout=60) as client:
            bodies = [
                {
                    "model": MODEL,
                    "prompt": "hi",
                    "max_tokens": 2,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {
                            "name": "s",
                            "schema": {"type": "object", "properties": {f"k{i}": {"type": "integer"}}},
                        },
                    },
                }
                for i in range(count)
            ]
            for body in bodies:
                hostile("distinct schemas", body)
            tasks = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies]
            await asyncio.sleep(0.5)
            plain = await asyncio.wait_for(
                client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}), 10
            )
            gate.set()
            return plain, await asyncio.gather(*tasks)

    try:
        plain, answers = asyncio.run(run())
    finally:
        gate.set()
    assert plain.status_code == 200
    codes = sorted(a.status_code for a in answers)
    assert codes.count(429) == count - 6 and codes.count(200) == 6, codes
    assert peak[0] <= openai_server.GRAMMAR_WORKERS


def test_hostile_input_count():
    """Run last in this file: the distinct hostile inputs above, by class."""
    hostile.check(classes=3, at_least=54)
