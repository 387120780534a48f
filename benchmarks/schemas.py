"""The JSON schemas of the structured-output benchmark (structured.py): nested objects, arrays,
enums, bounded numbers, strings with patterns, an optional field. Each ends (properties are
ordered by name: GrammarSpec sorts keys) in one open-ended field, a free string or an array
without maxItems, so that random weights fill the output to its cap in either mode and the two
modes produce the same tokens per request; the bounded fields before it are what the grammar
steers."""

from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any], required: Any = None) -> dict[str, Any]:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


TEXT = {"type": "string"}

SCHEMAS: list[dict[str, Any]] = [
    # nested object
    _obj({"account": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                           "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"}}),
          "text": TEXT}),
    # array of objects
    _obj({"items": {"type": "array", "minItems": 1, "maxItems": 4,
                    "items": _obj({"qty": {"type": "integer", "minimum": 1, "maximum": 100},
                                   "sku": {"type": "string",
                                           "pattern": "^[A-Z]{3}-[0-9]{4}$"}})},
          "remark": TEXT}),
    # enums
    _obj({"color": {"enum": ["red", "green", "blue", "amber"]},
          "mood": {"enum": ["calm", "tense", "bright"]}, "story": TEXT}),
    # bounded numbers
    _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
          "lon": {"type": "number", "minimum": -180, "maximum": 180}, "place": TEXT}),
    # strings with patterns
    _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
          "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,8}\\.(com|org)$"},
          "subject": TEXT}),
    # booleans, an integer enum, a bounded integer, an open array of strings
    _obj({"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
          "level": {"enum": [1, 2, 3]}, "score": {"type": "integer", "minimum": 0,
                                                  "maximum": 100},
          "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}}}),
    # deep nesting
    _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"enum": ["x", "y", "z"]}})})}),
          "body": TEXT}),
    # an optional field between required ones
    _obj({"id": {"type": "integer", "minimum": 0, "maximum": 9999},
          "nickname": {"type": "string", "maxLength": 8}, "title": TEXT},
         required=["id", "title"]),
]


def closed(schema: Any) -> Any:
    """`schema` with every open-ended field bounded (strings of at most 16 characters, arrays of
    at most 3 items), so that a document of it ends within a few hundred tokens even when
    random weights write it: the output check's variant."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    free = not any(k in out for k in ("enum", "pattern", "const"))
    if out.get("type") == "string" and free:
        out["maxLength"] = min(out.get("maxLength", 16), 16)
    if out.get("type") == "array":
        out["maxItems"] = min(out.get("maxItems", 3), 3)
    return out
