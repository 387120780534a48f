"""DeepSeek-V3 (and R1, V3.1): the calls sit between begin and end markers, each with its
type, name and JSON arguments in a fenced block,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The markers must reach the text: serve the model with a tokenizer whose markers are not
special tokens (as DeepSeek's are), since special tokens are left out of the output.
"""

from __future__ import annotations

import re
from typing import Any

from moeserve.server.tool_parsers.base import ToolCall, ToolParser, make_call, register

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(\w+)" + re.escape(SEP)
                   + r"(.+?)\n```json\n(.*?)\n```" + re.escape(CALL_END), re.DOTALL)


@register("deepseek-v3")
class DeepSeekV3ToolParser(ToolParser):
    start = CALLS_BEGIN

    def parse_calls(self, section: str) -> tuple[list[ToolCall], int]:
        calls, end = [], len(self.start)
        for m in _CALL.finditer(section, end):
            if m.start() != end or m.group(1) != "function":
                break
            call = make_call(m.group(2).strip(), m.group(3))
            if call is None:
                break
            calls.append(call)
            end = m.end()
        return calls, end

    def call_tag(self, name: str) -> tuple[str, str]:
        return f"{CALL_BEGIN}function{SEP}{name}\n```json\n", f"\n```{CALL_END}"

    def wrap(self, calls: dict[str, Any]) -> dict[str, Any]:
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": CALLS_BEGIN}, calls,
            {"type": "const_string", "value": CALLS_END}]}
