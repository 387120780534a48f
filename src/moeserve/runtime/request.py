"""One request's state inside a scheduler, and what the engine hands back for it."""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional

from moeserve.runtime.grammar import GrammarSpec
from moeserve.runtime.limits import output_limit
from moeserve.runtime.sampling import Finish, SamplingParams, StopChecker


class ReqState(enum.Enum):
    WAITING = "waiting"  # queued; no KV (or only a cached prefix after a retract)
    PREFILLING = "prefilling"  # part of the prompt is in the KV cache (chunked prefill)
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestInput:
    """What a client submits; `rid` is unique per engine, `dp_rank` is where it runs; with
    `stream` the workers report every step's tokens, else only the finished request; with
    `grammar` every token it samples follows that grammar (runtime/grammar.py)."""

    rid: str
    input_ids: tuple[int, ...]
    params: SamplingParams
    dp_rank: int = 0
    stream: bool = False
    grammar: Optional[GrammarSpec] = None


@dataclass
class TokenOutput:
    """One step's news about one request, sent from the workers to the engine (token ids only:
    the engine detokenizes)."""

    rid: str
    token_ids: list[int]  # new tokens this step
    finish: Optional[Finish] = None
    text: str = ""  # new text; filled by the engine's detokenizer
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: Optional[str] = None
    # prompt logprobs (SamplingParams.prompt_logprobs) of prompt tokens 1.. as they are computed:
    # {"token_id", "logprob", "rank", "top": [(id, logprob), ...]} each
    prompt_logprobs: list[dict[str, Any]] = field(default_factory=list)
    # the error is the request's own (its prompt, or a grammar that no text satisfies): the
    # server answers it with a 400, not a 500
    invalid_request: bool = False

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # the fields as a tuple: the ranks pickle every output of a step onto the engine's
        # queue and the engine's one output thread unpickles them, where the default (a dict
        # of attributes each) takes it 1.6x the time to load
        return TokenOutput, (self.rid, self.token_ids, self.finish, self.text, self.logprobs,
                             self.prompt_tokens, self.cached_tokens, self.error,
                             self.prompt_logprobs, self.invalid_request)


class Req:
    """A request as a scheduler tracks it.

    KV bookkeeping: positions [0, kv_len) of `all_ids` have their K/V in the cache, recorded in
    row `row` of the request table. Of those, [0, cached_len) belong to the prefix cache (the
    path ending at `prefix_node` is locked for us); [cached_len, kv_len) are ours to free.
    """

    def __init__(self, inp: RequestInput, eos_token_ids: frozenset[int], arrival: int,
                 context_length: int) -> None:
        self.rid = inp.rid
        self.prompt_ids = list(inp.input_ids)
        self.params = inp.params
        self.stream = inp.stream
        self.arrival = arrival  # order of arrival at this scheduler
        self.output_ids: list[int] = []
        self.stop = StopChecker(inp.params, eos_token_ids, output_limit(
            len(self.prompt_ids), inp.params.max_new_tokens, context_length))
        self.state = ReqState.WAITING
        self.row: Optional[int] = None
        self.kv_len = 0
        self.cached_len = 0
        # the slots of positions [0, kv_len) (a host copy of its request-table row, so that
        # giving them back never reads the device); [0, recorded) of them are in the
        # device's row already (KVManager.record writes the rest with the step's slots)
        self.slots = array("q")
        self.recorded = 0
        self.prefix_node: Any = None
        self.finish: Optional[Finish] = None
        self.prompt_cached_tokens = 0  # prompt tokens served from the prefix cache, first run
        self.first_run = True
        self.created = time.monotonic()
        self.sent_tokens = 0
        self.logprobs: list[dict[str, Any]] = []
        self.sent_logprobs = 0
        # prompt logprobs: those of prompt tokens 1..prompt_lp_scheduled are computed or in
        # flight (a step's logits at position p give token p + 1's)
        self.prompt_logprobs: list[dict[str, Any]] = []
        self.sent_prompt_logprobs = 0
        self.prompt_lp_scheduled = 0
        # overlap schedule: tokens sampled on the device but not yet read back (0 or 1 when a
        # step is scheduled), the newest of them at row `future_row` of the step in flight
        self.unresolved = 0
        self.future_row = -1
        # structured outputs: the xgrammar GrammarMatcher that has accepted output_ids (set by
        # the scheduler when the request arrives with a grammar)
        self.matcher: Any = None

    @property
    def all_ids(self) -> list[int]:
        """Prompt and output so far. A step computes K/V for all_ids[kv_len:kv_len + n] and
        samples when that reaches the end: a decode step is the case n = 1, a (re)prefill or a
        chunk of it the case n > 1."""
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (a decode step asks for one token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:stop - n]
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[:stop - n]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt position's logits are still to compute for its prompt logprobs
        (such a request takes no cached prefix: every position must run)."""
        return (self.params.prompt_logprobs is not None
                and self.prompt_lp_scheduled < len(self.prompt_ids) - 1)

    @property
    def pending(self) -> int:
        """Tokens without K/V yet."""
        return self.seq_len - self.kv_len

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_output(self) -> int:
        """Output tokens, those still on the device included."""
        return len(self.output_ids) + self.unresolved

    def __repr__(self) -> str:
        return (f"Req({self.rid}, {self.state.value}, prompt={len(self.prompt_ids)}, "
                f"out={len(self.output_ids)}, kv={self.kv_len}, cached={self.cached_len})")
