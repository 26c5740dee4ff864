"""Whether a request's text is text: every string (and key) of a body valid Unicode, named where it is not.

JSON lets a client send a lone UTF-16 surrogate ("\\ud800"), which Python keeps in a str but no tokenizer can
encode; the front door (runtime/core/request.py) refuses it before any work, naming the field. The common body costs one
encode of its JSON; only a body that fails it is walked, to name the field.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from runtime.errors import RequestError


def check_text(value, field: str, error: type[Exception] = RequestError) -> None:
    """Text must be valid Unicode: a lone surrogate ("\\ud800", which JSON can carry) cannot be encoded as UTF-8,
    and a tokenizer or a detokenizer given one fails deep inside; say so at the door instead. ``value``: a string,
    or chat messages (every string in them)."""
    texts = (
        [value]
        if isinstance(value, str)
        else [v for m in value if isinstance(m, dict) for v in m.values() if isinstance(v, str)]
    )
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise error(
                f"{field + ': ' if field else ''}not valid Unicode text ({err.reason} at character "
                f"{err.start}); send UTF-8 without lone surrogates"
            ) from None


def invalid_text_path(value) -> tuple[str, str] | None:
    """(the dotted path of the first string, or key, in a JSON-like value that is not valid Unicode text, why) or
    None when every one is. A server's body is walked with it where its one encoding failed (``check_sent_text``:
    a lone surrogate would fail whichever encoder meets it first: a grammar compiler, a tokenizer, a log line), so
    every such string is a 400 naming where it is, ignored fields included. A loop, not recursion: the body is
    client input."""
    stack = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            why = _encoding_error(item)
            if why:
                return path, why
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                where = f"{path}.{_printable(key)}".lstrip(".")
                why = _encoding_error(key) if isinstance(key, str) else ""
                if why:
                    return where, why
                stack.append((where, child))
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{path}.{i}".lstrip("."), v) for i, v in reversed(list(enumerate(item))))
    return None


def check_sent_text(sent) -> None:
    """RequestError naming the first string (or key) of a request body that is not valid Unicode text. The common
    case costs one encoding of the body in C (``json.dumps`` then UTF-8 fails on a lone surrogate); the walk that
    names the field runs only for a body that has one, which is refused. ``sent``: JSON-like data, or the pydantic
    model it was parsed into (dumped here, where its cost is paid off the event loop)."""
    if isinstance(sent, BaseModel):
        sent = sent.model_dump(exclude_none=True)
    try:
        json.dumps(sent, ensure_ascii=False).encode("utf-8")
        return
    except (UnicodeEncodeError, TypeError):  # TypeError: not JSON data (a caller's own objects): walked as it is
        pass
    invalid = invalid_text_path(sent)
    if invalid is None:
        return
    where, why = invalid
    raise RequestError(
        f"{where}: not valid Unicode text ({why}); send UTF-8 without lone surrogates", where.split(".")[0]
    )


def _encoding_error(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"{err.reason} at character {err.start}"
    return ""


def _printable(key) -> str:
    """A key as a path segment that can itself be written as UTF-8 (a lone surrogate as its escape)."""
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")
