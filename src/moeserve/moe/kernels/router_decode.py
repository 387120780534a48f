"""The softmax + greedy top-k router on a GPU (Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek-V2 greedy).

  topk_softmax   from given logits [M, E]: one program per row
  router_topk    a decode step's few rows (<= MAX_ROWS) in one launch, logits included: each
                 program computes BLOCK_N experts' logits for every row (a GEMV over the
                 router's rows), stores them, and takes a ticket from an arrival counter
                 (atomic, acquire-release at GPU scope); the program with the last ticket reads
                 all the logits, writes ids and weights, and sets the counter back to 0. The
                 counter is one int32 of the caller's, 0 between launches: a CUDA graph replays
                 the same launch, so graphs keep it right.

Both give: top-k of the fp32 softmax, optional renormalisation, scaling, rounding of the
weights to the model dtype, ids -1 / weights 0 for padding rows (index >= num_valid). Logits
are rounded to the model dtype first unless the router computes them in fp32 (DeepSeek).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 4
ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


@triton.jit
def _round(x, MODE: tl.constexpr):
    if MODE == 1:
        x = x.to(tl.bfloat16).to(tl.float32)
    elif MODE == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _topk_row(logits, offs, E, pad, scale, Ids_row, Weights_row, TOP_K: tl.constexpr,
              BLOCK_K: tl.constexpr, RENORM: tl.constexpr, ROUND_W: tl.constexpr):
    """ids / weights of one row from its fp32 logits [BLOCK_E] (-inf past E)."""
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)
    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    ws = tl.zeros([BLOCK_K], tl.float32)
    work = tl.where(offs < E, p, -1.0)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(work, 0)
        ids = tl.where(offs_k == j, best, ids)
        ws = tl.where(offs_k == j, tl.max(work, 0), ws)
        work = tl.where(offs == best, -1.0, work)
    if RENORM:
        ws = ws / (tl.sum(ws, 0) + 1e-20)
    ws = _round(ws * scale, ROUND_W)
    kmask = offs_k < TOP_K
    tl.store(Ids_row + offs_k, tl.where(pad, -1, ids), mask=kmask)
    tl.store(Weights_row + offs_k, tl.where(pad, 0.0, ws), mask=kmask)


@triton.jit
def _topk_softmax_kernel(Logits, Ids, Weights, stride_l, E, num_valid, scale,
                         TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         RENORM: tl.constexpr, ROUND_W: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(Logits + row.to(tl.int64) * stride_l + offs, mask=offs < E,
                other=float("-inf")).to(tl.float32)
    _topk_row(x, offs, E, row >= num_valid, scale, Ids + row * TOP_K, Weights + row * TOP_K,
              TOP_K, BLOCK_K, RENORM, ROUND_W)


def topk_softmax(logits_ME: torch.Tensor, top_k: int, renormalize: bool, scale: float,
                 num_valid: int, round_to: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [M, K] int32 and weights [M, K] float32 of the softmax + greedy top-k router."""
    m, e = logits_ME.shape
    assert logits_ME.stride(-1) == 1
    ids = torch.empty(m, top_k, dtype=torch.int32, device=logits_ME.device)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=logits_ME.device)
    if m:
        _topk_softmax_kernel[(m,)](logits_ME, ids, weights, logits_ME.stride(0), e, num_valid,
                                   scale, TOP_K=top_k, BLOCK_E=_pow2(e), BLOCK_K=_pow2(top_k),
                                   RENORM=renormalize, ROUND_W=ROUND[round_to], num_warps=1)
    return ids, weights


@triton.jit
def _router_topk_kernel(X, W, Logits, Arrivals, Ids, Weights, M, E, H, stride_xm, num_valid,
                        scale, TOP_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        RENORM: tl.constexpr, ROUND_LOGITS: tl.constexpr,
                        ROUND_W: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    offs_h = tl.arange(0, BLOCK_H)
    n_ok, r_ok = offs_n < E, offs_r < M
    w_ptrs = W + offs_n[:, None].to(tl.int64) * H + offs_h[None, :]
    x_ptrs = X + offs_r[:, None] * stride_xm + offs_h[None, :]
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h_ok = offs_h < H - h0
        w = tl.load(w_ptrs, mask=n_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptrs, mask=r_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
        w_ptrs += BLOCK_H
        x_ptrs += BLOCK_H
    logits = _round(tl.sum(acc, 2), ROUND_LOGITS)  # [ROWS, BLOCK_N]
    tl.store(Logits + offs_r[:, None] * E + offs_n[None, :], logits,
             mask=r_ok[:, None] & n_ok[None, :])
    tl.debug_barrier()  # every thread's logits are written before the ticket is taken
    ticket = tl.atomic_add(Arrivals, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:  # the last program: all the logits are visible
        offs = tl.arange(0, BLOCK_E)
        for r in range(0, M):
            row = tl.load(Logits + r * E + offs, mask=offs < E, other=float("-inf"),
                          cache_modifier=".cg")
            _topk_row(row, offs, E, r >= num_valid, scale, Ids + r * TOP_K,
                      Weights + r * TOP_K, TOP_K, BLOCK_K, RENORM, ROUND_W)
        tl.atomic_xchg(Arrivals, 0, sem="relaxed", scope="gpu")


def router_topk(x_MH: torch.Tensor, weight_EH: torch.Tensor, arrivals: torch.Tensor,
                top_k: int, renormalize: bool, scale: float, num_valid: int,
                fp32_logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [M, K] int32 and weights [M, K] float32 for M <= MAX_ROWS rows in one launch;
    `arrivals`: an int32 [1] on x's device holding 0 (left 0)."""
    m, h = x_MH.shape
    e = weight_EH.shape[0]
    assert 0 < m <= MAX_ROWS and x_MH.stride(-1) == 1 and weight_EH.is_contiguous()
    assert arrivals.dtype == torch.int32 and arrivals.device == x_MH.device
    ids = torch.empty(m, top_k, dtype=torch.int32, device=x_MH.device)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=x_MH.device)
    logits = torch.empty(m, e, dtype=torch.float32, device=x_MH.device)
    rows = _pow2(m)
    block_n = 1 if e <= 256 else 2
    block_h = min(_pow2(h), 8192 // rows)  # [ROWS, BLOCK_N, BLOCK_H] fp32 products: 64 a thread
    _router_topk_kernel[(triton.cdiv(e, block_n),)](
        x_MH, weight_EH, logits, arrivals, ids, weights, m, e, h, x_MH.stride(0), num_valid,
        scale, TOP_K=top_k, ROWS=rows, BLOCK_N=block_n, BLOCK_H=block_h, BLOCK_E=_pow2(e),
        BLOCK_K=_pow2(top_k), RENORM=renormalize,
        ROUND_LOGITS=0 if fp32_logits else ROUND[x_MH.dtype], ROUND_W=ROUND[
            torch.float32 if fp32_logits else x_MH.dtype], num_warps=4)
    return ids, weights
