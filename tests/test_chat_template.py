"""Chat templates are hostile data: they render in jinja2's immutable sandbox, with transformers' helpers."""

from __future__ import annotations

import json

import pytest

from runtime.errors import RequestError
from runtime.text.tokenizer import Tokenizer, render_chat_template

USER = [{"role": "user", "content": "hi"}]

# Each tries to reach the interpreter (os, subprocess, builtins) or to mutate the caller's data.
ESCAPES = [
    "{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "{{ joiner.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ namespace.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ lipsum.__globals__['os'].popen('touch {marker}').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ (messages|attr('__class__')).__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__['__builtins__']['__import__']('os').system('touch {marker}') }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{% set x = messages.append({'role': 'system', 'content': 'injected'}) %}{{ messages|length }}",
    "{{ messages[0].update({'content': 'overwritten'}) }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_a_template_cannot_reach_the_interpreter_or_mutate_its_input(template, tmp_path):
    marker = tmp_path / "pwned"
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat template"):
        render_chat_template(template.replace("{marker}", str(marker)), messages)
    assert not marker.exists()
    assert messages == [{"role": "user", "content": "hi"}]


def test_transformers_helpers_work_inside_the_sandbox():
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
        "|{{ strftime_now('%Y') | length }}"
    )
    messages = [{"role": "user", "content": "<b>&"}, {"role": "assistant", "content": "never shown"}]
    rendered = render_chat_template(template, messages)
    first, year = rendered.split("|")
    assert json.loads(first) == messages[0]  # no HTML escaping: the prompt's text is what the model sees
    assert "<b>&" in first and "never shown" not in rendered
    assert year == "4"


def test_raise_exception_reports_the_templates_own_message():
    template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}"
    )
    with pytest.raises(ValueError, match="a system message must come first"):
        render_chat_template(template, USER)


def test_undefined_variables_render_empty_as_in_transformers():
    assert render_chat_template("{% if tools %}T{% endif %}{{ date_string }}ok", USER) == "ok"


def _bos_tokenizer(folder, template: str) -> Tokenizer:
    """A word-level tokenizer whose post-processor adds <s> in front, as many Llama tokenizers do."""
    from tokenizers import Tokenizer as Fast, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hi": 3, "user": 4, ":": 5, "assistant": 6}
    fast = Fast(models.WordLevel(vocab, unk_token="[UNK]"))
    fast.pre_tokenizer = pre_tokenizers.Whitespace()
    fast.add_special_tokens(["<s>", "</s>"])
    fast.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return Tokenizer(folder)


def test_a_template_that_writes_bos_gets_exactly_one(tmp_path):
    tokenizer = _bos_tokenizer(
        tmp_path, "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}assistant:"
    )
    assert tokenizer.encode("hi")[:1] == [0]  # plain prompts still get the tokenizer's BOS
    assert tokenizer.encode_chat("hi") == [0, 4, 5, 3, 6, 5]


def test_generate_refuses_a_hostile_bundle_template_without_running_it(generator, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setattr(
        generator.tokenizer, "chat_template", "{{ cycler.__init__.__globals__.os.popen('touch %s').read() }}" % marker
    )
    with pytest.raises(RequestError, match="sandbox"):
        generator.generate("hello", max_new_tokens=2, chat=True)
    assert not marker.exists()


def test_the_bundles_own_template_still_renders(generator):
    out = generator.generate("hello", max_new_tokens=3, chat=True)
    assert out.prompt_tokens == len(generator.tokenizer.encode_chat("hello"))


def test_a_bundle_cannot_grant_consent_to_the_bench_peers(generator, tiny_bundle, monkeypatch):
    """The manifest records the build's --allow-pickle / --trust-remote-code; reloading for the peers must not take
    them as consent: only the bench's own flags grant it."""
    pytest.importorskip("transformers")
    from fakes import consent_spy
    from bench.peers.transformers_peer import run_transformers

    hostile, seen = consent_spy(monkeypatch, generator.manifest)
    ids = generator.encode_prompt("def add(a, b):", False)
    rows = run_transformers(hostile, tiny_bundle, {"w": [ids]}, {"w": 2}, 4, 1, generator.eos_ids)
    assert "skipped" in rows[0] and seen and set(seen) == {(False, False)}
    seen.clear()
    run_transformers(hostile, tiny_bundle, {"w": [ids]}, {"w": 2}, 4, 1, generator.eos_ids, allow_pickle=True)
    assert seen and set(seen) == {(True, False)}  # the person running the bench can still say yes


PASSED, MADE, FAILED, RAN_PAST = "passed", "made, or was about to make", "failed to render", "ran past"

# Each would render for minutes or allocate gigabytes without a budget; with the guard that stops it.
UNBOUNDED = [
    ("{{ 'x' * 10000000000 }}", PASSED),
    ("{{ 'ab' * 400000 * 400000 }}", PASSED),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", RAN_PAST),
    (
        "{% for m in messages %}{% for n in messages %}{% for o in messages %}{{ '' }}{% endfor %}{% endfor %}"
        "{% endfor %}",
        RAN_PAST,
    ),
    ("{{ 'x'|center(1000000000) }}", PASSED),
    ("{{ 'x'.center(1000000000) }}", PASSED),
    ("{{ 'x'.ljust(1000000000) }}", PASSED),
    ("{{ '%*d'|format(1000000000, 1) }}", PASSED),
    ("{{ '{:>1000000000}'.format(1) }}", PASSED),
    ("{{ 'x'|indent(1000000000, true) }}", PASSED),
    (
        "{% set s = namespace(t='xx') %}{% for i in range(64) %}{% set s.t = s.t ~ s.t %}{% endfor %}{{ s.t|length }}",
        MADE,
    ),
    ("{% for i in range(99999) %}{% set x = messages|tojson %}{% endfor %}", RAN_PAST),
    ("{{ ('x' * 60000)|replace('x', 'x' * 60000) }}", MADE),
    ("{{ ('x' * 60000).replace('', 'y' * 50000) }}", MADE),
    ("{{ [1] * 100000 * 100000 }}", MADE),
    ("{{ 10 ** 100000 }}", "raised 10 to the power"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", f"{FAILED}: RecursionError"),
    ("{{ 1 / 0 }}", f"{FAILED}: ZeroDivisionError"),
    ("{{ messages + 1 }}", f"{FAILED}: TypeError"),
    ("{{ lipsum(1000000000) }}", PASSED),
    (
        "{% for i in range(99999) %}{{ 'y' * 99 }}{% endfor %}{% for i in range(99999) %}{{ 'y' * 99 }}{% endfor %}",
        RAN_PAST,
    ),
    ("{{ messages[0]['content'] * 99999 }}", MADE),
    ("{{ {}|tojson(indent=1000000) }}", PASSED),
]


class FakeClock:
    """The time budget's clock: ``tick`` seconds pass at each reading (0: time stands still). The first reading
    starts the budget; ``late_reads`` counts the readings past its end."""

    def __init__(self, tick: float = 0.0):
        import threading

        self.now, self.tick, self.deadline, self.late_reads, self.read = 0.0, tick, None, 0, threading.Event()

    def __call__(self) -> float:
        from runtime.text.chat_template import TIME_BUDGET

        value, self.now = self.now, self.now + self.tick
        if self.deadline is None:
            self.deadline = value + TIME_BUDGET
        elif value > self.deadline:
            self.late_reads += 1
        self.read.set()
        return value


@pytest.fixture
def budget_clock(monkeypatch):
    """Install a fake clock as the budget's: ``budget_clock(tick)``."""
    from runtime.text import chat_template

    def install(tick: float = 0.0) -> FakeClock:
        clock = FakeClock(tick)
        monkeypatch.setattr(chat_template, "clock", clock)
        return clock

    return install


def refusal(template: str, messages: list[dict]) -> str:
    """The ValueError's message a render ends with ("" if it renders)."""
    try:
        render_chat_template(template, messages)
    except ValueError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("template,guard", UNBOUNDED, ids=range(len(UNBOUNDED)))
def test_a_template_that_would_not_end_or_would_fill_memory_is_stopped_by_its_own_guard(template, guard, budget_clock):
    """Size, argument and error guards stop their templates with time standing still (no machine is too slow or
    too fast for them); a template only time stops is stopped at the first reading past the budget, whatever the
    machine's speed (a fake clock that moves 1/1000 of the budget at each reading)."""
    from runtime.text.chat_template import TIME_BUDGET

    import threading

    clock = budget_clock(TIME_BUDGET / 1000 if guard == RAN_PAST else 0.0)
    messages = [{"role": "user", "content": "x" * 200}] * 200
    outcome = []
    render = threading.Thread(target=lambda: outcome.append(refusal(template, messages)), daemon=True)
    render.start()
    render.join(60)  # a hang guard (an unbounded render would run for hours), not a speed limit
    assert outcome, "the render was not stopped"
    assert "chat template" in outcome[0] and guard in outcome[0]
    if guard == RAN_PAST:
        assert clock.late_reads == 1  # stopped at the first reading past the budget, not before, not later


def test_a_hostile_render_holds_no_lock_a_concurrent_good_one_needs(budget_clock):
    """A good request renders, in full, while another thread's template is still spinning (its clock held still):
    the budget is the spinning thread's own, and nothing the good render needs waits for it."""
    import threading

    clock = budget_clock()
    outcome = {}

    def spin() -> None:
        with pytest.raises(ValueError, match=RAN_PAST) as err:
            render_chat_template(UNBOUNDED[2][0], USER)
        outcome["spinner"] = str(err.value)

    spinning = threading.Thread(target=spin, daemon=True)
    spinning.start()
    assert clock.read.wait(10)  # the hostile render is inside its budget
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    good = threading.Thread(target=lambda: outcome.update(good=render_chat_template(template, USER)), daemon=True)
    good.start()
    good.join(10)  # a hang guard, not a speed limit
    assert outcome.get("good") == "<user>hi" and spinning.is_alive()  # done while the other still spins
    clock.tick = 1.0  # now time passes for the spinner: its budget ends it
    spinning.join(10)
    assert not spinning.is_alive() and RAN_PAST in outcome["spinner"]


def test_templates_are_compiled_once():
    from runtime.text import chat_template

    chat_template._compiled.cache_clear()
    for _ in range(3):
        render_chat_template("{{ messages|length }}", USER)
    assert chat_template._compiled.cache_info().hits == 2


def test_a_template_budget_error_through_the_server_is_a_400_for_that_request_only(tmp_path):
    tokenizer = _bos_tokenizer(
        tmp_path, "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="ran past"):
        tokenizer.encode_chat(USER)


def test_a_string_grown_through_a_namespace_is_stopped_by_the_size_budget():
    """``{% set ns.t = ns.t ~ ns.t %}`` keeps the string in a namespace, which the frame's variables never show: it
    must be stopped by its size at ~2M characters, not by the time budget after growing to hundreds of MB."""
    template = (
        "{% set s = namespace(t='xx') %}{% for i in range(64) %}{% set s.t = s.t ~ s.t %}{% endfor %}{{ s.t|length }}"
    )
    with pytest.raises(ValueError, match="characters or items"):
        render_chat_template(template, [{"role": "user", "content": "hi"}])


# Each makes ~30 MB from a 1 MB string without ever holding a value the old per-value checks saw as big (thirty
# references in a list, a separator, a format field used thirty times, a captured block, a lazy map...). Scaled to tens
# of MB so the code before the budget fails these tests without running the machine out of memory; nested, the same
# shapes reach gigabytes.
X = "{% set x = 'x' * 100000 * 10 %}"
THIRTY_X = "[" + ", ".join(["x"] * 30) + "]"
NS = "{% set ns = namespace(s='x' * 100000 * 10) %}"  # the string held by the namespace only
THROUGH_A_NAMESPACE = [
    NS + "{% set ns.s = " + " ~ ".join(["ns.s"] * 30) + " %}",
    NS + "{% set ns.s = ((ns.s ~ ns.s ~ ns.s) ~ (ns.s ~ ns.s ~ ns.s)) ~ ((ns.s ~ ns.s) ~ ns.s) %}",
    NS + "{% for i in range(3) %}{% set ns.s = " + " ~ ".join(["ns.s"] * 15) + " %}{% endfor %}",
]
AMPLIFIED = THROUGH_A_NAMESPACE + [
    X + t
    for t in [
        "{{ " + " ~ ".join(["x"] * 30) + " }}",
        "{{ x ~ " + THIRTY_X + " }}",
        "{{ " + THIRTY_X + "|join }}",
        "{{ (range(30)|list)|join(x) }}",
        "{{ x.join(range(30)|map('string')) }}",
        "{{ " + THIRTY_X + "|string }}",
        "{{ " + THIRTY_X + "|tojson }}",
        "{{ " + THIRTY_X + "|pprint }}",
        "{{ [x] * 30 }}",
        "{% set l = [x] * 30 %}{{ l|join }}",
        "{{ ('%(a)s' * 30) % {'a': x} }}",
        "{{ ('%s' * 30) % (" + ", ".join(["x"] * 30) + ") }}",
        "{{ ('{0}' * 30).format(x) }}",
        "{{ ('{a}' * 30).format_map({'a': x}) }}",
        "{{ ('%s' * 30)|format(" + ", ".join(["x"] * 30) + ") }}",
        "{{ ('a\\n' * 30)|indent(x, true) }}",
        "{{ ('a ' * 30)|wordwrap(2, wrapstring=x) }}",
        "{{ ('\\t' * 300).expandtabs(100000) }}",
        "{{ ('a' * 30).translate({97: x}) }}",
        "{% set s %}{% for i in range(30) %}{{ x }}{% endfor %}{% endset %}{{ s|length }}",
        "{% macro m() %}{% for i in range(30) %}{{ x }}{% endfor %}{% endmacro %}{{ m()|length }}",
        "{% filter upper %}{% for i in range(30) %}{{ x }}{% endfor %}{% endfilter %}",
        "{% macro w() %}{{ caller()|length }}{% endmacro %}{% call w() %}{% for i in range(30) %}{{ x }}{% endfor %}"
        "{% endcall %}",
        "{{ range(300)|map('center', 100000)|list|length }}",
        "{{ " + THIRTY_X + "|map('upper')|list|length }}",
        "{% set ns = namespace(l=[]) %}{% for i in range(30) %}{% set ns.l = ns.l + [x] %}{% endfor %}{{ ns.l|join }}",
        "{{ dict(" + ", ".join(f"k{i}=x" for i in range(30)) + ")|tojson }}",
        "{{ {" + ", ".join(f"'k{i}': x" for i in range(30)) + "}|xmlattr }}",
        "{% set ns = namespace(a=" + THIRTY_X + ") %}{{ ns.a }}",
        "{{ [" + ", ".join(["[" + ", ".join(["x"] * 10) + "]"] * 3) + "]|sum(start=[])|join }}",
        "{{ (" + THIRTY_X + "|batch(10)|list)|string }}",
        "{% for i in range(30) %}{{ loop.cycle(" + THIRTY_X[1:-1] + ") ~ x }}{% endfor %}{{ [loop] }}",
    ]
]


# Amplifiers the estimate missed (each made tens of MB before the refusal, or hundreds at the sizes:
# tojson(indent=<1 MB string>) 180 MB, ('{0:{1}}' * 3000).format('x', 99999) 592 MB): a string indent or long
# separators, format widths and precisions (literal, nested, from '*'), tojson's indentation by depth.
NESTED = "{% set ns = namespace(l=range(20000)|list) %}{% for i in range(300) %}{% set ns.l = [ns.l] %}{% endfor %}"
WIDTHS = [
    X + "{{ {'a': [1, [2, [3]]]}|tojson(indent=x) }}",
    X + "{{ (range(30)|list)|tojson(separators=(x, ':')) }}",
    NESTED + "{{ ns.l|tojson(indent=2) }}",
    "{{ ('{0:{1}}' * 300).format('x', 99999) }}",
    "{{ ('{0:99999}' * 300).format('x') }}",
    "{{ '{0:{1}}'.format('x', '3' ~ '0' * 7) }}",
    "{{ ('{0:{1}{1}{1}}' * 20).format('x', 99) }}",
    "{{ ('{:{}}' * 300).format(*(['x', 99999] * 300)) }}",
    "{{ ('{a:{w}}' * 300).format(a='x', w=99999) }}",
    "{{ ('{a:{w}}' * 300).format_map({'a': 'x', 'w': 99999}) }}",
    "{{ ('{0:.99999f}' * 300).format(1.5) }}",
    "{{ ('{0:0>99999}' * 300).format(1) }}",
    "{{ ('{0!r:^99999}' * 300).format(1) }}",
    "{{ ('%*s' * 300) % ((99999, 'x') * 300) }}",
    "{{ ('%(a)99999s' * 300) % {'a': 'x'} }}",
    "{{ ('%-99999s' * 300)|format(*(['x'] * 300)) }}",
    "{{ ('%.99999f' * 300) % ((1.0,) * 300) }}",
]
AMPLIFIED += WIDTHS


@pytest.mark.parametrize("template", AMPLIFIED, ids=range(len(AMPLIFIED)))
def test_every_way_a_value_grows_is_budgeted_before_it_is_made(template):
    """Refused, and before the big value exists: the render's peak allocation stays a few times the 1 MB input."""
    import tracemalloc
    from runtime.text import chat_template

    chat_template._compiled(template)  # compiling is not rendering: outside the measure
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="chat template"):
            render_chat_template(template, USER)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12 * 2**20, f"{peak / 2**20:.1f} MiB allocated before the refusal"


def test_real_templates_render_as_jinja2_renders_them_with_time_standing_still(budget_clock):
    """The guards change nothing a real template renders (jinja2's own environment, no sandbox, no budget, is the
    reference), and none of them needs time to pass (the budget's clock is held still). What a render costs:
    ``python -m bench.guards``."""
    import jinja2

    from bench.guards import REAL_TEMPLATES, long_conversation

    budget_clock()
    messages, tools = long_conversation()
    plain = jinja2.Environment()
    plain.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    variables = dict(tools=tools, bos_token="<s>", eos_token="</s>", add_generation_prompt=True)
    for template in REAL_TEMPLATES:
        want = plain.from_string(template).render(messages=messages, **variables)
        assert render_chat_template(template, messages, **variables) == want, template
    assert render_chat_template(REAL_TEMPLATES[2], USER) == "|1"


def test_tojson_takes_an_integer_indent_and_short_separators():
    """transformers' templates pass tojson an integer indent (2, 4) and separators like (", ", ": "); a string indent
    is written once per line and level, and long separators once per item: both refused, naming the argument."""
    value = "{{ {'a': [1, 2]}|tojson(%s) }}"
    good = render_chat_template(value % "indent=2, separators=(',', ': ')", USER)
    assert good == '{\n  "a": [\n    1,\n    2\n  ]\n}'
    for arguments, words in [
        ("indent='  '", "indent of '  '"),
        ("indent=65", "indent of 65"),
        ("separators=(', ', ':' * 9)", "separators"),
        ("separators=', '", "separators"),
    ]:
        with pytest.raises(ValueError, match=words):
            render_chat_template(value % arguments, USER)


def test_chat_template_is_applied(generator):
    rendered = generator.tokenizer.apply_chat_template("hello")
    assert rendered.startswith("<|im_start|>user\nhello<|im_end|>") and rendered.endswith("assistant\n")
    chat = generator.generate("hello", max_new_tokens=5, chat=True)
    assert chat.prompt_tokens == len(generator.tokenizer.encode(rendered))
