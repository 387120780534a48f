"""Batched sampling on the device, for a batch whose rows each have their own SamplingParams.

Legend: B rows (requests) of the step, V vocabulary, N top logprobs per row, S rows that sample.

One step, in order (as vLLM):
  1. logprobs (when asked) from log_softmax of the raw logits, before anything below: the
     model's own distribution, whatever the request's bias, penalties or temperature;
  2. logit_bias added, and the tokens a row may not pick yet (min_tokens: EOS and stop token
     ids) set to -inf, in one sparse scatter over (row, token) pairs;
  3. penalties: repetition (HF: over prompt and output tokens), then frequency and presence
     (OpenAI: over output tokens);
  4. each row's grammar bitmask (structured outputs): a token it forbids gets -inf;
     then greedy rows take the argmax;
  5. sampling rows: divide by temperature, softmax, sort each row once; top-k and min-p keep a
     prefix of the sorted row, top-p keeps a prefix of the renormalised rest; the token is found
     by inverse CDF over that prefix with ONE uniform number per row, so it is inside the allowed
     set by construction.

No input makes a step fail, and every token is in [0, V): a greedy row's argmax is defined for
any row (torch counts NaN as the largest); a sampling row's scaled logits are made finite first
(NaN and -inf the lowest float, +inf the highest: a row with +inf samples among its +inf tokens,
one with no number at all samples uniformly), so its most likely token always survives the
filters; a row that keeps nothing would take its most likely token. Logprobs are made finite
(-inf and NaN the lowest float) so that they serialise. All of it stays on the device.

The uniform of a row with a seed is a counter-based hash of (seed, output step): the token then
depends on the request alone, not on the batch it runs in, the device, or a retract and
recompute. Rows without a seed draw their uniform from the sampler's own generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from typing import Collection, Optional, Sequence

import numpy as np
import torch

from moeserve.runtime.grammar import apply_bitmask
from moeserve.runtime.sampling import SamplingParams

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow (split c in halves)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection of [0, 2**32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seeded_uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor,
                   step: torch.Tensor) -> torch.Tensor:
    """A float32 uniform in [0, 1) per row, a pure function of (seed, step); int64 inputs hold the
    low and high 32 bits of the seed and the output step."""
    h = _fmix32(seed_lo ^ 0x9E3779B9)
    h = _fmix32(h ^ seed_hi)
    h = _fmix32(h ^ _fmix32(step & _M32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass(frozen=True)
class SamplingBatch:
    """The per-row parameters of one step as device tensors, built once per step by `build`
    (the `_S` ones are views of two packed tensors: one copy per dtype)."""

    sample_rows_S: Optional[torch.Tensor]  # int64 rows that sample; None when all are greedy
    temperature_S: torch.Tensor  # float32
    top_k_S: torch.Tensor  # int64, V where off
    top_p_S: torch.Tensor  # float32
    min_p_S: torch.Tensor  # float32
    seeded_S: torch.Tensor  # bool
    seed_lo_S: torch.Tensor  # int64, low 32 bits of the seed
    seed_hi_S: torch.Tensor  # int64, high 32 bits
    step_S: torch.Tensor  # int64, output tokens so far
    # penalties: None when no row of the batch has any
    repetition_B: Optional[torch.Tensor]  # float32
    frequency_B: Optional[torch.Tensor]
    presence_B: Optional[torch.Tensor]
    output_counts_BV: Optional[torch.Tensor]  # float32 counts of each token in the output
    seen_BV: Optional[torch.Tensor]  # bool: in prompt or output (repetition penalty)
    # logit_bias and banned tokens: (row, token) pairs and what each adds (-inf: banned);
    # None when no row has any
    adjust_at_2E: Optional[torch.Tensor]  # int64
    adjust_by_E: Optional[torch.Tensor]  # float32
    # logprobs: whether any row asks, and the largest top_logprobs of the batch
    want_logprobs: bool
    max_top_logprobs: int
    # structured outputs: int32 [B, ceil(V / 32)], a set bit allows its token (runtime/grammar)
    token_bitmask_BW: Optional[torch.Tensor] = None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]],
              prompt_ids: Optional[Sequence[Sequence[int]]], vocab_size: int,
              device: torch.device | str = "cpu",
              steps: Optional[Sequence[int]] = None,
              pending: Optional[Sequence[int]] = None,
              next_tokens: Optional[torch.Tensor] = None,
              banned: Optional[Sequence[Collection[int]]] = None,
              token_bitmask: Optional[torch.Tensor] = None) -> "SamplingBatch":
        """`output_ids[r]` are the tokens row r generated so far; its step (the seeded
        uniform's counter) is their count, or `steps[r]` when given (tokens still on the
        device count too); `prompt_ids` are needed only when some row has a repetition
        penalty. `pending[r] >= 0`: row r also generated the token at that row of
        `next_tokens`, still on the device (the overlap schedule's token in flight); the
        penalties count it there, without waiting for it. `banned[r]`: token ids row r may
        not pick this step (StopChecker.banned: min_tokens). `token_bitmask` (on the host,
        one row per row) restricts each row to the tokens its grammar allows."""
        B, V = len(params), vocab_size
        if len(output_ids) != B or (prompt_ids is not None and len(prompt_ids) != B):
            raise ValueError(f"{B} params but {len(output_ids)} output_ids rows"
                             + ("" if prompt_ids is None else f", {len(prompt_ids)} prompt rows"))

        def t(values, dtype):  # (no wait for the device: the host list is staged first)
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        if steps is None:
            steps = [len(o) for o in output_ids]

        greedy = [p.greedy for p in params]
        rows = [r for r in range(B) if not greedy[r]]
        sp = [params[r] for r in rows]

        repetition = frequency = presence = counts = seen = None
        if any(p.has_penalties for p in params):
            repetition = t([p.repetition_penalty for p in params], torch.float32)
            frequency = t([p.frequency_penalty for p in params], torch.float32)
            presence = t([p.presence_penalty for p in params], torch.float32)
            counts = _token_counts(output_ids, V, device)
            if pending is not None and any(j >= 0 for j in pending):
                if next_tokens is None:
                    raise ValueError("next_tokens are needed to count the pending tokens")
                rows_p = [r for r in range(B) if pending[r] >= 0]
                tokens = next_tokens[t([pending[r] for r in rows_p], torch.int64)]
                # distinct rows: accumulating ones stays exact and deterministic
                counts.index_put_((t(rows_p, torch.int64), tokens),
                                  torch.ones(len(rows_p), device=device), accumulate=True)
            if any(p.repetition_penalty != 1.0 for p in params):
                if prompt_ids is None:
                    raise ValueError("prompt_ids are needed for a repetition penalty")
                seen = (_token_counts(prompt_ids, V, device) > 0) | (counts > 0)

        adjust_at = adjust_by = None
        at_rows: list[int] = []
        at_ids: list[int] = []
        by: list[float] = []
        for r, p in enumerate(params):
            for tid, bias in p.logit_bias:
                at_rows.append(r)
                at_ids.append(tid)
                by.append(bias)
            for tid in (banned[r] if banned is not None else ()):
                at_rows.append(r)
                at_ids.append(tid)
                by.append(-math.inf)
        if by:
            if max(at_ids) >= V:
                raise ValueError(f"logit_bias and banned token ids must lie in [0, {V}); got "
                                 f"{max(at_ids)}")
            adjust_at, adjust_by = t([at_rows, at_ids], torch.int64), t(by, torch.float32)

        # the sampling rows' parameters in two host-to-device copies (one per dtype), none
        # when every row is greedy: a decode step pays for each copy on the host
        if rows:
            seeds = [(p.seed or 0) % 2**64 for p in sp]
            ints = t([rows, [min(p.top_k, V) if p.top_k > 0 else V for p in sp],
                      [int(p.seed is not None) for p in sp], [s & _M32 for s in seeds],
                      [s >> 32 for s in seeds], [steps[r] for r in rows]],
                     torch.int64)
            floats = t([[p.temperature for p in sp], [p.top_p for p in sp],
                        [p.min_p for p in sp]], torch.float32)
            seeded = ints[2] != 0
        else:
            ints = torch.empty(6, 0, dtype=torch.int64, device=device)
            floats = torch.empty(3, 0, device=device)
            seeded = torch.empty(0, dtype=torch.bool, device=device)
        return cls(
            sample_rows_S=ints[0] if rows else None,
            temperature_S=floats[0], top_k_S=ints[1], top_p_S=floats[1], min_p_S=floats[2],
            seeded_S=seeded, seed_lo_S=ints[3], seed_hi_S=ints[4], step_S=ints[5],
            repetition_B=repetition, frequency_B=frequency, presence_B=presence,
            output_counts_BV=counts, seen_BV=seen,
            adjust_at_2E=adjust_at, adjust_by_E=adjust_by,
            want_logprobs=any(p.logprobs for p in params),
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
            token_bitmask_BW=(None if token_bitmask is None
                              else token_bitmask.to(device, non_blocking=True)),
        )


def _token_counts(rows: Sequence[Sequence[int]], V: int, device) -> torch.Tensor:
    """(B, V) float32 count of each token id in each row; one scatter, no loop over V."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    if flat.size and (flat.min() < 0 or flat.max() >= V):
        raise ValueError(f"token ids must lie in [0, {V}); got {flat.min()}..{flat.max()}")
    # flat index row * V + token: adding ones is exact, so the atomic scatter is deterministic
    index = torch.from_numpy(np.repeat(np.arange(len(rows)) * V, lengths) + flat)
    index = index.to(device, non_blocking=True)
    counts = torch.zeros(len(rows) * V, dtype=torch.float32, device=device)
    counts.index_add_(0, index, torch.ones(index.numel(), device=device))
    return counts.view(len(rows), V)


def apply_penalties(logits_BV: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Biased and penalised float32 logits; the input is left as it was. Without bias, bans or
    penalties, the logits themselves (float32): nothing downstream writes into them, and a
    copy of [B, V] is 155 MB at B = 256 with Qwen3's vocabulary."""
    x = logits_BV.float()
    if batch.adjust_at_2E is not None:  # (row, token) pairs are distinct but for a bias and a
        # ban of one token, whose sum is -inf in either order: the scatter is deterministic
        x = x.index_put((batch.adjust_at_2E[0], batch.adjust_at_2E[1]), batch.adjust_by_E,
                        accumulate=True)
    if batch.output_counts_BV is None:
        return x
    if batch.seen_BV is not None:
        r = batch.repetition_B[:, None]
        x = torch.where(batch.seen_BV, torch.where(x > 0, x / r, x * r), x)
    counts = batch.output_counts_BV
    return (x - batch.frequency_B[:, None] * counts
            - batch.presence_B[:, None] * (counts > 0).float())


def sample_from_logits(x_SV: torch.Tensor, batch: SamplingBatch,
                       uniform_S: torch.Tensor) -> torch.Tensor:
    """Temperature, top-k, min-p, top-p, then inverse CDF with one uniform per row."""
    S, V = x_SV.shape
    scaled = _finite(x_SV / batch.temperature_S[:, None])
    probs = torch.softmax(scaled, dim=-1)
    p_sorted, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = torch.arange(V, device=x_SV.device)[None, :] < batch.top_k_S[:, None]
    keep &= p_sorted >= batch.min_p_S[:, None] * p_sorted[:, :1]
    keep &= p_sorted > 0
    # top-p over what top-k and min-p kept, renormalised: keep a token while the mass before it
    # is below top_p; the first token always stays
    kept = p_sorted * keep
    cdf = kept.cumsum(dim=-1)
    below = (cdf - kept) < batch.top_p_S[:, None] * cdf[:, -1:]
    keep &= below | (batch.top_p_S[:, None] >= 1.0)
    kept = p_sorted * keep
    cdf = kept.cumsum(dim=-1)
    n_kept = keep.sum(dim=-1, keepdim=True)  # the kept tokens are a prefix of the sorted row
    target = uniform_S[:, None] * cdf[:, -1:]
    pos = torch.searchsorted(cdf, target, right=True)
    pos = torch.minimum(pos, n_kept - 1).clamp_(min=0)  # (nothing kept: the most likely)
    return order.gather(1, pos).squeeze(1)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """`x` (a fresh tensor, changed in place) with NaN and -inf the lowest float32 and +inf the
    highest: softmax of a row is then defined, and its largest entry is at least 1 / V."""
    f = torch.finfo(x.dtype)
    return x.nan_to_num_(nan=f.min, posinf=f.max, neginf=f.min)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids_B: torch.Tensor  # int64
    logprobs_B: Optional[torch.Tensor] = None  # float32: log-prob of the chosen token
    top_logprobs_BN: Optional[torch.Tensor] = None  # float32, descending; row r uses its first
    top_token_ids_BN: Optional[torch.Tensor] = None  # int64    params.top_logprobs columns


class Sampler:
    """Samples one token per row; `seed` seeds the generator of rows that have no seed."""

    def __init__(self, device: torch.device | str = "cpu", seed: Optional[int] = None) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits_BV: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        x = apply_penalties(logits_BV, batch)
        if batch.token_bitmask_BW is not None:
            if x is logits_BV:  # (float32 logits come back unchanged: the raw ones stay)
                x = x.clone()
            apply_bitmask(x, batch.token_bitmask_BW)
        tokens = x.argmax(dim=-1)
        rows = batch.sample_rows_S
        if rows is not None:
            u = seeded_uniform(batch.seed_lo_S, batch.seed_hi_S, batch.step_S)
            drawn = torch.rand(rows.numel(), generator=self.generator, device=self.device)
            u = torch.where(batch.seeded_S, u, drawn)
            tokens[rows] = sample_from_logits(x[rows], batch, u)
        if not batch.want_logprobs:
            return SamplerOutput(tokens)
        raw = torch.log_softmax(logits_BV.float(), dim=-1)
        chosen = _finite(raw.gather(1, tokens[:, None]).squeeze(1))
        if batch.max_top_logprobs == 0:
            return SamplerOutput(tokens, chosen)
        top = raw.topk(batch.max_top_logprobs, dim=-1)
        return SamplerOutput(tokens, chosen, _finite(top.values), top.indices)


@dataclass(frozen=True)
class PromptLogprobs:
    """Prompt tokens scored by the logits of the positions before them (legend: R rows)."""

    logprobs_R: torch.Tensor  # float32: log-prob of each row's prompt token
    ranks_R: torch.Tensor  # int64: 1 + how many tokens are more likely than it
    top_logprobs_RN: Optional[torch.Tensor]  # float32, descending
    top_token_ids_RN: Optional[torch.Tensor]  # int64


def score_prompt(logits_RV: torch.Tensor, targets_R: torch.Tensor, top: int) -> PromptLogprobs:
    """log_softmax of the raw logits at each row, as the sampled tokens' logprobs are taken:
    the target's value, its rank, and the `top` largest."""
    lp = torch.log_softmax(logits_RV.float(), dim=-1)
    chosen = lp.gather(1, targets_R[:, None])
    ranks = (lp > chosen).sum(dim=-1) + 1
    chosen = _finite(chosen.squeeze(1))
    if top == 0:
        return PromptLogprobs(chosen, ranks, None, None)
    values, ids = lp.topk(top, dim=-1)
    return PromptLogprobs(chosen, ranks, _finite(values), ids)
