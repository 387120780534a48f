"""Reasoning parsers (--reasoning-parser): the thinking part of a chat response, between
`<think>` and `</think>`, goes to `reasoning_content`, the rest to `content`.

A response starts in its thinking part when the output opens with the start tag, when the
rendered prompt ends with it (templates that open the thinking for the model: Qwen3's
thinking models, DeepSeek-R1's), or always for a parser whose models always think (deepseek-r1;
its older template lets the model write the tag itself). Without an end tag, everything after
the start is reasoning. The text is split as it streams: a piece that may be the beginning of a
tag is held back until the next one decides it; a whole response is the same split fed at once,
so a stream reassembles to the whole response exactly.
"""

from __future__ import annotations

from typing import Callable, Optional

REASONING_PARSERS: dict[str, type["ReasoningParser"]] = {}


def register(name: str) -> Callable[[type["ReasoningParser"]], type["ReasoningParser"]]:
    def wrap(cls: type["ReasoningParser"]) -> type["ReasoningParser"]:
        REASONING_PARSERS[name] = cls
        return cls
    return wrap


class ReasoningParser:
    """One response's split; `feed` each new piece of text, then `finish`. Both return
    (reasoning, content) deltas."""

    start = "<think>"
    end = "</think>"
    always_thinks = False

    def __init__(self, prompt_text: str = "") -> None:
        opened = prompt_text.rstrip().endswith(self.start)
        self.thinking_first = self.always_thinks or opened
        self.state = "head"  # head: the output may still open with the start tag
        self.held = ""
        self.any_reasoning = False
        self.opening = True  # the newlines that open a thinking part are not reasoning

    def feed(self, piece: str) -> tuple[str, str]:
        text, self.held = self.held + piece, ""
        reasoning = content = ""
        if self.state == "head":
            body = text.lstrip()
            if self.start.startswith(body) and len(body) < len(self.start):
                self.held = text  # (nothing yet, or a beginning of the tag)
                return "", ""
            if body.startswith(self.start):
                text, self.state = body[len(self.start):], "reasoning"
            else:
                self.state = "reasoning" if self.thinking_first else "content"
        if self.state == "reasoning":
            if self.opening:
                text = text.lstrip("\n")
                self.opening = not text
            at = text.find(self.end)
            if at < 0:
                keep = _partial_suffix(text, self.end)
                reasoning, self.held = text[:len(text) - keep], text[len(text) - keep:]
                self.any_reasoning |= bool(text)
                return reasoning, ""
            reasoning, text = text[:at], text[at + len(self.end):]
            self.any_reasoning = True
            self.state = "after"
        if self.state == "after":  # the newlines that follow the end tag are no content
            text = text.lstrip("\n")
            if not text:
                return reasoning, ""
            self.state = "content"
        content = text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        held, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "head" and self.thinking_first):
            self.any_reasoning |= bool(held)
            return held.lstrip() if self.state == "head" else held, ""
        return "", held

    def split(self, text: str) -> tuple[Optional[str], str]:
        """A whole response: (reasoning_content, or None when there was none; content)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        reasoning = r1 + r2
        return (reasoning if self.any_reasoning else None), c1 + c2


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@register("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: thinks when the output (or the prompt, as enable_thinking templates of the
    thinking releases do) opens `<think>`; with enable_thinking=false its template closes an
    empty thinking part in the prompt, and the whole output is content."""


@register("deepseek-r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: always thinks; its template opens `<think>` in the prompt, and an output
    without the start tag is reasoning up to `</think>`."""

    always_thinks = True
