"""Hermes / Qwen3 (Qwen2.5, QwQ, Hermes 2 Pro): each call is JSON between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re

from moeserve.server.tool_parsers.base import ToolCall, ToolParser, make_call, register

_CALL = re.compile(r"\s*<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@register("hermes")
class HermesToolParser(ToolParser):
    start = "<tool_call>"
    separator = "\n"

    def parse_calls(self, section: str) -> tuple[list[ToolCall], int]:
        calls, end = [], 0
        for m in _CALL.finditer(section):
            if m.start() != end:  # other text between calls ends them
                break
            try:
                obj = json.loads(m.group(1), strict=False)
            except json.JSONDecodeError:
                break
            call = make_call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) \
                if isinstance(obj, dict) else None
            if call is None:
                break
            calls.append(call)
            end = m.end()
        return calls, end

    def call_tag(self, name: str) -> tuple[str, str]:
        return (f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, '
                f'"arguments": ', "}\n</tool_call>")
