"""Text on the server's side of the engine: prompts to ids, chat templates, and the text and
bytes of single tokens (for logprobs).

The chat template is --chat-template's when given, else the checkpoint's; a model whose tokenizer
has none (the presets' byte-level stand-in, some base checkpoints) gets DEFAULT_CHAT_TEMPLATE, a
plain role-tagged transcript.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Optional, Sequence

from moeserve.runtime.limits import PromptError
from moeserve.runtime.tokenizer import Tokenizer, TokenizerError, compile_chat_template
from moeserve.server.errors import bad_request

DEFAULT_CHAT_TEMPLATE = (  # newlines as expressions: trim_blocks eats those after a tag
    "{% for m in messages %}"
    "<|{{ m.role }}|>{% if m.name %} {{ m.name }}{% endif %}{{ '\\n' }}"
    "{{ m.content }}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}")
_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece byte-fallback tokens


@functools.lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TextCodec:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 chat_template: Optional[str] = None) -> None:
        self.tok = tokenizer
        self.vocab_size = vocab_size  # the model's: ids the engine accepts
        source = chat_template or tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
        self.template: Any = compile_chat_template(source)
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)
        self.token_bytes = functools.lru_cache(maxsize=65536)(self._token_bytes)

    def encode(self, text: str, special: bool = True, limit: Optional[int] = None
               ) -> list[int]:
        """`special`: add the tokenizer's BOS etc. (a plain prompt); a rendered chat template
        writes its own special tokens. `limit` (the context length): a text that surely has
        that many tokens raises PromptError before it is tokenized."""
        if limit is not None:
            least = self.tok.min_tokens(text)
            if least >= limit:
                raise PromptError(f"the prompt has at least {least} tokens and the context "
                                  f"length is {limit}: it leaves no room for output; shorten "
                                  "the prompt", too_long=True)
        return self.tok.encode(text, add_special_tokens=special)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids)

    def render_chat(self, messages: list[dict[str, Any]],
                    tools: Optional[list[dict[str, Any]]] = None,
                    kwargs: Optional[dict[str, Any]] = None) -> str:
        """`kwargs` (chat_template_kwargs) reach the template as variables, over the
        defaults (add_generation_prompt, the special tokens)."""
        from jinja2.exceptions import TemplateError

        variables = {"add_generation_prompt": True, **self.tok.special_tokens, **(kwargs or {})}
        try:
            return self.template.render(messages=messages, tools=tools, **variables)
        except (TemplateError, TokenizerError) as exc:
            raise bad_request(f"the chat template refused the messages: {exc}",
                              "messages") from None

    def encode_chat(self, messages: list[dict[str, Any]],
                    tools: Optional[list[dict[str, Any]]] = None,
                    kwargs: Optional[dict[str, Any]] = None, limit: Optional[int] = None
                    ) -> tuple[str, list[int]]:
        text = self.render_chat(messages, tools, kwargs)
        return text, self.encode(text, special=False, limit=limit)

    # --- single tokens ------------------------------------------------------------------------
    def _raw_bytes(self, token_id: int) -> Optional[list[int]]:
        """The bytes a token stands for, when its vocabulary entry says so exactly."""
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return None
        m = _HEX_BYTE.match(piece)
        if m:
            return [int(m.group(1), 16)]
        table = _byte_level_chars()
        if token_id not in self.tok.special_token_ids and all(c in table for c in piece):
            return [table[c] for c in piece]
        return None

    def _token_bytes(self, token_id: int) -> list[int]:
        text = self.tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            raw = self._raw_bytes(token_id)
            if raw is not None:
                return raw
        return list(text.encode("utf-8"))

    def _token_text(self, token_id: int) -> str:
        """The token as text; a token that is part of a character's bytes is written as
        OpenAI writes it, `bytes:\\xe2\\x80`."""
        text = self.tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text
        raw = self._raw_bytes(token_id)
        if raw is None:
            return text
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
