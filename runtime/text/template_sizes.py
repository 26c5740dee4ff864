"""How many characters an operation of a chat template would make, known before it is made.

A template can hold a value that is small in memory and huge once written out: a list of thirty references to one
1 MB string is thirty pointers, and ``|join``, ``|string``, ``~``, ``{{ }}`` or ``'%s' * 30 % ...`` turn it into
30 MB. Checking a result's length after the operation is too late (the 30 MB, or nested, the gigabytes, already
exist), so the sandbox's hooks (runtime/text/chat_template.py) ask here first. Every walk stops as soon as it passes
its limit, so an estimate costs at most ``limit`` steps whatever the value's shape (shared references, nesting, a
namespace holding itself). Estimates are upper bounds up to small factors (a repr's escapes), which is what a
budget against amplification needs.
"""

from __future__ import annotations

import itertools
import re
import string

_END = object()


def rendered_size(value, limit: int, known: dict | None = None) -> int:
    """About the characters ``str(value)`` would take; ``limit + 1`` as soon as it is more than ``limit``.

    Strings count their length, numbers their digits, containers their items plus separators, a jinja2 namespace
    its attributes, anything else 8. ``known``: id -> size of containers measured before (a render's own inputs,
    which stay alive and unchanged while it runs), so a conversation is walked once per render, not per operation.
    """
    if isinstance(value, (str, bytes)):
        return len(value) if len(value) <= limit else limit + 1
    total, stack = 0, [iter((value,))]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        size, children = _node(item, known)
        total += size
        if total > limit:
            return limit + 1
        if children is not None:
            stack.append(children)
    return total


def _node(item, known: dict | None):
    """(characters of ``item`` itself, an iterator over its children or None)."""
    if isinstance(item, (str, bytes)):
        return len(item) + 4, None  # quotes, comma and space inside a container
    if known and id(item) in known:
        return known[id(item)], None
    if isinstance(item, bool) or item is None:
        return 6, None
    if isinstance(item, int):
        return item.bit_length() * 3 // 10 + 4, None
    if isinstance(item, dict):
        return 2, itertools.chain.from_iterable(item.items())
    if isinstance(item, (list, tuple, set, frozenset)):
        return 2, iter(item)
    attributes = namespace_attributes(item)
    if attributes is not None:
        return 14, itertools.chain.from_iterable(attributes.items())
    return 8, None


def namespace_attributes(value) -> dict | None:
    """A jinja2 ``namespace()``'s attributes (None for anything else). jinja2 keeps them in a name-mangled dict and
    offers no way to list them; a namespace is how templates keep state across loop iterations, so a budget must
    see into it. Shared: the render's per-line check reads the same attributes (runtime/text/chat_template.py)."""
    from jinja2.utils import Namespace

    if not isinstance(value, Namespace):
        return None
    return object.__getattribute__(value, "_Namespace__attrs")


def measure_inputs(variables: dict, limit: int) -> dict:
    """id -> size of each container among a render's variables and their items (each message, each tool), walked
    once; every later estimate reuses them (``rendered_size``'s ``known``)."""
    known: dict[int, int] = {}
    for value in variables.values():
        if isinstance(value, (list, tuple, dict)):
            items = value.values() if isinstance(value, dict) else value
            for item in items:
                if isinstance(item, (list, tuple, dict)):
                    known[id(item)] = rendered_size(item, limit)
            known[id(value)] = rendered_size(value, limit, known)
    return known


def joined_size(items, separator, limit: int, known: dict | None = None) -> int:
    """``separator.join(items)`` (or jinja2's ``|join``): the items' text plus a separator between each two."""
    total = max(0, len(items) - 1) * _text_size(separator, limit, known)
    for item in items:
        total += rendered_size(item, limit, known)
        if total > limit:
            return limit + 1
    return total


def format_size(template, arguments, limit: int, known: dict | None = None, keywords: dict | None = None) -> int:
    """``template % arguments``, ``template.format(*arguments, **keywords)`` or ``|format``: each field of the
    template may write the largest argument (``'%(a)s' * 30 % {'a': big}`` writes ``big`` thirty times), padded to
    its width and precision (``('{0:99999}' * 300).format('x')`` is 30 MB from one character)."""
    if not isinstance(template, (str, bytes)):
        return 0
    fields = _field_count(template)
    if isinstance(arguments, dict):
        keywords, arguments = {**arguments, **(keywords or {})}, list(arguments.values())
    elif not isinstance(arguments, (list, tuple)):
        arguments = [arguments]
    values = list(arguments) + list((keywords or {}).values())
    largest = max((rendered_size(a, limit, known) for a in values), default=0)
    padding = format_widths(template, list(arguments), keywords or {}, limit)
    return min(limit + 1, len(template) + fields * largest + padding)


_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_FIELD_NAME = re.compile(r"\d+|[A-Za-z_][A-Za-z0-9_]*|")


def format_widths(template, arguments: list, keywords: dict, limit: int) -> int:
    """The characters a template's fields may pad to beyond their values: the sum of every width and precision,
    ``%`` style (``%*d`` takes its width from the arguments: the largest integer among them) and ``{}`` style (a
    width given by a nested field, ``'{0:{1}}'``, is the argument that field names; one that names anything else,
    or a value that is not a short number, counts as ``limit + 1``: it cannot be bounded before formatting)."""
    text = template.decode("latin-1") if isinstance(template, bytes) else template
    numbers = [a for a in arguments if isinstance(a, int) and not isinstance(a, bool)]
    star = max(0, max(numbers, default=0))
    total = 0
    for field in _PERCENT_FIELD.finditer(text):
        total += sum(star if part == "*" else int(part[:12]) for part in field.groups() if part)
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError:
        return min(total, limit + 1)  # not a valid {} template: .format raises before writing anything
    automatic = [0]
    for _, name, spec, _ in parsed:
        if name is None:
            continue
        if name == "":
            automatic[0] += 1
        if spec:
            total += _spec_width(spec, arguments, keywords, automatic, limit)
        if total > limit:
            return limit + 1
    return total


def _spec_width(spec: str, arguments: list, keywords: dict, automatic: list, limit: int) -> int:
    """The numbers of one ``{}`` field's format spec added up (width, precision; a fill digit counts too: an
    upper bound), its nested fields replaced by the arguments they name."""
    try:
        pieces = list(string.Formatter().parse(spec))
    except ValueError:
        return 0
    resolved = ""
    for literal, name, _, _ in pieces:
        resolved += literal
        if name is None:
            continue
        if not _FIELD_NAME.fullmatch(name):
            return limit + 1  # an attribute or an index: not looked up here
        if name == "":
            name, automatic[0] = str(automatic[0]), automatic[0] + 1
        value = arguments[int(name)] if name.isdigit() and int(name) < len(arguments) else keywords.get(name)
        text = str(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
        if text is None or len(text) > 12:
            return limit + 1
        resolved += text
    return min(limit + 1, sum(int(n[:12]) for n in re.findall(r"\d+", resolved)))


def _field_count(template) -> int:
    if isinstance(template, bytes):
        return template.count(b"%") + template.count(b"{")
    try:
        return sum(1 for _, name, _, _ in string.Formatter().parse(template) if name is not None) + template.count("%")
    except ValueError:
        return template.count("%") + template.count("{")


def json_size(value, indent, separators, limit: int, known: dict | None = None) -> int:
    """``json.dumps(value, indent=..., separators=...)``: the value's rendered size, plus per item its separators
    and, with an indent, a new line indented to its depth (a list nested 300 deep holding 20,000 numbers is 12M
    characters of indentation at ``indent=2``)."""
    indent_width = indent if isinstance(indent, int) and not isinstance(indent, bool) else 0
    separator = sum(len(s) for s in separators) if isinstance(separators, (list, tuple)) else 2
    total, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = [(child, depth + 1) for pair in item.items() for child in pair]
        elif isinstance(item, (list, tuple)):
            children = [(child, depth + 1) for child in item]
        else:
            total += rendered_size(item, limit, known)
            children = []
        total += 2 + len(children) * (separator + (1 + depth * indent_width if indent_width else 0))
        if total > limit:
            return limit + 1
        stack.extend(children)
    return total


def str_method_size(method: str, text, args: tuple, kwargs: dict, limit: int, known: dict | None = None) -> int:
    """What a str (or bytes) method that can multiply its input would make; 0 for the others (their results are at
    most a few times the string, checked after the call)."""
    if method == "join" and args:
        return joined_size(args[0], text, limit, known) if hasattr(args[0], "__len__") else 0
    if method == "format":
        return format_size(text, list(args), limit, known, kwargs)
    if method == "format_map":
        return format_size(text, [], limit, known, args[0] if args and isinstance(args[0], dict) else {})
    if method == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        tabs = text.count("\t" if isinstance(text, str) else b"\t")
        return len(text) + tabs * tabsize if isinstance(tabsize, int) else 0
    if method == "translate" and args and isinstance(args[0], dict):
        largest = max((rendered_size(v, limit, known) for v in args[0].values()), default=1)
        return len(text) * max(1, largest)
    return 0


def filter_size(name: str, values: list, kwargs: dict, limit: int, known: dict | None = None) -> int:
    """What jinja2's filters that can multiply their input would make (``join``, ``format``, ``indent``,
    ``wordwrap``); 0 for the others."""
    if not values:
        return 0
    text = values[0]
    if name == "join":
        separator = values[1] if len(values) > 1 else kwargs.get("d", "")
        return joined_size(text, separator, limit, known) if hasattr(text, "__len__") else 0
    if name == "format":
        return format_size(text, list(values[1:]), limit, known, kwargs)
    if name == "tojson":
        indent = values[2] if len(values) > 2 else kwargs.get("indent")
        separators = values[3] if len(values) > 3 else kwargs.get("separators")
        return json_size(text, indent, separators, limit, known)
    if name == "pprint":
        return json_size(text, 1, None, limit, known)
    if not isinstance(text, str):
        return 0
    if name == "indent":
        width = values[1] if len(values) > 1 else kwargs.get("width", 4)
        return len(text) + (text.count("\n") + 1) * _text_size(width, limit, known)
    if name == "wordwrap":
        width = values[1] if len(values) > 1 else kwargs.get("width", 79)
        wrap = values[4] if len(values) > 4 else kwargs.get("wrapstring", "\n")
        breaks = len(text) // max(1, width if isinstance(width, int) else 1) + 1
        return len(text) + breaks * _text_size(wrap, limit, known)
    return 0


def _text_size(value, limit: int, known: dict | None) -> int:
    """A separator, indent or wrap string's length; an integer indent is that many spaces."""
    if isinstance(value, int) and not isinstance(value, bool):
        return max(0, value)
    return rendered_size(value if value is not None else "", limit, known)
