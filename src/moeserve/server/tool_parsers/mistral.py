"""Mistral / Mixtral (v3 tokenizer): the calls are one JSON array after a marker,

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
"""

from __future__ import annotations

import json
from typing import Any

from moeserve.server.tool_parsers.base import ToolCall, ToolParser, make_call, register


@register("mistral")
class MistralToolParser(ToolParser):
    start = "[TOOL_CALLS]"
    separator = ", "

    def parse_calls(self, section: str) -> tuple[list[ToolCall], int]:
        body = section[len(self.start):]
        skipped = len(body) - len(body.lstrip())
        try:
            value, used = json.JSONDecoder(strict=False).raw_decode(body.lstrip())
        except json.JSONDecodeError:
            return [], 0  # not complete yet (or not JSON)
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            call = make_call(item.get("name"), item.get("arguments")) \
                if isinstance(item, dict) else None
            if call is None:
                return [], 0
            calls.append(call)
        return calls, len(self.start) + skipped + used

    def call_tag(self, name: str) -> tuple[str, str]:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ', "}"

    def wrap(self, calls: dict[str, Any]) -> dict[str, Any]:
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": self.start + "["}, calls,
            {"type": "const_string", "value": "]"}]}
