"""The engine side of a request: where its outputs go, and its text.

The workers report token ids; here they become text (incremental detokenization), stop strings
are matched on that text (a match ends the request here and aborts it in the workers), and the
text of an unfinished request is held back while it might still begin a stop string.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any

from moeserve.runtime.request import TokenOutput
from moeserve.runtime.sampling import SamplingParams, StopChecker


@dataclass
class RequestState:
    """Engine-side state of a request: where its outputs go, and its detokenizer. Stop strings
    are matched here, on the text; a match ends the request and aborts it in the workers."""

    rid: str
    params: SamplingParams
    dp_rank: int
    detok: Any  # IncrementalDetokenizer, or None without a tokenizer
    outputs: "queue.Queue[TokenOutput]" = field(default_factory=queue.Queue)
    text: str = ""
    sent_chars: int = 0
    submitted: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.stop = StopChecker(self.params)  # text checks only: EOS is the workers' business

    def translate(self, out: TokenOutput) -> tuple[TokenOutput, bool]:
        """Add text to the workers' output; returns it and whether a stop string ended it."""
        if self.detok is None:
            return out, False
        stop = self.stop
        kept: list[int] = []
        hit = None
        for t in out.token_ids:
            piece = self.detok.add(t)
            self.text += piece
            kept.append(t)
            hit = stop.check_text(self.text, len(piece))
            if hit is not None:
                break
        finish = out.finish
        if hit is not None:
            finish, self.text = hit
        elif finish is not None and finish.reason in ("stop", "length"):
            self.text += self.detok.flush()
        end = len(self.text) if finish is not None else stop.streamable_len(self.text)
        end = max(end, self.sent_chars)
        new = TokenOutput(out.rid, kept, finish, self.text[self.sent_chars:end],
                          out.logprobs[:len(kept)], out.prompt_tokens, out.cached_tokens,
                          out.error)
        self.sent_chars = end
        return new, hit is not None and out.finish is None
