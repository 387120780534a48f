"""The fused MoE experts with block-scaled FP8 weights (W8A8): fused_moe.py's align and grouped
GEMMs with fp8 operands, or decode_moe_fp8.py's two launches for an entry with "decode".

Legend as fused_moe.py; G = the activations' group (the weights' block_k), bn = the weights'
block_n; w13_s [E, 2I/bn, ceil(H/G)] and w2_s [E, ceil(H/bn), I/G] float32 block scales.

    input     x quantized once per token per G columns (kernels/fp8/gemm.quantize_groups),
              unless the dispatcher delivers it quantized with its scales
    gate_up   per K step (BLOCK_K divides G: one scale group a step)
                acc += (xq . w13q) * xs[tok, kb] * w13_s[e, n // bn, kb]
              then act(gate) * up in float32, quantized per row per G columns in the
              epilogue (BLOCK_N a multiple of G: a tile holds whole groups): h in fp8 beside
              its scales hs [rows, ceil(I/G)], for down
    down      acc += (hq . w2q) * hs[row, kb] * w2_s[e, n // bn, kb]; times the top-k weight,
              at the pair's slot or (ATOMIC_SUM) added into its token's row
    top-k sum fused_moe.topk_sum

The epilogue's quantization is the same arithmetic as the quantizer's (values rounded to the
e4m3 grid in float32, then cast), so h's bits are those of quantize_groups on the float32
product; kernels/fp8/reference.py and the reference runner's fp8 path compute the same thing in
torch. h's scales are group-major ([ceil(I/G), rows], hs a transposed view of them). No TMA
pairing of w13's halves (configs.validate refuses "PAIRED" in fp8 tables); "TMA",
"HALF_TAIL", "ATOMIC_SUM" and GROUP_M work as in fused_moe.py. "WS" (BLOCK_M 64, BLOCK_N 128,
128 x 128 blocks) runs a GEMM as fp8_ws.py's warp-specialised Gluon kernel on sm90, the
Triton kernel elsewhere.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from moeserve.kernels.elementwise.act import ACT_CODES, _act
from moeserve.kernels.launch.pdl import pdl_args
from moeserve.kernels.moe.align import align_triton
from moeserve.kernels.moe import fp8_ws, fp8_ws128
from moeserve.kernels.moe.align_torch import Workspace, take, take_group_major
from moeserve.kernels.moe.decode_moe_fp8 import decode_experts_fp8
from moeserve.kernels.moe.fp8_tiles import FP8, check_tiles, quantize_input, quantize_rows
from moeserve.kernels.moe.fused_moe import (_block_pairs, _launch_opts, _row_tile, _store_down,
                                            _tile_of, _weight_tile, _weights_arg, topk_sum)

@triton.jit
def _gate_up_tile(x_ptr, xs_ptr, w13_ptr, ws_ptr, h_ptr, hs_ptr, sorted_ptr, expert, row0, rows,
                  pid_n, hidden, inter, top_k, stride_xs, stride_we, stride_wn, stride_hs,
                  stride_hg, ACT: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                  EVEN_K: tl.constexpr, TMA: tl.constexpr, SWAP: tl.constexpr):
    offs_m, row_ok, pair = _block_pairs(sorted_ptr, row0, rows, M)
    token = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * hidden + offs_k[None, :]
    as_ptrs = xs_ptr + token * stride_xs
    if TMA:  # w13_ptr is a TensorDescriptor of [E, 2I, H]
        g_ptrs = 0
    else:
        w_base = w13_ptr + expert.to(tl.int64) * (2 * inter) * hidden
        g_ptrs = w_base + offs_n[None, :].to(tl.int64) * hidden + offs_k[:, None]
    s_base = ws_ptr + expert.to(tl.int64) * stride_we
    gs_ptrs = s_base + (offs_n // GROUP_N) * stride_wn
    us_ptrs = s_base + ((inter + offs_n) // GROUP_N) * stride_wn
    # SWAP: the weight's rows the dot's M side and the block's rows its N side ([BLOCK_N, M]
    # accumulators, transposed after the loop), so that a block of few rows still takes
    # Hopper's warpgroup MMA, whose M side is at least 64
    acc_g = tl.zeros((BLOCK_N, M) if SWAP else (M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, M) if SWAP else (M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kb = k0 // GROUP_K
        a = _row_tile(a_ptrs, row_ok, hidden - k0, BLOCK_K, EVEN_K)
        g = _weight_tile(w13_ptr, g_ptrs, expert, pid_n * BLOCK_N, k0, hidden - k0, n_ok,
                         BLOCK_N, BLOCK_K, TMA, EVEN_K)
        u = _weight_tile(w13_ptr, g_ptrs + inter * hidden, expert, inter + pid_n * BLOCK_N,
                         k0, hidden - k0, n_ok, BLOCK_N, BLOCK_K, TMA, EVEN_K)
        a_s = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
        g_s = tl.load(gs_ptrs + kb, mask=n_ok, other=0.0)
        u_s = tl.load(us_ptrs + kb, mask=n_ok, other=0.0)
        if SWAP:
            acc_g += tl.dot(g.T, a.T) * g_s[:, None] * a_s[None, :]
            acc_u += tl.dot(u.T, a.T) * u_s[:, None] * a_s[None, :]
        else:
            acc_g += tl.dot(a, g) * a_s[:, None] * g_s[None, :]
            acc_u += tl.dot(a, u) * a_s[:, None] * u_s[None, :]
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    if SWAP:
        acc_g = acc_g.T
        acc_u = acc_u.T
    # columns past I hold act(0) * 0 = 0: they never raise a group's amax
    q, scale = quantize_rows(_act(acc_g, ACT) * acc_u, M, BLOCK_N, GROUP_K)
    row = (row0 + offs_m).to(tl.int64)
    tl.store(h_ptr + row[:, None] * inter + offs_n[None, :], q.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])
    groups = pid_n * (BLOCK_N // GROUP_K) + tl.arange(0, BLOCK_N // GROUP_K)
    tl.store(hs_ptr + row[:, None] * stride_hs + groups[None, :] * stride_hg, scale,
             mask=row_ok[:, None] & (groups * GROUP_K < inter)[None, :])


@triton.jit(do_not_specialize=["num_blocks", "top_k", "GROUP_M"])
def _gate_up_kernel(x_ptr, xs_ptr, w13_ptr, ws_ptr, h_ptr, hs_ptr, sorted_ptr, block_expert_ptr,
                    block_rows_ptr, num_blocks, hidden, inter, top_k, GROUP_M, stride_xs,
                    stride_we, stride_wn, stride_hs, stride_hg, ACT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr,
                    TMA: tl.constexpr, HALF_TAIL: tl.constexpr, SWAP: tl.constexpr,
                    PDL: tl.constexpr):
    pid_m, pid_n, expert, rows = _tile_of(num_blocks, inter, block_expert_ptr, block_rows_ptr,
                                          BLOCK_N, GROUP_M, PDL)
    if expert < 0:
        return
    if HALF_TAIL and rows <= BLOCK_M // 2:
        _gate_up_tile(x_ptr, xs_ptr, w13_ptr, ws_ptr, h_ptr, hs_ptr, sorted_ptr, expert,
                      pid_m * BLOCK_M, rows, pid_n, hidden, inter, top_k, stride_xs, stride_we,
                      stride_wn, stride_hs, stride_hg, ACT, BLOCK_M // 2, BLOCK_N, BLOCK_K,
                      GROUP_N, GROUP_K, EVEN_K, TMA, SWAP)
    else:
        _gate_up_tile(x_ptr, xs_ptr, w13_ptr, ws_ptr, h_ptr, hs_ptr, sorted_ptr, expert,
                      pid_m * BLOCK_M, rows, pid_n, hidden, inter, top_k, stride_xs, stride_we,
                      stride_wn, stride_hs, stride_hg, ACT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N,
                      GROUP_K, EVEN_K, TMA, SWAP)


@triton.jit
def _down_tile(h_ptr, hs_ptr, w2_ptr, ws_ptr, y_ptr, sorted_ptr, topk_weights_ptr, expert, row0,
               rows, pid_n, hidden, inter, top_k, stride_hs, stride_hg, stride_we, stride_wn,
               M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr,
               TMA: tl.constexpr, ATOMIC_SUM: tl.constexpr, SWAP: tl.constexpr):
    offs_m, row_ok, pair = _block_pairs(sorted_ptr, row0, rows, M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    row = (row0 + offs_m).to(tl.int64)
    a_ptrs = h_ptr + row[:, None] * inter + offs_k[None, :]
    as_ptrs = hs_ptr + row * stride_hs
    if TMA:  # w2_ptr is a TensorDescriptor of [E, H, I]
        b_ptrs = 0
    else:
        b_ptrs = (w2_ptr + expert.to(tl.int64) * hidden * inter
                  + offs_n[None, :].to(tl.int64) * inter + offs_k[:, None])
    bs_ptrs = ws_ptr + expert.to(tl.int64) * stride_we + (offs_n // GROUP_N) * stride_wn
    acc = tl.zeros((BLOCK_N, M) if SWAP else (M, BLOCK_N), dtype=tl.float32)  # as gate_up's
    for k0 in range(0, inter, BLOCK_K):
        kb = k0 // GROUP_K
        a = _row_tile(a_ptrs, row_ok, inter - k0, BLOCK_K, EVEN_K)
        b = _weight_tile(w2_ptr, b_ptrs, expert, pid_n * BLOCK_N, k0, inter - k0, n_ok,
                         BLOCK_N, BLOCK_K, TMA, EVEN_K)
        a_s = tl.load(as_ptrs + kb * stride_hg, mask=row_ok, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=n_ok, other=0.0)
        if SWAP:
            acc += tl.dot(b.T, a.T) * b_s[:, None] * a_s[None, :]
        else:
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SWAP:
        acc = acc.T
    _store_down(acc, y_ptr, topk_weights_ptr, pair, row_ok, offs_n, n_ok, hidden, top_k,
                ATOMIC_SUM)


@triton.jit(do_not_specialize=["num_blocks", "top_k", "GROUP_M"])
def _down_kernel(h_ptr, hs_ptr, w2_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr,
                 block_rows_ptr, topk_weights_ptr, num_blocks, hidden, inter, top_k, GROUP_M,
                 stride_hs, stride_hg, stride_we, stride_wn, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
                 GROUP_K: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                 HALF_TAIL: tl.constexpr, ATOMIC_SUM: tl.constexpr, SWAP: tl.constexpr,
                 PDL: tl.constexpr):
    pid_m, pid_n, expert, rows = _tile_of(num_blocks, hidden, block_expert_ptr, block_rows_ptr,
                                          BLOCK_N, GROUP_M, PDL)
    if expert < 0:
        return
    if HALF_TAIL and rows <= BLOCK_M // 2:
        _down_tile(h_ptr, hs_ptr, w2_ptr, ws_ptr, y_ptr, sorted_ptr, topk_weights_ptr, expert,
                   pid_m * BLOCK_M, rows, pid_n, hidden, inter, top_k, stride_hs, stride_hg,
                   stride_we, stride_wn, BLOCK_M // 2, BLOCK_N, BLOCK_K, GROUP_N, GROUP_K, EVEN_K,
                   TMA, ATOMIC_SUM, SWAP)
    else:
        _down_tile(h_ptr, hs_ptr, w2_ptr, ws_ptr, y_ptr, sorted_ptr, topk_weights_ptr, expert,
                   pid_m * BLOCK_M, rows, pid_n, hidden, inter, top_k, stride_hs, stride_hg,
                   stride_we, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N, GROUP_K, EVEN_K,
                   TMA, ATOMIC_SUM, SWAP)


def gate_up(xq, xs, w13, w13_s, blocks, top_k: int, act: str, cfg: dict[str, Any],
            block: tuple[int, int], ws: Optional[Workspace] = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h fp8 [rows, I], hs float32 [rows, ceil(I/G)]) in block order; hs is the transposed
    view of a group-major [ceil(I/G), rows] tensor (hs.t(): what fp8_ws's down loads)."""
    num_local, two_i, hidden = w13.shape
    inter, group = two_i // 2, block[1]
    check_tiles(cfg, group, "gate_up", whole_groups=True)
    rows = blocks.num_blocks * blocks.block_m
    h = take(ws and ws.act, rows, "act", inter, dtype=FP8, device=xq.device)
    hs = take_group_major(ws and ws.act_scale, rows, "act_scale", triton.cdiv(inter, group),
                          xq.device).t()
    if blocks.num_blocks == 0:
        return h, hs
    if fp8_ws.usable(w13, block, blocks.block_m, cfg) and fp8_ws.gathers(xq, xs):
        fp8_ws.gate_up_fp8_ws(xq, xs, w13, w13_s, blocks, top_k, act, cfg, h, hs.t())
        return h, hs
    if fp8_ws128.usable(w13, block, blocks.block_m, cfg) and fp8_ws.gathers(xq, xs):
        fp8_ws128.gate_up128(xq, xs, w13, w13_s, blocks, top_k, act, cfg, h, hs.t())
        return h, hs
    grid = (blocks.num_blocks * triton.cdiv(inter, cfg["BLOCK_N"]),)
    w_arg, tma = _weights_arg(w13, cfg)
    _gate_up_kernel[grid](xq, xs, w_arg, w13_s, h, hs, blocks.sorted_pairs, blocks.block_expert,
                          blocks.block_rows, blocks.num_blocks, hidden, inter, top_k,
                          cfg["GROUP_M"], xs.stride(0), w13_s.stride(0), w13_s.stride(1),
                          hs.stride(0), hs.stride(1), ACT=ACT_CODES[act], GROUP_N=block[0],
                          GROUP_K=group, EVEN_K=hidden % cfg["BLOCK_K"] == 0, TMA=tma,
                          SWAP=bool(cfg.get("SWAP")), **_launch_opts(cfg, blocks.block_m),
                          **pdl_args(xq.device))
    return h, hs


def down(h, hs, w2, w2_s, blocks, topk_weights_P: torch.Tensor, dst: torch.Tensor, top_k: int,
         cfg: dict[str, Any], block: tuple[int, int], atomic: bool) -> torch.Tensor:
    """Into dst: y_PH at each pair's slot, or (atomic) the top-k sum into a zeroed [N, H].
    hs: gate_up's (any strides; fp8_ws's down takes a group-major one)."""
    num_local, hidden, inter = w2.shape
    check_tiles(cfg, block[1], "down", whole_groups=False)
    if not blocks.num_blocks:
        return dst
    if fp8_ws.usable(w2, block, blocks.block_m, cfg) and hs.t().is_contiguous():
        fp8_ws.down_fp8_ws(h, hs.t(), w2, w2_s, blocks, topk_weights_P, dst, top_k, cfg, atomic)
        return dst
    if fp8_ws128.down_usable(w2, block, blocks.block_m, cfg) and hs.t().is_contiguous():
        fp8_ws128.down128(h, hs.t(), w2, w2_s, blocks, topk_weights_P, dst, top_k, cfg, atomic)
        return dst
    grid = (blocks.num_blocks * triton.cdiv(hidden, cfg["BLOCK_N"]),)
    w_arg, tma = _weights_arg(w2, cfg)
    _down_kernel[grid](h, hs, w_arg, w2_s, dst, blocks.sorted_pairs, blocks.block_expert,
                       blocks.block_rows, topk_weights_P, blocks.num_blocks, hidden, inter,
                       top_k, cfg["GROUP_M"], hs.stride(0), hs.stride(1), w2_s.stride(0),
                       w2_s.stride(1), GROUP_N=block[0], GROUP_K=block[1],
                       EVEN_K=inter % cfg["BLOCK_K"] == 0, TMA=tma, ATOMIC_SUM=atomic,
                       SWAP=bool(cfg.get("SWAP")), **_launch_opts(cfg, blocks.block_m),
                       **pdl_args(h.device))
    return dst


def fused_experts_fp8(x_NH: torch.Tensor, x_scale: Optional[torch.Tensor], w13: torch.Tensor,
                      w13_s: torch.Tensor, w2: torch.Tensor, w2_s: torch.Tensor,
                      topk_ids_NK: torch.Tensor, topk_weights_NK: torch.Tensor,
                      first_expert: int, act: str, block: tuple[int, int],
                      config: dict[str, Any], out_dtype: torch.dtype,
                      ws: Optional[Workspace] = None, sum_topk: bool = True) -> torch.Tensor:
    """sum_k w_k expert_k(x) over this rank's pairs, W8A8: x in out_dtype (quantized here), or
    fp8 with its [N, ceil(H/G)] scales x_scale; the output in out_dtype. sum_topk=False
    where fused_moe.leaves_topk_sum(config): the pairs' rows [N * k, H], unsummed."""
    num_local = w13.shape[0]
    n, k = topk_ids_NK.shape
    ids = topk_ids_NK.to(torch.int32).contiguous()
    weights = topk_weights_NK.to(torch.float32).contiguous().view(-1)
    if "decode" in config:  # quantizes the rows itself
        return decode_experts_fp8(x_NH.contiguous(), x_scale, w13, w13_s, w2, w2_s,
                                  ids.view(-1), weights, k, first_expert, act, block,
                                  config["decode"], out_dtype, ws)
    if x_scale is None:
        xq, xs = quantize_input(x_NH, block[1], ws)
    else:
        xq, xs = x_NH.contiguous(), x_scale.contiguous()
    blocks = align_triton(ids, first_expert, num_local, config["BLOCK_M"], ws)
    h, hs = gate_up(xq, xs, w13, w13_s, blocks, k, act, config["gate_up"], block, ws)
    hidden = w2.shape[1]
    if config["down"].get("ATOMIC_SUM"):
        out = torch.zeros(n, hidden, dtype=out_dtype, device=xq.device)
        return down(h, hs, w2, w2_s, blocks, weights, out, k, config["down"], block, True)
    y = take(ws and ws.down, n * k, "down", hidden, dtype=out_dtype, device=xq.device)
    down(h, hs, w2, w2_s, blocks, weights, y, 1, config["down"], block, False)
    return topk_sum(y, ids, first_expert, num_local) if sum_topk else y
