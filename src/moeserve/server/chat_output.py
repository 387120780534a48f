"""A chat request's tools, template options and output parsing.

`ChatPlanner.plan` turns a chat request into what the template renders (messages with their
tool calls, the tools, chat_template_kwargs), the grammar its output follows (response_format's,
or the forced tool calls of tool_choice "required" or a named function, in the tool parser's
format) and how its output is read back (`ChatOutput`). A choice's text then goes through the
reasoning parser (thinking to `reasoning_content`), then the tool parser (calls to
`tool_calls`), piece by piece when it streams; a whole response is the same split fed at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from moeserve.server.errors import bad_request
from moeserve.server.reasoning import REASONING_PARSERS, ReasoningParser
from moeserve.server.structured import request_grammar
from moeserve.server.tool_parsers import ToolCall, ToolCallStream, ToolParser, create_tool_parser
from moeserve.runtime.grammar import GrammarError, GrammarSpec

RESERVED_TEMPLATE_KEYS = ("messages", "tools")


@dataclass(frozen=True)
class ChatOutput:
    """How a chat request's output is read back."""

    prompt_text: str
    reasoning: Optional[type[ReasoningParser]]
    tools: Optional[ToolParser]  # None: calls are not looked for (no tools, tool_choice none)
    max_calls: Optional[int] = None
    named: bool = False  # a named tool choice finishes with "stop" (as OpenAI)

    def start(self) -> "ChatOutputState":
        return ChatOutputState(self)


@dataclass
class ChatOutputState:
    """One choice's parsers."""

    spec: ChatOutput
    reasoning: Optional[ReasoningParser] = None
    tools: Optional[ToolCallStream] = None
    calls: int = 0

    def __post_init__(self) -> None:
        if self.spec.reasoning is not None:
            self.reasoning = self.spec.reasoning(self.spec.prompt_text)
        if self.spec.tools is not None:
            self.tools = ToolCallStream(self.spec.tools, self.spec.max_calls)

    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        """The delta of the next piece of text: content, reasoning_content (with a reasoning
        parser) and tool_calls (those completed by it)."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                r, c = self.reasoning.finish()
                reasoning, content = reasoning + r, content + c
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                c, more = self.tools.finish()
                content, calls = content + c, calls + more
        out: dict[str, Any] = {"content": content}
        if self.reasoning is not None:
            out["reasoning_content"] = reasoning
        if calls:
            out["tool_calls"] = [c.to_openai(self.calls + k) for k, c in enumerate(calls)]
            self.calls += len(calls)
        return out

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        if reason == "stop" and self.calls and not self.spec.named:
            return "tool_calls"
        return reason

    def message(self, text: str, reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """The whole response's message and finish reason."""
        delta = self.feed(text, final=True)
        calls = [{k: v for k, v in c.items() if k != "index"} for c in delta.get("tool_calls", [])]
        message: dict[str, Any] = {"role": "assistant", "content": delta["content"]}
        if calls and not delta["content"].strip():
            message["content"] = None
        if self.reasoning is not None:
            message["reasoning_content"] = (delta["reasoning_content"]
                                            if self.reasoning.any_reasoning else None)
        message["tool_calls"] = calls
        return message, self.finish_reason(reason)


@dataclass
class ChatPlan:
    messages: list[dict[str, Any]]
    template_tools: Optional[list[dict[str, Any]]]
    template_kwargs: dict[str, Any]
    grammar: Optional[GrammarSpec]
    output: Optional[ChatOutput] = field(default=None)


class ChatPlanner:
    def __init__(self, tool_parser: Optional[str], reasoning_parser: Optional[str]) -> None:
        self.tool_parser = create_tool_parser(tool_parser) if tool_parser else None
        self.reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None

    def plan(self, req: Any) -> ChatPlan:
        kwargs = template_kwargs(req.chat_template_kwargs)
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        grammar = request_grammar(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice if req.tool_choice is not None else (
            "auto" if tools else "none")
        named = None if isinstance(choice, str) else choice.function.name
        if choice != "none" and not tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if named is not None and named not in {t["function"]["name"] for t in tools or ()}:
            raise bad_request(f"tool_choice names the function {named!r}, which is not among "
                              "the tools", "tool_choice")
        calls = tools is not None and choice != "none"
        if calls and self.tool_parser is None:
            raise bad_request("this server reads no tool calls: start it with "
                              "--tool-call-parser (hermes, mistral, deepseek-v3), or send "
                              "tool_choice \"none\"", "tools")
        forced = choice == "required" or named is not None
        if forced:
            if grammar is not None:
                raise bad_request("response_format (or a guided field) and a forced "
                                  "tool_choice both constrain the output: give only one",
                                  "tool_choice")
            _check_forced_tools(tools, named)
            grammar = self.tool_parser.grammar(tools, named, req.parallel_tool_calls
                                               is not False)
            try:
                grammar.check()
            except GrammarError as exc:
                raise bad_request(f"tools: {exc}", "tools") from None
        messages = [template_message(m) for m in req.messages]
        out = None
        if calls or self.reasoning is not None:
            out = ChatOutput("", self.reasoning, self.tool_parser if calls else None,
                             1 if req.parallel_tool_calls is False else None, named is not None)
        return ChatPlan(messages, tools if calls else None, kwargs, grammar, out)


def template_kwargs(given: Optional[dict[str, Any]]) -> dict[str, Any]:
    """A request's chat_template_kwargs (a copy), a 400 where they set what the request's own
    fields give (RESERVED_TEMPLATE_KEYS)."""
    kwargs = dict(given or {})
    bad = [k for k in RESERVED_TEMPLATE_KEYS if k in kwargs]
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)}: give them as "
                          "the request's fields", "chat_template_kwargs")
    return kwargs


def template_message(m: Any) -> dict[str, Any]:
    """A message as chat templates take it: text content, and an assistant's tool calls with
    their arguments as objects (the templates write them with tojson)."""
    out = m.model_dump(exclude_none=True) | {"content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls]
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise bad_request(f"a tool call's arguments are not JSON: {text[:80]!r}",
                          "messages") from None
    return value


def _check_forced_tools(tools: list[dict[str, Any]], named: Optional[str]) -> None:
    """A 400 naming the tool whose parameters schema is invalid or matches no arguments, of
    the tools that a forced tool_choice may call (a call of it could never be completed)."""
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if named is not None and fn["name"] != named:
            continue
        try:
            GrammarSpec.json_schema(fn.get("parameters") or {"type": "object"}).check()
        except GrammarError as exc:
            raise bad_request(f"tools[{i}] ({fn['name']!r}): parameters: {exc}",
                              f"tools.{i}.function.parameters") from None
