"""A request's structured-output fields as one grammar (runtime/grammar.GrammarSpec).

OpenAI's `response_format` (json_object, json_schema), SGLang's `regex` and `ebnf`, vLLM's
`guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`: at most one of them per
request (two would be two grammars for one output); each is checked by parsing it, so an
invalid schema, regex or grammar is a 400 with xgrammar's reason.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from moeserve.runtime.grammar import GrammarError, GrammarSpec
from moeserve.server.errors import bad_request

FIELDS = ("response_format", "regex", "ebnf", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar")


def request_grammar(req: Any) -> Optional[GrammarSpec]:
    """The grammar that the request's fields ask for, or None; a 400 when they ask for more
    than one or one is invalid."""
    given = [f for f in FIELDS if getattr(req, f) is not None
             and not (f == "response_format" and req.response_format.type == "text")]
    if len(given) > 1:
        raise bad_request(f"{' and '.join(given)} each constrain the output: give only one",
                          given[1])
    if not given:
        return None
    name = given[0]
    spec = _spec(name, getattr(req, name))
    try:
        spec.check()
    except GrammarError as exc:
        raise bad_request(f"{name}: {exc}", name) from None
    return spec


def _spec(name: str, value: Any) -> GrammarSpec:
    try:
        if name == "response_format":
            if value.type == "json_object":
                return GrammarSpec("json_object")
            if value.json_schema is None or value.json_schema.schema_value is None:
                raise bad_request("response_format of type json_schema needs "
                                  "json_schema.schema", "response_format")
            return GrammarSpec.json_schema(value.json_schema.schema_value)
        if name == "guided_json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise bad_request(f"guided_json is not JSON: {exc}", name) from None
            return GrammarSpec.json_schema(value)
        if name in ("regex", "guided_regex"):
            return GrammarSpec("regex", value)
        if name in ("ebnf", "guided_grammar"):
            return GrammarSpec("ebnf", value)
        if not value or not all(value):
            raise bad_request("guided_choice must be a non-empty list of non-empty strings",
                              name)
        # one alternative per choice; JSON's string escapes are EBNF's
        return GrammarSpec("ebnf", "root ::= " + " | ".join(
            json.dumps(c, ensure_ascii=False) for c in value))
    except GrammarError as exc:
        raise bad_request(f"{name}: {exc}", name) from None
