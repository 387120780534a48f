"""What every tool-call parser shares: the registry, the parsed call, the streaming split of
an output into content and calls, and the structural tag that forces calls.

A parser knows the text that opens the calls (`start`), how to read the complete calls of the
text from there (`parse_calls`), and each call's begin and end around its JSON arguments
(`call_tag`), from which `grammar` builds an xgrammar structural tag: the arguments follow the
function's JSON schema, so they always parse and validate.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from moeserve.runtime.grammar import GrammarSpec

TOOL_PARSERS: dict[str, type["ToolParser"]] = {}
MAX_WHITESPACE = 1  # per gap in forced arguments: a weak model cannot pad them forever


def register(name: str) -> Callable[[type["ToolParser"]], type["ToolParser"]]:
    def wrap(cls: type["ToolParser"]) -> type["ToolParser"]:
        cls.name = name
        TOOL_PARSERS[name] = cls
        return cls
    return wrap


def create_tool_parser(name: str) -> "ToolParser":
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: Optional[int] = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def make_call(name: Any, arguments: Any) -> Optional[ToolCall]:
    """A call from a parsed name and arguments (an object, or JSON text of one); None when
    they are not of that shape."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, strict=False)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


class ToolParser:
    name = ""
    start = ""  # the text that opens the tool calls of an output

    def parse_calls(self, section: str) -> tuple[list[ToolCall], int]:
        """The complete calls at the start of `section` (which begins with `start`), and
        where the text they take ends."""
        raise NotImplementedError

    def call_tag(self, name: str) -> tuple[str, str]:
        """(begin, end): the text around one call of `name`'s JSON arguments."""
        raise NotImplementedError

    def wrap(self, calls: dict[str, Any]) -> dict[str, Any]:
        """The format of the whole tool-call part around `calls` (a tags format)."""
        return calls

    separator = ""

    def grammar(self, tools: Sequence[dict[str, Any]], name: Optional[str],
                parallel: bool = True) -> GrammarSpec:
        """The structural tag that forces calls: one call of `name`, or (name None) at least
        one call of any of the tools (only one unless `parallel`)."""
        tags = []
        for tool in tools:
            fn = tool["function"]
            if name is not None and fn["name"] != name:
                continue
            begin, end = self.call_tag(fn["name"])
            schema = fn.get("parameters") or {"type": "object"}
            tags.append({"type": "tag", "begin": begin, "end": end, "content": {
                "type": "json_schema", "json_schema": schema,
                "max_whitespace_cnt": MAX_WHITESPACE}})
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
               "at_least_one": True, "stop_after_first": name is not None or not parallel}
        return GrammarSpec("structural_tag", json.dumps(
            {"type": "structural_tag", "format": self.wrap(fmt)}, ensure_ascii=False))


class ToolCallStream:
    """Splits one output, piece by piece, into content and tool calls: content goes out until
    the parser's start text (a piece that may begin it is held back); from there, each call
    goes out once it is complete. A whole response is the same split fed at once, so a stream
    reassembles to it exactly. `max_calls` (parallel_tool_calls false: 1) keeps the first."""

    def __init__(self, parser: ToolParser, max_calls: Optional[int] = None) -> None:
        self.parser, self.max_calls = parser, max_calls
        self.content_held = ""
        self.section: Optional[str] = None  # from the start text on, once seen
        self.calls: list[ToolCall] = []

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        """(content, new complete calls) of the next piece."""
        if self.section is None:
            text = self.content_held + piece
            at = text.find(self.parser.start)
            if at < 0:
                keep = _partial_suffix(text, self.parser.start)
                self.content_held = text[len(text) - keep:]
                return text[:len(text) - keep], []
            self.content_held, self.section = "", text[at:]
            return text[:at], self._new_calls()
        self.section += piece
        return "", self._new_calls()

    def _new_calls(self) -> list[ToolCall]:
        assert self.section is not None
        calls, _ = self.parser.parse_calls(self.section)
        if self.max_calls is not None:
            calls = calls[:self.max_calls]
        new = calls[len(self.calls):]
        self.calls += new
        return new

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: held-back content; a tool-call part with no complete
        call is content after all."""
        if self.section is None:
            held, self.content_held = self.content_held, ""
            return held, []
        new = self._new_calls()
        if not self.calls:
            return self.section, []
        return "", new


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
