"""Chat templates rendered as hostile code: jinja2's immutable sandbox, plus a budget of time, size and output.

A template comes from a checkpoint or a bundle, and the messages it loops over from a client. The sandbox keeps a
template away from the interpreter (``{{ cycler.__init__.__globals__.os }}`` raises) but not from the machine:
``'x' * 10**10``, two nested loops over ten thousand messages, ``'%*d'|format(10**9, 1)`` or a string doubled in a
loop render without bound, and a template that hangs would pin a server's worker thread for good. So:

* time: a trace function on the rendering thread, active only in the template's own frames, ends the render past
  ``TIME_BUDGET`` seconds (every loop of a template is Python code, so it is always reached);
* size: every way a template makes characters goes through a hook that estimates what it would make *before*
  making it (runtime/text/template_sizes.py) and refuses past ``MAX_VALUE``: operators (``+``, ``*``, ``%``) and
  calls through the sandbox's hooks, filters through a wrapper, ``~`` through the code generator (jinja2 compiles
  it to a ``str_join`` of its operands; ours compiles it to ``environment.concat_values``), ``{% set %}`` blocks,
  macros and ``caller()`` through ``environment.concat``, every ``{{ }}`` through ``finalize``, and the lazy
  iterators ``map``/``select`` & co. return through a counter. An estimate is the value's rendered size (a list of
  thirty references to one 1 MB string is 30 MB once joined), with the multiplying operations (a ``join``
  separator, a format field used many times, ``indent``, ``wordwrap``, ``expandtabs``, ``translate``) counted as
  such. Integer arguments and format widths past ``MAX_ARGUMENT`` are refused; the trace also looks at the
  template's variables and namespace attributes at every line;
* output: rendered in pieces (``Template.generate``) and stopped past ``MAX_OUTPUT`` characters;
* every exception the template raises (ZeroDivisionError, TypeError, RecursionError, ...) becomes a ValueError
  naming it, which a server answers as the request's own 400.

Compiled templates are cached by their text: a server renders the same template for every request.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from collections.abc import Iterator

from runtime.text.template_sizes import (
    filter_size,
    format_size,
    joined_size,
    measure_inputs,
    namespace_attributes,
    rendered_size,
    str_method_size,
)

TIME_BUDGET = 0.5  # seconds a render may take (real templates take well under a millisecond)
MAX_ARGUMENT = 100_000  # largest integer a template may pass to a call, filter or * (a width, a repeat count)
MAX_VALUE = 1 << 20  # longest string or collection a template may make (characters or items)
MAX_OUTPUT = 1 << 22  # characters a render may write
clock = time.perf_counter  # the time budget's clock (a test swaps in a fake one: the budget is a property, not a speed)


class TemplateBudgetError(ValueError):
    """The template went past its time or size budget."""


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
    """Render a chat template the way transformers does, in the bounded sandbox (see the module docstring).

    The helpers real templates use are there: ``raise_exception``, the ``tojson`` filter, ``strftime_now`` and loop
    controls (``{% break %}``, ``{% continue %}``). Raises ValueError naming what went wrong.
    """
    from jinja2.exceptions import SecurityError

    try:
        compiled = _compiled(template)
        variables = dict(variables, messages=messages, add_generation_prompt=add_generation_prompt)
        with _Budget(variables):
            pieces, written = [], 0
            for piece in compiled.generate(**variables):
                written += len(piece)
                if written > MAX_OUTPUT:
                    raise TemplateBudgetError(f"the chat template wrote more than {MAX_OUTPUT} characters")
                pieces.append(piece)
        return "".join(pieces)
    except TemplateBudgetError as err:
        raise TemplateBudgetError(
            f"{err}; it was stopped (a template must render a prompt in well under {TIME_BUDGET:g} s)"
        ) from None
    except SecurityError as err:
        raise ValueError(
            f"the chat template tried something the sandbox forbids ({err}); this template is unsafe, replace it"
        ) from None
    except ValueError as err:  # raise_exception, or a value the template could not handle
        raise ValueError(f"the chat template refused the request: {err}") from None
    except (Exception, RecursionError) as err:  # noqa: BLE001 - any failure of hostile code is the request's own
        raise ValueError(f"the chat template failed to render: {type(err).__name__}: {err}") from None


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    if len(template) > MAX_VALUE:
        raise TemplateBudgetError(f"the chat template is longer than {MAX_VALUE} characters")
    return _environment().from_string(template)


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%", "//"])
        code_generator_class = _concat_generator()

        def concat_values(self, join, values):
            """``a ~ b ~ c``, as compiled by ``code_generator_class``: estimated, then joined by jinja2's own."""
            _check_size(joined_size(values, "", MAX_VALUE, _known()))
            return _checked(join(values))

        def concat(self, pieces):
            """A ``{% set %}`` block's, a macro's, ``caller()``'s or a ``{% filter %}`` block's output pieces."""
            pieces = list(pieces)
            _check_size(sum(map(len, pieces)))
            return "".join(pieces)

        def wrap_str_format(self, value):  # str.format / format_map, wrapped when the template reads them
            if getattr(value, "__name__", "") in ("format", "format_map") and isinstance(
                getattr(value, "__self__", None), str
            ):
                _check_brace_format(value.__self__)
            wrapped = super().wrap_str_format(value)
            return None if wrapped is None else _estimated_format(value.__self__, wrapped)

        def call_binop(self, context, op, left, right):
            _check_arguments((left, right) if op in ("*", "**") else ())
            _check_binop(op, left, right)
            return _checked(super().call_binop(context, op, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's own signature
            _check_arguments(args + tuple(kwargs.values()))
            args = _check_method(__obj, args, kwargs)
            return _checked(super().call(__context, __obj, *args, **kwargs))

    env = BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], finalize=_finalized
    )
    env.globals.pop("lipsum", None)  # lipsum(n=10**9) is text without bound, and no chat template needs it
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


def _concat_generator():
    """jinja2's code generator, but ``~`` compiles to ``environment.concat_values(join, (operands))`` instead of
    ``str_join((operands))``: the operands are estimated before the string exists. jinja2 offers no hook for ``~``
    (it is not one of the sandbox's binops); ``code_generator_class`` is its documented way to change the code a
    template compiles to. The join function chosen is jinja2's own (escaping under autoescape)."""
    from jinja2.compiler import CodeGenerator

    class ConcatGenerator(CodeGenerator):
        def visit_Concat(self, node, frame) -> None:
            if frame.eval_ctx.volatile:
                join = "(markup_join if context.eval_ctx.volatile else str_join)"
            else:
                join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
            self.write(f"environment.concat_values({join}, (")
            for operand in node.nodes:
                self.visit(operand, frame)
                self.write(", ")
            self.write("))")

    return ConcatGenerator


def _check_binop(op: str, left, right) -> None:
    """``*``, ``+`` and ``%`` of strings and sequences, estimated before they run."""
    if op == "%" and isinstance(left, (str, bytes)):
        if isinstance(left, str):
            _check_percent_format(left, right)
        _check_size(format_size(left, right, MAX_VALUE, _known()))
    elif op == "*" and _multiplies_a_sequence(left, right):
        sequence, times = (left, right) if hasattr(left, "__len__") else (right, left)
        _check_size(rendered_size(sequence, MAX_VALUE, _known()) * max(0, int(times)))
    elif op == "**" and isinstance(left, (int, float)) and abs(left) > 1 and right > 64:
        raise TemplateBudgetError(f"the chat template raised {left} to the power {right}")
    elif op == "+" and isinstance(left, (str, bytes, list, tuple)):
        _check_size(joined_size((left, right), "", MAX_VALUE, _known()))


def _check_method(method, args: tuple, kwargs: dict) -> tuple:
    """A str or bytes method that can multiply its string (``join``, ``replace``, ``expandtabs``, ``translate``),
    estimated before it runs; returns the arguments (a lazy iterable given to ``join`` made a list, to count it)."""
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, (str, bytes)):
        return args
    if name == "join" and args and isinstance(args[0], Iterator):
        args = (list(args[0]), *args[1:])
    if name == "replace" and isinstance(owner, str):
        _check_replace(owner, *args)
    _check_size(str_method_size(name, owner, args, kwargs, MAX_VALUE, _known()))
    return args


def _estimated_format(text: str, format_function):
    """``text.format`` / ``format_map`` (jinja2's sandboxed wrapper), estimated before it formats."""

    @functools.wraps(format_function)
    def estimated(*args, **kwargs):
        mapping = args[0] if getattr(format_function, "__name__", "") == "format_map" and args else None
        if isinstance(mapping, dict):
            _check_size(format_size(text, [], MAX_VALUE, _known(), mapping))
        else:
            _check_size(format_size(text, list(args), MAX_VALUE, _known(), kwargs))
        return _checked(format_function(*args, **kwargs))

    return estimated


def _finalized(value):
    """Every ``{{ }}``: its text estimated before ``str()`` writes it."""
    _check_size(rendered_size(value, MAX_VALUE, _known()))
    return value


# Filters whose results hold only references to their input (or a count): checked after. Every other filter writes
# text from its input, so its arguments are estimated first (``[big] * 30|string`` would be 30 big strings).
REFERENCE_FILTERS = frozenset(
    [
        "length",
        "count",
        "first",
        "last",
        "random",
        "min",
        "max",
        "select",
        "reject",
        "selectattr",
        "rejectattr",
        "map",
        "groupby",
        "batch",
        "slice",
        "items",
        "dictsort",
        "sort",
        "reverse",
        "unique",
        "list",
        "attr",
        "default",
        "d",
        "abs",
        "int",
        "float",
        "bool",
        "round",
    ]
)


def _bounded_filter(name: str, function):
    """A filter that checks its arguments and its result (compiled templates call filters directly, not through
    the sandbox's hooks), and estimates what a filter that writes text would write before it does. jinja2's
    pass_context & co. markers travel with functools.wraps."""
    writes = name not in REFERENCE_FILTERS

    @functools.wraps(function)
    def bounded(*args, **kwargs):
        if writes:  # a lazy iterable is counted (its own budget bounds it), then handed over as a list
            args = tuple(list(a) if isinstance(a, Iterator) and not isinstance(a, str) else a for a in args)
        values = [a for a in args if not _is_jinja_internal(a)]
        _check_arguments(values[1:] + list(kwargs.values()))
        if name == "replace" and len(values) >= 3 and isinstance(values[0], str):
            _check_replace(*values[:3])
        if name == "format" and values and isinstance(values[0], str):
            _check_percent_format(values[0], tuple(values[1:]))
        if writes:
            for value in values + list(kwargs.values()):
                _check_size(rendered_size(value, MAX_VALUE, _known()))
            _check_size(filter_size(name, values, kwargs, MAX_VALUE, _known()))
        return _checked(function(*args, **kwargs))

    return bounded


def _is_jinja_internal(value) -> bool:
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context
    from jinja2 import Environment

    return isinstance(value, (Context, EvalContext, Environment))


def _check_percent_format(text: str, values) -> None:
    import re

    widths = [int(w) for w in re.findall(r"%[-+ #0]*(\d+)", text)] + [
        int(w) for w in re.findall(r"%[-+ #0]*(?:\d+|\*)?\.(\d+)", text)
    ]
    _check_arguments(widths + list(values if isinstance(values, tuple) else (values,)))


def _check_brace_format(text: str) -> None:
    import re
    import string

    try:
        specs = [spec for _, _, spec, _ in string.Formatter().parse(text) if spec]
    except ValueError:
        return  # jinja2's own formatter reports the malformed string
    _check_arguments([int(n) for spec in specs for n in re.findall(r"\d+", spec)])


def _check_arguments(values) -> None:
    for value in values:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > MAX_ARGUMENT:
            raise TemplateBudgetError(f"the chat template passed {value!r} (the limit is {MAX_ARGUMENT})")


def _multiplies_a_sequence(left, right) -> bool:
    return (hasattr(left, "__len__") and isinstance(right, int)) or (
        hasattr(right, "__len__") and isinstance(left, int)
    )


def _check_size(size: int) -> None:
    if size > MAX_VALUE:  # an estimate stops counting at MAX_VALUE + 1
        amount = f"more than {MAX_VALUE}" if size == MAX_VALUE + 1 else str(size)
        raise TemplateBudgetError(
            f"the chat template made, or was about to make, a value of {amount} characters "
            f"or items (the limit is {MAX_VALUE})"
        )


def _check_replace(text: str, old="", new="", *rest) -> None:
    if isinstance(old, str) and isinstance(new, str):
        count = text.count(old) if old else len(text) + 1
        _check_size(len(text) + count * max(0, len(new) - len(old)))


def _checked(value):
    """A value the template made, refused past ``MAX_VALUE`` rendered; a lazy iterator counted as it is read."""
    if isinstance(value, Iterator) and not isinstance(value, (str, bytes)):
        return _counted(value)
    _check_size(rendered_size(value, MAX_VALUE, _known()))
    return value


def _counted(iterator):
    """``iterator``'s items while their rendered sizes add up to at most ``MAX_OUTPUT`` (each counts at least 1):
    ``range(99999)|map('center', 99999)|list`` would be 10 GB of new strings, one small item at a time."""
    total = 0
    for item in iterator:
        total += max(1, rendered_size(item, MAX_OUTPUT, _known()))
        if total > MAX_OUTPUT:
            raise TemplateBudgetError(
                f"the chat template read more than {MAX_OUTPUT} characters or items from one iterator"
            )
        yield item


_render = threading.local()  # the render running on this thread: its inputs' sizes


def _known() -> dict | None:
    return getattr(_render, "known", None)


class _Budget:
    """Trace the rendering thread: in the template's frames only, stop past the time budget or when the
    template's variables grow past the size budget. An earlier trace function (a debugger, coverage) is restored.
    Also measures the render's inputs once, for the estimates (``measure_inputs``)."""

    def __init__(self, variables: dict):
        self.variables = variables

    def __enter__(self):
        _render.known = measure_inputs(self.variables, MAX_OUTPUT)
        self.deadline = clock() + TIME_BUDGET
        self.previous = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self.previous)
        _render.known = None

    def _call(self, frame, event, _arg):
        if frame.f_code.co_filename == "<template>":
            return self._line
        if clock() > self.deadline:  # calls into jinja2's runtime count too
            raise TemplateBudgetError(f"the chat template ran past {TIME_BUDGET:g} s")
        return None

    def _line(self, frame, event, _arg):
        if clock() > self.deadline:
            raise TemplateBudgetError(f"the chat template ran past {TIME_BUDGET:g} s")
        _check_size(sum(_size(v) for v in frame.f_locals.values()))
        return self._line


def _size(value) -> int:
    """A template variable's length; a ``namespace()``'s is its attributes' (``{% set ns.s = ns.s ~ ns.s %}``
    grows a string the frame's own variables never show)."""
    if isinstance(value, (str, list, tuple, dict)):
        return len(value)
    attributes = namespace_attributes(value)
    if attributes is not None:
        return sum(len(v) for v in attributes.values() if isinstance(v, (str, list, tuple, dict)))
    return 0


MAX_INDENT = 64  # tojson's largest indent (real templates use 2 or 4)
MAX_SEPARATOR = 8  # characters of each of tojson's separators (real templates use ", " and ": " or none)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    """transformers' tojson: no HTML escaping (jinja2's own filter escapes <, > and &, which changes prompts). An
    indent is a number of spaces up to MAX_INDENT (json.dumps also takes a string, written once per line and level:
    a 1 MB one is an amplifier), separators two short strings; the output's size is estimated before
    (``filter_size``)."""
    if indent is not None and (not isinstance(indent, int) or isinstance(indent, bool) or indent > MAX_INDENT):
        raise TemplateBudgetError(
            f"the chat template asked tojson for an indent of {indent!r:.40} (an integer up to {MAX_INDENT} is allowed)"
        )
    if separators is not None and not (
        isinstance(separators, (list, tuple))
        and len(separators) == 2
        and all(isinstance(s, str) and len(s) <= MAX_SEPARATOR for s in separators)
    ):
        raise TemplateBudgetError(
            f"the chat template asked tojson for separators {separators!r:.60} (two strings of at most "
            f"{MAX_SEPARATOR} characters are allowed)"
        )
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    from datetime import datetime

    if len(format) > 256:
        raise TemplateBudgetError("the chat template's strftime format is longer than 256 characters")
    return datetime.now().strftime(format)


def _raise(message: str):
    raise ValueError(message)
