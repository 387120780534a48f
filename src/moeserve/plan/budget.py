"""The token budget: max tokens per forward, per DP rank, for every forward mode.

This is the one definition the scheduler admits by and the capacity plan sizes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from moeserve.config import EngineConfig
from moeserve.config.spec import ModelSpec
from moeserve.parallel.layout import ParallelLayout
from moeserve.plan.capture import decode_batch_sizes, prefill_token_sizes

MODES = ("extend", "decode", "mixed", "decode_graph", "prefill_graph", "warmup", "idle")


@dataclass(frozen=True)
class TokenBudget:
    """Max tokens of one forward on one DP rank, by mode (None: the mode never runs).

    extend         a prefill forward: prompt chunks of one or more requests
    decode         running requests x tokens verified per request per step
    mixed          a prefill chunk with decode tokens inside it (--enable-mixed-chunk)
    decode_graph   the largest captured decode bucket, in tokens (what padding can reach)
    prefill_graph  the largest captured prefill bucket
    warmup         the runner's startup forward (a full extend, to measure peak memory)
    idle           a DP rank with no work still runs a zero-token forward
    """

    extend: int
    decode: int
    mixed: Optional[int]
    decode_graph: int
    prefill_graph: int
    warmup: int
    idle: int
    # the admission limits behind the numbers above
    max_running_requests: int  # per DP rank
    tokens_per_decode_request: int
    chunk_tokens: Optional[int]  # per DP rank; None when chunked prefill is off
    context_length: int
    decode_batch_sizes: tuple[int, ...]
    prefill_token_sizes: tuple[int, ...]

    def by_mode(self) -> dict[str, Optional[int]]:
        return {m: getattr(self, m) for m in MODES}

    @property
    def max_tokens(self) -> int:
        """T_max: the largest forward of any mode."""
        return max(v for v in self.by_mode().values() if v is not None)


def context_length(cfg: EngineConfig, spec: ModelSpec) -> int:
    return cfg.context_length or spec.max_position_embeddings


def token_budget(cfg: EngineConfig, spec: ModelSpec,
                 layout: Optional[ParallelLayout] = None) -> TokenBudget:
    """The max tokens per forward per DP rank for each forward mode.

    Contract with the scheduler (it calls this function and no other for its limits):
      * a prefill forward schedules at most `extend` new tokens on a DP rank; a prompt longer
        than `chunk_tokens` is cut into chunks of at most that size; with chunked prefill off,
        one prompt of up to `context_length` tokens may run alone;
      * at most `max_running_requests` requests decode at once on a DP rank, each contributing
        `tokens_per_decode_request` tokens to a decode forward, so a decode forward has at most
        `decode` tokens;
      * a mixed forward (only with --enable-mixed-chunk) has at most `mixed` tokens in all:
        the decode tokens come out of the chunk's budget;
      * a forward padded to a captured bucket has at most `decode_graph` / `prefill_graph`
        tokens, because buckets never exceed the bounds above;
      * a DP rank with nothing to do runs an `idle` (zero-token) forward with the others.
    Every bound is reached by some admissible forward: there is no slack to hide a bug in.
    """
    layout = layout or ParallelLayout.from_config(cfg)
    ctx = context_length(cfg, spec)
    chunk = cfg.chunk_tokens_per_dp_rank
    if chunk is None:
        extend = max(cfg.max_prefill_tokens, ctx)
    else:
        extend = min(chunk, cfg.max_prefill_tokens)
    running = max(1, cfg.max_running_requests_total // cfg.attn_dp_size)
    tpr = cfg.tokens_per_decode_request
    decode_bs = decode_batch_sizes(cfg, layout, running)
    prefill_sizes = prefill_token_sizes(cfg, layout, extend)
    return TokenBudget(
        extend=extend, decode=running * tpr, mixed=extend if cfg.enable_mixed_chunk else None,
        decode_graph=max(decode_bs, default=0) * tpr, prefill_graph=max(prefill_sizes, default=0),
        warmup=extend, idle=0, max_running_requests=running, tokens_per_decode_request=tpr,
        chunk_tokens=None if chunk is None else min(chunk, cfg.max_prefill_tokens),
        context_length=ctx, decode_batch_sizes=tuple(decode_bs),
        prefill_token_sizes=tuple(prefill_sizes))


def layer_scatters(layout: ParallelLayout, *, moe: bool) -> bool:
    """Whether the block of a MoE (moe=True) or dense layer works on rows scattered across
    the attn_tp ranks (layers/communicator.py says why; the plan sizes the gathers by it)."""
    if layout.attn_tp == 1:
        return False
    if moe:
        return layout.a2a or layout.dp > 1
    return layout.dense_tp == 1 or layout.dp > 1


def moe_tokens_per_rank(tokens: int, layout: ParallelLayout) -> int:
    """M: tokens of one DP rank's forward that reach the MoE layer on one rank. Under SP the
    attn_tp ranks split the forward, so it is the post-scatter count (SGLang #25685)."""
    return math.ceil(tokens / layout.attn_tp) if layout.sp else tokens


def runtime_max_per_rank(tokens_per_dp_rank: list[int], layout: ParallelLayout) -> int:
    """The step's runtime max per rank: the max over the gathered per-DP-rank counts, after
    the SP scatter. Every rank computes it from the same gathered list, so all agree."""
    return max((moe_tokens_per_rank(t, layout) for t in tokens_per_dp_rank), default=0)
