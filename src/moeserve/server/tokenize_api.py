"""vLLM's /tokenize and /detokenize: a prompt's or a chat's token ids as the completions and
chat endpoints would make them (counting tokens before a request), and ids back to text.

    POST /tokenize    {"prompt": "...", "add_special_tokens": true}
                   or {"messages": [...], "tools": [...], "add_generation_prompt": true,
                       "chat_template_kwargs": {...}}
                   -> {"count": N, "max_model_len": context length, "tokens": [ids]}
    POST /detokenize  {"tokens": [ids]} -> {"prompt": "..."}

`model` is optional; when given it must be a served name. A prompt longer than the context
is counted all the same (max_model_len says what a request may hold).
"""

from __future__ import annotations

from typing import Any, Sequence

from moeserve.server.chat_output import template_kwargs, template_message
from moeserve.server.errors import bad_request, parse_body
from moeserve.server.protocol import DetokenizeRequest, TokenizeRequest
from moeserve.server.text import TextCodec


class TokenizeHandlers:
    def __init__(self, codec: TextCodec, served_names: Sequence[str],
                 context_length: int) -> None:
        self.codec, self.served_names, self.context_length = codec, served_names, context_length

    def tokenize(self, body: bytes) -> dict[str, Any]:
        req: TokenizeRequest = parse_body(TokenizeRequest, body, self.served_names)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give a prompt or messages (one of them)", "prompt")
        if req.prompt is not None:
            chat_only = [f for f in ("tools", "chat_template_kwargs")
                         if getattr(req, f) is not None]
            if chat_only:
                raise bad_request(f"{chat_only[0]} goes with messages, not a prompt",
                                  chat_only[0])
            ids = self.codec.encode(req.prompt, special=req.add_special_tokens)
        else:
            kwargs = template_kwargs(req.chat_template_kwargs)
            kwargs.setdefault("add_generation_prompt", req.add_generation_prompt)
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            _, ids = self.codec.encode_chat([template_message(m) for m in req.messages or ()],
                                            tools, kwargs)
        return {"count": len(ids), "max_model_len": self.context_length, "tokens": ids}

    def detokenize(self, body: bytes) -> dict[str, Any]:
        req: DetokenizeRequest = parse_body(DetokenizeRequest, body, self.served_names)
        bad = [t for t in req.tokens if not 0 <= t < self.codec.vocab_size]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary "
                              f"[0, {self.codec.vocab_size})", "tokens")
        return {"prompt": self.codec.decode(req.tokens)}
