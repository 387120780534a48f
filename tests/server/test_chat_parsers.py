"""The reasoning and tool-call parsers on fixed text: whole, and split at random into pieces
(a stream), which must give the same result; and each tool parser's forcing grammar accepts
the format it parses."""

from __future__ import annotations

import json
import random

import pytest

from moeserve.runtime.grammar import GrammarBackend, tokenizer_info
from moeserve.runtime.tokenizer import load_tokenizer
from moeserve.server.reasoning import REASONING_PARSERS
from moeserve.server.tool_parsers import ToolCallStream, create_tool_parser

REASONING = [  # parser, prompt, output, (reasoning_content, content)
    ("qwen3", "", "<think>\n\nabc\n</think>\n\nHello", ("abc\n", "Hello")),
    ("qwen3", "q<|im_start|>assistant\n<think>\n", "abc</think>\n\nHi", ("abc", "Hi")),
    ("qwen3", "", "plain <think> text", (None, "plain <think> text")),
    ("qwen3", "", "<thi", (None, "<thi")),
    ("qwen3", "", "  <think>unfinished", ("unfinished", "")),
    ("deepseek-r1", "", "abc</think>ok", ("abc", "ok")),
    ("deepseek-r1", "", "<think>x</think>\ny", ("x", "y")),
    ("deepseek-r1", "", "no end", ("no end", "")),
]


def _pieces(text, rng):
    i = 0
    while i < len(text):
        k = rng.randint(1, 5)
        yield text[i:i + k]
        i += k


@pytest.mark.parametrize("name, prompt, text, want", REASONING)
def test_reasoning_parsers(name, prompt, text, want):
    assert REASONING_PARSERS[name](prompt).split(text) == want
    rng = random.Random(0)
    for _ in range(40):
        p = REASONING_PARSERS[name](prompt)
        r = c = ""
        for piece in _pieces(text, rng):
            a, b = p.feed(piece)
            r, c = r + a, c + b
        a, b = p.finish()
        assert ((r + a) if p.any_reasoning else None, c + b) == want


ARGS = {"city": "Paris", "n": [1, 2], "s": "a}\"b"}
TOOL_TEXT = {
    "hermes": ('Sure. <tool_call>\n{"name": "f", "arguments": ' + json.dumps(ARGS)
               + '}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'),
    "mistral": ('Sure. [TOOL_CALLS][{"name": "f", "arguments": ' + json.dumps(ARGS)
                + '}, {"name": "g", "arguments": {}}]'),
    "deepseek-v3": ("Sure. <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n"
                    "```json\n" + json.dumps(ARGS) + "\n```<｜tool▁call▁end｜>"
                    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n```json\n{}\n```"
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
}


def _split(parser, text, max_calls=None, pieces=None):
    s = ToolCallStream(parser, max_calls)
    content, calls = "", []
    for piece in (pieces or [text]):
        c, new = s.feed(piece)
        content, calls = content + c, calls + new
    c, new = s.finish()
    return content + c, [(x.name, json.loads(x.arguments)) for x in calls + new]


@pytest.mark.parametrize("name", sorted(TOOL_TEXT))
def test_tool_parsers(name):
    parser = create_tool_parser(name)
    text = TOOL_TEXT[name]
    want = ("Sure. ", [("f", ARGS), ("g", {})])
    assert _split(parser, text) == want
    rng = random.Random(1)
    for _ in range(40):
        assert _split(parser, text, pieces=list(_pieces(text, rng))) == want
    assert _split(parser, text, max_calls=1) == ("Sure. ", [("f", ARGS)])
    # no calls, or a call cut short: all content
    assert _split(parser, "just text <") == ("just text <", [])
    cut = text[:len(text) - 40]
    content, calls = _split(parser, cut)
    assert calls in ([("f", ARGS)], []) and (calls or content == cut)


@pytest.mark.parametrize("name", sorted(TOOL_TEXT))
def test_tool_grammar_accepts_the_parsed_format(name):
    tok = load_tokenizer("preset:tiny")
    backend = GrammarBackend(tokenizer_info(tok, 257, tok.eos_token_ids), max_threads=1)
    parser = create_tool_parser(name)
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}} for n in ("f", "g")]
    text = TOOL_TEXT[name].replace("Sure. ", "").replace(json.dumps(ARGS), '{"city": "x"}')
    m = backend.matcher(parser.grammar(tools, None))
    assert all(m.accept_token(t) for t in tok.encode(text)) and m.is_completed()
    # a named choice: exactly one call, of that function (the text starts with f's)
    assert not backend.matcher(parser.grammar(tools, "g")).accept_string(text)
    assert not backend.matcher(parser.grammar(tools, "f")).accept_string(text)
