"""The engine side of a request: where its outputs go, and its text.

The workers report token ids; here they become text (incremental detokenization), stop strings
are matched on that text (a match ends the request here and aborts it in the workers), and the
text of an unfinished request is held back while it might still begin a stop string.

What fails here belongs to one request (its detokenizer, its stops): that request ends with an
error and the engine's output thread goes on serving the others.
"""

from __future__ import annotations

import logging
import queue
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from moeserve.runtime.request import TokenOutput
from moeserve.runtime.sampling import Finish, SamplingParams

log = logging.getLogger("moeserve.engine")


class StopMatcher:
    """Finds stop strings in a text fed piece by piece, in time linear in the new text.

    One KMP automaton per stop string: its state is the length of the longest prefix of the stop
    that ends the text so far, so the text itself is never searched again, however long it
    grows; a piece costs O(len(piece) x number of stops), amortized. The largest state is
    how much of the text's end may still become a stop, and so must be held back from a stream.
    A stop that ends first in the text wins; of two that end on the same character, the longer.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.fail = [_failure(s) for s in self.stops]
        self.state = [0] * len(self.stops)
        self.chars = frozenset("".join(self.stops))
        self.seen = 0  # characters fed

    def feed(self, piece: str) -> Optional[tuple[int, str]]:
        """Feed the next `piece` of the text; (where the match starts in the whole text, the
        stop) when a stop string now ends in it, else None."""
        if not self.stops:
            self.seen += len(piece)
            return None
        stops, fail, state, chars = self.stops, self.fail, self.state, self.chars
        for k, c in enumerate(piece):
            if c not in chars:  # no stop continues through this character
                if any(state):
                    state[:] = [0] * len(state)
                continue
            hit: Optional[str] = None
            for j, s in enumerate(stops):
                q = state[j]
                while q and s[q] != c:
                    q = fail[j][q - 1]
                if s[q] == c:
                    q += 1
                if q == len(s):
                    if hit is None or len(s) > len(hit):
                        hit = s
                    q = fail[j][q - 1]
                state[j] = q
            if hit is not None:
                end = self.seen + k + 1
                self.seen += len(piece)
                return end - len(hit), hit
        self.seen += len(piece)
        return None

    @property
    def held(self) -> int:
        """Characters at the end of the text that are the start of some stop string."""
        return max(self.state, default=0)


def _failure(s: str) -> list[int]:
    """KMP's failure function: f[i] is the length of the longest proper prefix of s[:i + 1]
    that is also its suffix."""
    f = [0] * len(s)
    q = 0
    for i in range(1, len(s)):
        while q and s[i] != s[q]:
            q = f[q - 1]
        if s[i] == s[q]:
            q += 1
        f[i] = q
    return f


@dataclass
class RequestState:
    """Engine-side state of a request: where its outputs go, and its detokenizer. Stop strings
    are matched here, on the text; a match ends the request and aborts it in the workers.

    Only the text not yet sent is kept (`unsent`): a stop can only complete in the held-back
    tail and the new text, never in what a client has already seen."""

    rid: str
    params: SamplingParams
    dp_rank: int
    detok: Any  # IncrementalDetokenizer, or None without a tokenizer
    # where its outputs go: the caller's callback (called on the engine's output thread), else
    # this queue (a SimpleQueue: put and get without a Python-level lock and condition)
    on_output: Optional[Callable[[TokenOutput], None]] = None
    outputs: "queue.SimpleQueue[TokenOutput]" = field(default_factory=queue.SimpleQueue)
    unsent: str = ""
    sent_chars: int = 0
    tokens: int = 0  # output tokens translated
    submitted: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.stop = StopMatcher(self.params.stop)  # text only: EOS is the workers' business

    def deliver(self, out: TokenOutput) -> None:
        if self.on_output is None:
            self.outputs.put(out)
        else:
            self.on_output(out)

    def translate(self, out: TokenOutput) -> tuple[TokenOutput, bool]:
        """Add text to the workers' output; returns it and whether it ended here (a stop string
        matched, or making its output failed), so that the workers must abort it. A failure
        becomes the request's error: its first line for a client, then the traceback."""
        try:
            return self._translate(out)
        except Exception as exc:
            first = (str(exc).strip().split("\n", 1)[0] or "no message")[:200]
            log.debug("request %s: its output failed", out.rid, exc_info=True)
            error = (f"the request's output failed ({type(exc).__name__}: {first})\n"
                     f"{traceback.format_exc()}")
            return TokenOutput(out.rid, [], None, prompt_tokens=out.prompt_tokens,
                               cached_tokens=out.cached_tokens, error=error), True

    def _translate(self, out: TokenOutput) -> tuple[TokenOutput, bool]:
        if out.error is not None:
            return out, False
        if self.detok is None:
            return out, False
        kept: list[int] = []
        hit = None
        for t in out.token_ids:
            piece = self.detok.add(t)
            kept.append(t)
            self.tokens += 1
            hit = self.stop.feed(piece)
            if hit is not None and self.tokens < self.params.min_tokens:
                hit = None  # (as vLLM: stop strings count from the min_tokens-th token on)
            if hit is not None:  # it starts in the held-back tail or in this piece
                self.unsent = (self.unsent + piece)[:max(0, hit[0] - self.sent_chars)]
                break
            self.unsent += piece
        finish = out.finish
        if hit is not None:
            finish = Finish("stop", hit[1])
        elif finish is not None and finish.reason in ("stop", "length"):
            self.unsent += self.detok.flush()
        end = len(self.unsent) if finish is not None else len(self.unsent) - self.stop.held
        end = max(end, 0)
        text, self.unsent = self.unsent[:end], self.unsent[end:]
        self.sent_chars += end
        new = TokenOutput(out.rid, kept, finish, text, out.logprobs[:len(kept)],
                          out.prompt_tokens, out.cached_tokens, out.error, out.prompt_logprobs)
        return new, hit is not None and out.finish is None
