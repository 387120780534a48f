"""Log-probabilities in the two shapes the OpenAI API uses.

The engine gives, per generated token, {"token_id", "logprob", "top": [(id, logprob), ...]}
(top sorted, most likely first). Completions want parallel lists (tokens, token_logprobs,
top_logprobs as {token: logprob}, text_offset); chat wants a list of {token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}.
"""

from __future__ import annotations

import math
from typing import Any

from moeserve.server.text import TextCodec

FLOOR = -9999.0  # JSON has no -inf; a token the model rules out gets this (as vLLM)


def _lp(x: float) -> float:
    return FLOOR if math.isinf(x) or math.isnan(x) else max(float(x), FLOOR)


def completion_logprobs(codec: TextCodec, entries: list[dict[str, Any]],
                        offset: int) -> tuple[dict[str, Any], int]:
    """The completions `logprobs` object for `entries`, whose text starts at `offset` of the
    choice's text; also returns the offset after them."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for e in entries:
        text = codec.token_text(e["token_id"])
        tokens.append(text)
        token_lps.append(_lp(e["logprob"]))
        top: dict[str, float] = {}
        for tid, lp in e.get("top") or ():
            top.setdefault(codec.token_text(tid), _lp(lp))  # two ids may print alike
        tops.append(top)
        offsets.append(offset)
        if not text.startswith("bytes:"):  # part of a character: no text of its own
            offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def chat_logprobs(codec: TextCodec, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for e in entries:
        top = [{"token": codec.token_text(tid), "logprob": _lp(lp),
                "bytes": codec.token_bytes(tid)} for tid, lp in e.get("top") or ()]
        out.append({"token": codec.token_text(e["token_id"]), "logprob": _lp(e["logprob"]),
                    "bytes": codec.token_bytes(e["token_id"]), "top_logprobs": top})
    return out
