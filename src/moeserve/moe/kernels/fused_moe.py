"""The fused MoE experts in Triton: align, two grouped GEMMs, the top-k sum (4 launches at decode).

Legend: N rows, K top-k, P = N K pairs, E local experts, H hidden, I intermediate (this rank's
moe_tp shard), B aligned blocks of BLOCK_M rows (align_torch.py).

    align        pairs grouped by local expert, each expert's segment padded to BLOCK_M
    gate_up      h_BI[b, i] = act(x[tok] . w13[e, i]) * (x[tok] . w13[e, I + i])  (rows in
                 block order; both halves of w13 in one program, so act-and-mul is fused)
    down         y_PH[p] = weight_p * (h[row of p] . w2[e])  (written at the pair's own slot)
    top-k sum    out_NH[n] = sum over the pairs of row n that this rank owns of y_PH[p]

A program whose block belongs to no expert returns before loading anything, so only the
experts that some pair uses are read. The grid is sized from max_blocks(P), a bound that
depends on shapes alone: nothing is read back to the host and the whole thing can be captured
in a CUDA graph. The top-k sum is a separate, deterministic pass over y_PH rather than atomics
into a zeroed fp32 buffer: same number of launches, no memset, no cast pass, and every run of
the same input gives the same bits.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from moeserve.moe.kernels.align import align_triton

ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _tile_ids(num_blocks, n_size, BLOCK_N: tl.constexpr, GROUP_M):
    """Program id -> (block, n tile); GROUP_M consecutive blocks share their weight tiles in L2."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_size, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 0:
        out = g * tl.sigmoid(g)
    elif ACT == 1:
        out = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:  # tanh approximation, tanh(z) = 2 sigmoid(2z) - 1
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        out = g * tl.sigmoid(2.0 * inner)
    return out


@triton.jit(do_not_specialize=["num_blocks", "top_k", "GROUP_M"])
def _gate_up_kernel(x_ptr, w13_ptr, h_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr,
                    num_blocks, hidden, inter, top_k, GROUP_M,
                    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m, pid_n = _tile_ids(num_blocks, inter, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = tl.load(block_rows_ptr + pid_m)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_m, mask=row_ok, other=0)
    token = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * hidden + offs_k[None, :]
    w_base = w13_ptr + expert.to(tl.int64) * (2 * inter) * hidden
    g_ptrs = w_base + offs_n[None, :].to(tl.int64) * hidden + offs_k[:, None]
    u_ptrs = g_ptrs + inter * hidden
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < hidden - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g)
        acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = (_act(acc_g, ACT) * acc_u).to(h_ptr.dtype.element_ty)
    row = (pid_m * BLOCK_M + offs_m).to(tl.int64)
    tl.store(h_ptr + row[:, None] * inter + offs_n[None, :], h,
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_blocks", "GROUP_M"])
def _down_kernel(h_ptr, w2_ptr, y_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr,
                 topk_weights_ptr, num_blocks, hidden, inter, GROUP_M,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr):
    pid_m, pid_n = _tile_ids(num_blocks, hidden, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = tl.load(block_rows_ptr + pid_m)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_m, mask=row_ok, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    row = (pid_m * BLOCK_M + offs_m).to(tl.int64)
    a_ptrs = h_ptr + row[:, None] * inter + offs_k[None, :]
    b_ptrs = (w2_ptr + expert.to(tl.int64) * hidden * inter
              + offs_n[None, :].to(tl.int64) * inter + offs_k[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    y = (acc * weight[:, None]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + pair.to(tl.int64)[:, None] * hidden + offs_n[None, :], y,
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["top_k", "first_expert", "num_local"])
def _topk_sum_kernel(y_ptr, ids_ptr, out_ptr, hidden, top_k, first_expert, num_local,
                     BLOCK_H: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in range(0, top_k):
        local = tl.load(ids_ptr + n * top_k + k) - first_expert
        mine = (local >= 0) & (local < num_local)  # -1 is never mine: first_expert >= 0
        v = tl.load(y_ptr + (n * top_k + k) * hidden + offs_h, mask=h_ok & mine, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + n * hidden + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def _launch_opts(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
            "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}


def gate_up(x_NH, w13, blocks, top_k: int, act: str, cfg: dict[str, Any]) -> torch.Tensor:
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    h = torch.empty(blocks.num_blocks * blocks.block_m, inter, dtype=x_NH.dtype,
                    device=x_NH.device)
    if blocks.num_blocks == 0:
        return h
    grid = (blocks.num_blocks * triton.cdiv(inter, cfg["BLOCK_N"]),)
    _gate_up_kernel[grid](x_NH, w13, h, blocks.sorted_pairs, blocks.block_expert,
                          blocks.block_rows, blocks.num_blocks, hidden, inter, top_k,
                          cfg["GROUP_M"], ACT=ACT_CODES[act], BLOCK_M=blocks.block_m,
                          EVEN_K=hidden % cfg["BLOCK_K"] == 0, **_launch_opts(cfg))
    return h


def down(h, w2, blocks, topk_weights_P: torch.Tensor, num_pairs: int,
         cfg: dict[str, Any]) -> torch.Tensor:
    num_local, hidden, inter = w2.shape
    y = torch.empty(num_pairs, hidden, dtype=h.dtype, device=h.device)
    if blocks.num_blocks == 0:
        return y
    grid = (blocks.num_blocks * triton.cdiv(hidden, cfg["BLOCK_N"]),)
    _down_kernel[grid](h, w2, y, blocks.sorted_pairs, blocks.block_expert, blocks.block_rows,
                       topk_weights_P, blocks.num_blocks, hidden, inter, cfg["GROUP_M"],
                       BLOCK_M=blocks.block_m, EVEN_K=inter % cfg["BLOCK_K"] == 0,
                       **_launch_opts(cfg))
    return y


def topk_sum(y_PH, topk_ids_NK, first_expert: int, num_local: int) -> torch.Tensor:
    n, k = topk_ids_NK.shape
    hidden = y_PH.shape[1]
    out = torch.empty(n, hidden, dtype=y_PH.dtype, device=y_PH.device)
    if n == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(hidden))
    _topk_sum_kernel[(n, triton.cdiv(hidden, block_h))](
        y_PH, topk_ids_NK, out, hidden, k, first_expert, num_local, BLOCK_H=block_h,
        num_warps=4)
    return out


def fused_experts(x_NH: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_ids_NK: torch.Tensor, topk_weights_NK: torch.Tensor,
                  first_expert: int, act: str, config: dict[str, Any]) -> torch.Tensor:
    """sum_k w_k expert_k(x) over the pairs whose expert is in [first_expert, first + E)."""
    num_local = w13.shape[0]
    n, k = topk_ids_NK.shape
    x_NH = x_NH.contiguous()
    ids = topk_ids_NK.to(torch.int32).contiguous()
    weights = topk_weights_NK.to(torch.float32).contiguous().view(-1)
    blocks = align_triton(ids, first_expert, num_local, config["BLOCK_M"])
    h = gate_up(x_NH, w13, blocks, k, act, config["gate_up"])
    y = down(h, w2, blocks, weights, n * k, config["down"])
    return topk_sum(y, ids, first_expert, num_local)
