"""Sampling parameters of one request, and the stop conditions that end it.

`SamplingParams` is what a user asks for (Engine API, CLI, OpenAI server); it is validated once,
here, with errors that name the field and its allowed range (RANGES, which the server's request
models check too). `StopChecker` decides, token by token, when a request is finished and why
(stop strings are matched on the detokenised text by runtime/output.py's StopMatcher).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Union

MAX_TOP_LOGPROBS = 20  # as the OpenAI API
MAX_N = 128  # choices per request of the server (a SamplingParams is one choice)
# the smallest repetition penalty: a logit divided by it stays finite below 1e32, where a
# penalty whose float32 is 0 or subnormal sends the logits of the prompt's tokens to inf
MIN_REPETITION_PENALTY = 1e-6
MAX_STOP_STRINGS = 64  # stop strings are matched per token: their count and length are bounded
MAX_STOP_CHARS = 1024
GREEDY_EPS = 1e-5  # temperatures below this sample greedily (dividing by them overflows)
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias (each is a scatter on the device)


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
    "prompt_logprobs": Range(0, MAX_TOP_LOGPROBS, integer=True),
    "n": Range(1, MAX_N, integer=True),
    "min_tokens": Range(0, integer=True),
    "logit_bias": Range(-100.0, 100.0),  # each value (as OpenAI)
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
    logprobs            return the log-probability of each chosen token: log_softmax of the
                        model's raw logits, before logit_bias, min_tokens, penalties and
                        temperature (as OpenAI and vLLM report them)
    top_logprobs        also return this many most likely tokens per step (needs logprobs)
    min_tokens          EOS and stop_token_ids cannot be sampled before this many output
                        tokens, and no stop string ends the output within them
    logit_bias          {token id: bias in [-100, 100]} added to the logits before sampling
                        (-100 bans a token in effect, 100 all but forces it)
    prompt_logprobs     also return, for every prompt token after the first, its log-prob
                        given the tokens before it, its rank, and this many most likely tokens
                        (None: off); the prompt is then computed in full (no prefix cache)
    skip_special_tokens leave special tokens out of the text (the token ids keep them)
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
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # a Mapping is accepted too
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p",
                     "repetition_penalty", "frequency_penalty", "presence_penalty",
                     "top_logprobs", "min_tokens"):
            check_range(name, getattr(self, name))
        if self.min_tokens > self.max_new_tokens:
            raise SamplingParamsError(
                f"min_tokens={self.min_tokens} is invalid: min_tokens must be at most "
                f"max_new_tokens={self.max_new_tokens}")
        if self.prompt_logprobs is not None:
            check_range("prompt_logprobs", self.prompt_logprobs)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        _bool("skip_special_tokens", self.skip_special_tokens)
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


def _logit_bias(bias: Union[Mapping[int, float], Iterable[tuple[int, float]], None]
                ) -> tuple[tuple[int, float], ...]:
    """`bias` as sorted (token id, bias) pairs, one per token id."""
    want = (f"at most {MAX_LOGIT_BIAS} pairs of a non-negative token id and a bias "
            f"{RANGES['logit_bias']}")
    try:
        items = list(bias.items() if isinstance(bias, Mapping) else (bias or ()))
        pairs = {int(t) if not isinstance(t, bool) and isinstance(t, int) else -1: v
                 for t, v in items}
    except (TypeError, ValueError):
        _fail("logit_bias", bias, want)
    if (len(pairs) != len(items) or len(pairs) > MAX_LOGIT_BIAS or any(t < 0 for t in pairs)
            or not all(RANGES["logit_bias"].contains(v) for v in pairs.values())):
        _fail("logit_bias", bias, want)
    return tuple(sorted((t, float(v)) for t, v in pairs.items()))


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request seeded with `seed`: the seed itself for the
    first, for the others a 64-bit mix of (seed, choice) (SplitMix64), so that each choice is
    its own stream, and the choices of seed s never replay those of another seed."""
    if choice == 0:
        return seed
    z = (seed + choice * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


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
        self._ending = self.eos_token_ids | self.stop_token_ids

    def banned(self, num_output_tokens: int) -> frozenset[int]:
        """The token ids the sampler must not pick after `num_output_tokens` output tokens:
        those that would end the output, while min_tokens is not reached."""
        return self._ending if num_output_tokens < self.params.min_tokens else frozenset()

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
