"""Tool-call parsers (--tool-call-parser): each model family writes its calls in its own
format; a parser finds them in the output, and writes the grammar that forces them (for
tool_choice "required" or a named function). One module per format, in a registry."""

from moeserve.server.tool_parsers.base import (TOOL_PARSERS, ToolCall, ToolCallStream, ToolParser,
                                              create_tool_parser)
from moeserve.server.tool_parsers import deepseek_v3, hermes, mistral  # noqa: F401 (register)

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolCallStream", "ToolParser", "create_tool_parser"]
