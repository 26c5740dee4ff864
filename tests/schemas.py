"""JSON Schemas of many shapes for constrained-decoding tests and the JSON workload: nested objects, arrays, enums,
numbers with bounds, optional fields, strings with bounds and patterns, unions, constants."""

from __future__ import annotations


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    schema = {"type": "object", "properties": properties, "additionalProperties": False, **extra}
    schema["required"] = list(properties) if required is None else required
    return schema


SHORT = {"type": "string", "maxLength": 8}


def schema_cases() -> list[tuple[str, dict]]:
    """(shape, schema) pairs: several of each shape, varied in their details."""
    cases: list[tuple[str, dict]] = []
    for i in range(6):  # flat objects of scalars
        props = {
            f"f{j}": [SHORT, {"type": "integer"}, {"type": "boolean"}, {"type": "number"}][(i + j) % 4]
            for j in range(1 + i % 4)
        }
        cases.append(("flat object", obj(props)))
    for i in range(6):  # nested objects
        inner = obj({"x": {"type": "integer"}, "y": SHORT})
        for _ in range(1 + i % 3):
            inner = obj({"child": inner, "n": {"type": "integer"}})
        cases.append(("nested object", inner))
    for i in range(6):  # arrays with bounds
        items = [{"type": "integer"}, SHORT, {"type": "boolean"}, obj({"id": {"type": "integer"}})][i % 4]
        cases.append(
            ("array", obj({"items": {"type": "array", "items": items, "minItems": i % 3, "maxItems": 2 + i % 3}}))
        )
    for i in range(6):  # enums
        values = [
            ["red", "green", "blue"],
            ["a", "b"],
            [1, 2, 3],
            ["yes", "no", None],
            ["x"] * 1,
            ["low", "mid", "high", "max"],
        ][i]
        cases.append(("enum", obj({"choice": {"enum": values}, "other": {"enum": ["p", "q"]}})))
    for i in range(6):  # numbers with bounds
        low, high = [(0, 9), (-5, 5), (10, 99), (0, 1), (100, 200), (-100, -1)][i]
        kind = "integer" if i % 2 == 0 else "number"
        cases.append(
            (
                "bounded number",
                obj(
                    {
                        "value": {"type": kind, "minimum": low, "maximum": high},
                        "count": {"type": "integer", "minimum": 0, "maximum": 3},
                    }
                ),
            )
        )
    for i in range(6):  # optional fields
        props = {
            "name": SHORT,
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": SHORT,
            "admin": {"type": "boolean"},
        }
        required = list(props)[: i % 3]
        cases.append(("optional fields", obj(props, required)))
    for i in range(5):  # strings with bounds and patterns
        string = [
            {"type": "string", "pattern": "^[a-z]{2,5}$"},
            {"type": "string", "minLength": 2, "maxLength": 4},
            {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
            {"type": "string", "format": "date"},
            {"type": "string", "pattern": "^(GET|POST|PUT)$"},
        ][i]
        cases.append(("string bounds", obj({"s": string})))
    for i in range(5):  # unions
        union = [
            {"anyOf": [{"type": "integer"}, SHORT]},
            {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
            {
                "oneOf": [
                    obj({"kind": {"const": "a"}, "v": {"type": "integer"}}),
                    obj({"kind": {"const": "b"}, "w": SHORT}),
                ]
            },
            {"type": ["integer", "null"]},
            {"anyOf": [{"type": "array", "items": {"type": "integer"}, "maxItems": 2}, {"type": "boolean"}]},
        ][i]
        cases.append(("union", obj({"u": union})))
    for i in range(4):  # constants and fixed structure
        cases.append(
            ("const", obj({"version": {"const": i + 1}, "kind": {"const": f"event{i}"}, "ok": {"type": "boolean"}}))
        )
    for i in range(4):  # arrays of objects (a tool's list of records)
        record = obj(
            {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["a", "b", "c"]}},
            required=["id"] if i % 2 else None,
        )
        cases.append(("array of objects", obj({"records": {"type": "array", "items": record, "maxItems": 1 + i}})))
    return cases
