"""Log-probabilities in the two shapes the OpenAI API uses.

The engine gives, per generated token, {"token_id", "logprob", "top": [(id, logprob), ...]}
(top sorted, most likely first), and per prompt token after the first the same with its
"rank". Completions want parallel lists (tokens, token_logprobs, top_logprobs as {token:
logprob} holding the sampled token too, text_offset); an entry whose logprob is None (the first
prompt token of an echo) has null logprobs. Chat wants a list of {token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}. vLLM's prompt_logprobs are, per prompt token, null
for the first, then {token id: {logprob, rank, decoded_token}} for it and the top tokens.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from moeserve.server.text import TextCodec

FLOOR = -9999.0  # JSON has no -inf; a token the model rules out gets this (as vLLM)


def _lp(x: float) -> float:
    return FLOOR if math.isinf(x) or math.isnan(x) else max(float(x), FLOOR)


def completion_logprobs(codec: TextCodec, entries: list[dict[str, Any]],
                        offset: int) -> tuple[dict[str, Any], int]:
    """The completions `logprobs` object for `entries`, whose text starts at `offset` of the
    choice's text; also returns the offset after them."""
    tokens: list[str] = []
    token_lps: list[Optional[float]] = []
    tops: list[Optional[dict[str, float]]] = []
    offsets: list[int] = []
    for e in entries:
        text = codec.token_text(e["token_id"])
        tokens.append(text)
        if e["logprob"] is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_lp(e["logprob"]))
            top: dict[str, float] = {}
            for tid, lp in e.get("top") or ():
                top.setdefault(codec.token_text(tid), _lp(lp))  # two ids may print alike
            top.setdefault(text, token_lps[-1])  # the sampled token, where not among them
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


def echo_entries(prompt_ids: Sequence[int], scored: list[dict[str, Any]],
                 top: int) -> list[dict[str, Any]]:
    """The prompt's tokens as completion logprob entries (echo): the first with a null
    logprob, each other with its score and `top` most likely tokens."""
    first = [{"token_id": prompt_ids[0], "logprob": None}] if prompt_ids else []
    return first + [{"token_id": e["token_id"], "logprob": e["logprob"], "top": e["top"][:top]}
                    for e in scored]


def vllm_prompt_logprobs(codec: TextCodec, prompt_ids: Sequence[int],
                         scored: list[dict[str, Any]], top: int
                         ) -> list[Optional[dict[str, dict[str, Any]]]]:
    """vLLM's prompt_logprobs: null for the first prompt token, then for each other one
    {token id: {logprob, rank, decoded_token}}, the prompt token first, then the `top` most
    likely tokens."""
    out: list[Optional[dict[str, dict[str, Any]]]] = [None] if prompt_ids else []
    for e in scored:
        tid = e["token_id"]
        d = {str(tid): {"logprob": _lp(e["logprob"]), "rank": e["rank"],
                        "decoded_token": codec.token_text(tid)}}
        for rank, (t, lp) in enumerate(e["top"][:top], 1):
            d.setdefault(str(t), {"logprob": _lp(lp), "rank": rank,
                                  "decoded_token": codec.token_text(t)})
        out.append(d)
    return out
