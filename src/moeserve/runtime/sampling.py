"""Sampling parameters of one request, and the stop conditions that end it.

`SamplingParams` is what a user asks for (Engine API, CLI, OpenAI server); it is validated once,
here, with errors that name the field and its allowed range (RANGES, which the server's request
models check too). `StopChecker` decides, token by token, when a request is finished and why
(stop strings are matched on the detokenised text by runtime/output.py's StopMatcher).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Union

MAX_TOP_LOGPROBS = 20  # as the OpenAI API
MAX_N = 128  # choices per request of the server (a SamplingParams is one choice)
# the smallest repetition penalty: a logit divided by it stays finite below 1e32, where a
# penalty whose float32 is 0 or subnormal sends the logits of the prompt's tokens to inf
MIN_REPETITION_PENALTY = 1e-6
MAX_STOP_STRINGS = 64  # stop strings are matched per token: their count and length are bounded
MAX_STOP_CHARS = 1024
GREEDY_EPS = 1e-5  # temperatures below this sample greedily (dividing by them overflows)


class SamplingParamsError(ValueError):
    """A sampling parameter has a value we cannot honour; the message names the field."""


@dataclass(frozen=True)
class Range:
    """The values one field allows: a finite number (or an integer) in [lo, hi], with lo
    excluded where `lo_open`."""

    lo: float
    hi: float = math.inf
    lo_open: bool = False
    integer: bool = False

    def __str__(self) -> str:
        kind = "an integer" if self.integer else "a number"
        lo = f"{self.lo:g}" if isinstance(self.lo, float) else str(self.lo)
        hi = f"{self.hi:g}" if isinstance(self.hi, float) else str(self.hi)
        if self.hi == math.inf:
            return f"{kind} {'>' if self.lo_open else '>='} {lo}"
        return f"{kind} in {'(' if self.lo_open else '['}{lo}, {hi}]"

    def contains(self, v: object) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if self.integer:
            if not isinstance(v, int):
                return False
        else:  # the sampler holds it as a float: an int too large for one is out of range
            try:
                v = float(v)
            except OverflowError:
                return False
            if not math.isfinite(v):
                return False
        return (self.lo < v if self.lo_open else self.lo <= v) and v <= self.hi


# The allowed range of every numeric sampling field, as vLLM and SGLang draw them; the Engine
# API (SamplingParams) and the OpenAI server (protocol.py) both check these. top_k: -1 or 0 is
# off. seed: any signed or unsigned 64-bit integer.
RANGES: dict[str, Range] = {
    "max_new_tokens": Range(1, integer=True),
    "temperature": Range(0.0),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "top_k": Range(-1, integer=True),
    "min_p": Range(0.0, 1.0),
    "seed": Range(-(2**63), 2**64 - 1, integer=True),
    "repetition_penalty": Range(MIN_REPETITION_PENALTY, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "presence_penalty": Range(-2.0, 2.0),
    "top_logprobs": Range(0, MAX_TOP_LOGPROBS, integer=True),
    "n": Range(1, MAX_N, integer=True),
}
STOP_RULE = (f"a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings "
             f"of at most {MAX_STOP_CHARS} characters each")


def check_range(name: str, value: object) -> None:
    """Raise SamplingParamsError, naming `name` and its range, unless RANGES allows `value`."""
    if not RANGES[name].contains(value):
        _fail(name, value, str(RANGES[name]))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request (one completion: `n` is the caller's loop).

    max_new_tokens      tokens to generate at most (finish reason "length")
    temperature         0 is greedy; logits are divided by it before top-k/top-p/min-p
    top_p               keep the smallest set of most likely tokens whose mass reaches top_p
    top_k               keep the k most likely tokens; -1 (or 0) keeps all
    min_p               keep tokens whose probability is at least min_p x the largest one
    seed                same seed, same tokens, whatever else runs in the batch
    repetition_penalty  HF semantics, over prompt and output tokens (1.0: off)
    frequency_penalty   OpenAI semantics: minus penalty x count in the output so far
    presence_penalty    OpenAI semantics: minus penalty if the token is in the output so far
    stop                strings that end the output; the matched string is not returned
    stop_token_ids      token ids that end the output (the token is kept in the token ids)
    ignore_eos          keep generating past the model's EOS tokens
    logprobs            return the log-probability of each chosen token (raw logits)
    top_logprobs        also return this many most likely tokens per step (needs logprobs)
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p",
                     "repetition_penalty", "frequency_penalty", "presence_penalty",
                     "top_logprobs"):
            check_range(name, getattr(self, name))
        if self.top_k == 0:  # HF and newer vLLM spell "off" as 0; keep one spelling
            object.__setattr__(self, "top_k", -1)
        if self.seed is not None:
            check_range("seed", self.seed)
        object.__setattr__(self, "stop", stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        _bool("ignore_eos", self.ignore_eos)
        _bool("logprobs", self.logprobs)
        if self.top_logprobs and not self.logprobs:
            raise SamplingParamsError(
                f"top_logprobs={self.top_logprobs} needs logprobs=True; set logprobs=True or "
                "top_logprobs=0")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


def _fail(name: str, value: object, want: str) -> None:
    raise SamplingParamsError(f"{name}={_short(value)} is invalid: {name} must be {want}")


def _bool(name: str, v: object) -> None:
    if not isinstance(v, bool):
        _fail(name, v, "true or false")


def stop_strings(stop: Union[str, Iterable[str], None]) -> tuple[str, ...]:
    """`stop` as a tuple of strings; SamplingParamsError unless it follows STOP_RULE."""
    if stop is None:
        return ()
    try:
        items = (stop,) if isinstance(stop, str) else tuple(stop)
    except TypeError:
        items = (stop,)
    if len(items) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in items):
        _fail("stop", stop, STOP_RULE)
    return items


def _short(value: object) -> str:
    """`value` as an error quotes it: a long list or string cut, a huge integer not spelled."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, (list, tuple)) and len(value) > 4:
        return f"<a list of {len(value)} items>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _token_ids(ids: Union[Iterable[int], None]) -> tuple[int, ...]:
    try:
        items = tuple(ids) if ids is not None else ()
    except TypeError:
        _fail("stop_token_ids", ids, "a list of non-negative integer token ids")
    for t in items:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            _fail("stop_token_ids", ids, "a list of non-negative integer token ids")
    return items


# ---------------------------------------------------------------------------------------------
# stop conditions


@dataclass(frozen=True)
class Finish:
    """Why a request ended. reason is "stop" or "length" (OpenAI's finish_reason); matched is the
    stop token id or stop string that ended it (None for EOS and for length), as vLLM's
    stop_reason."""

    reason: str
    matched: Union[int, str, None] = None


class StopChecker:
    """The token stop conditions of one request: call `check_token` after each sampled token.
    `max_output` is the request's length limit (runtime/limits.output_limit; max_new_tokens
    when not given)."""

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int] = (),
                 max_output: Optional[int] = None) -> None:
        self.params = params
        self.max_output = params.max_new_tokens if max_output is None else max_output
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)

    def check_token(self, token_id: int, num_output_tokens: int) -> Optional[Finish]:
        """After `token_id` was appended, the output holds `num_output_tokens` tokens. The token
        that ends a request stays in its token ids (as HF generate keeps EOS)."""
        if token_id in self.eos_token_ids:
            return Finish("stop")
        if token_id in self.stop_token_ids:
            return Finish("stop", token_id)
        if num_output_tokens >= self.max_output:
            return Finish("length")
        return None
