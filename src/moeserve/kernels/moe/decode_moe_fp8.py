"""The MoE experts for a few rows with block-scaled FP8 weights: decode_moe.py's two launches
with fp8 operands, and no quantizer launch of their own on quantized rows (legend as there and
in fused_moe_fp8.py).

    gate_up   one program per (pair, BLOCK_N columns of I), BLOCK_K columns of H (whole
              scale groups) a step: the pair's row quantized in the kernel per group (the
              quantizer's codes and scales, fp8_tiles.quantized_groups), or read quantized where
              the dispatcher delivered it so, then
                g += sum_k w13q[e, n, k] * (xq xs)[tok, k] * w13_s[e, n // bn, k // G]
              (u the same over the up half); h = act(g) * u in float32, [P, I]
    down      one program per (row, BLOCK_N columns of H), the tiles of all the row's experts
              at once, BLOCK_K columns of I (whole scale groups) a step: each pair's groups of
              h quantized in the kernel (the codes and scales quantize_groups gives them), then
                acc[j] += sum_k w2q[e_j, n, k] * (hq hs)[j, k] w_j * w2_s[e_j, n // bn, kb]
              the top-k sum in registers in a fixed order, one rounding at the store

With "MMA" in its tiles, gate_up is instead one program per (pair, BLOCK_N rows of I) whose
weight tile is the fp8 dot's M side against the pair's quantized row (column 0 of a [G,
MMA_COLS] tile, the rest zeros), a group a step: the tensor cores multiply the fp8 codes as
they are, where the CUDA-core kernels convert every weight byte to float32, which at the
memory's rate keeps the SMs busy (H100, one row: 11.8 against 13.5 us for Qwen3-30B-A3B's
experts). It takes the rows quantized; bf16 rows are quantized first, in a launch.

With "MMA" in its tiles, down is one program per (row, BLOCK_N rows of H, part): the row's
top-k pairs are split into parts (down_split: as many pairs a part as keep two programs an SM
busy, since a row alone gives H / BLOCK_N programs), each pair's quantized group of h in
column 0 of the dot's [G, MMA_COLS] tile, the expert's weight rows its M side; a part's pairs
add up in order, and the parts' float32 sums go through the fp8 GEMM's split-K partials and
counters (gemm.split_sum: the last part to finish adds them in part order, so the bits are
the same run to run, and rounds once at the store). h is quantized first, in a launch of its
own (quantizing each group inside the kernel put a reduction and its barriers before every
step's dot: at one row of Qwen3-30B-A3B on H200, 11.9 us against 8.6 with the launch).

The other products are fp32 multiply-adds on CUDA cores. Each step's products are reduced at
once, so the registers hold the next step's tiles, loaded before this step's arithmetic,
rather than [BLOCK_N, BLOCK_K] accumulators. down reads its ids and top-k weights and its
first tiles before the PDL gate (decode_moe.py's down says why that is safe), so they stream
in while gate_up ends. Pairs of other ranks and ids of -1 read nothing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from moeserve.kernels.elementwise.act import ACT_CODES, _act
from moeserve.kernels.fp8.gemm import _sm_count, check_dot_k, split_buffers, split_sum
from moeserve.kernels.launch.pdl import pdl_args, pdl_gate
from moeserve.kernels.moe.align_torch import Workspace, take
from moeserve.kernels.moe.decode_moe import _ARGS, _down_row
from moeserve.kernels.moe.fp8_tiles import (check_tiles, quantize_act, quantize_input,
                                            quantized_groups)


@triton.jit
def _row_groups(x_row, xs_row, k_in, hidden, kb, GROUP_K: tl.constexpr, QUANT_X: tl.constexpr):
    """The row's groups at these columns ([GROUPS, G], zero outside H) as W8A8 multiplies
    them: codes x scales, quantized here (QUANT_X) or as delivered."""
    x = tl.load(x_row + k_in, mask=k_in < hidden, other=0.0).to(tl.float32)
    if QUANT_X:
        return quantized_groups(x)
    return x * tl.load(xs_row + kb, mask=kb * GROUP_K < hidden, other=0.0)[:, None]


@triton.jit
def _gate_up_tiles(g_rows, k_in, n_ok, hidden, inter):
    ok = n_ok[:, None, None] & (k_in < hidden)[None, :, :]
    return (tl.load(g_rows + k_in[None, :, :], mask=ok, other=0.0),
            tl.load(g_rows + inter * hidden + k_in[None, :, :], mask=ok, other=0.0))


@triton.jit(do_not_specialize=_ARGS)
def _decode_gate_up_kernel(x_ptr, xs_ptr, w13_ptr, ws_ptr, h_ptr, ids_ptr, hidden, inter, top_k,
                           first_expert, num_local, stride_x, stride_xs, stride_we, stride_wn,
                           ACT: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                           GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, QUANT_X: tl.constexpr,
                           PDL: tl.constexpr):
    pdl_gate(PDL)
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair) - first_expert  # id -1 gives < 0: first_expert >= 0
    if (expert < 0) | (expert >= num_local):
        return
    token = (pair // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    gs = tl.arange(0, GROUPS)
    k_in = gs[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]  # [GROUPS, G]
    x_row = x_ptr + token * stride_x
    xs_row = xs_ptr + token * stride_xs
    g_rows = (w13_ptr + expert.to(tl.int64) * 2 * inter * hidden
              + offs_n.to(tl.int64)[:, None, None] * hidden)
    s_base = ws_ptr + expert.to(tl.int64) * stride_we
    gs_rows = s_base + (offs_n // GROUP_N)[:, None] * stride_wn
    us_rows = s_base + ((inter + offs_n) // GROUP_N)[:, None] * stride_wn
    g, u = _gate_up_tiles(g_rows, k_in, n_ok, hidden, inter)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, GROUPS * GROUP_K):
        # the next step's tiles go out before this step's arithmetic
        g_next, u_next = _gate_up_tiles(g_rows, k0 + GROUPS * GROUP_K + k_in, n_ok, hidden, inter)
        kb = k0 // GROUP_K + gs
        s_ok = n_ok[:, None] & (kb * GROUP_K < hidden)[None, :]
        g_s = tl.load(gs_rows + kb[None, :], mask=s_ok, other=0.0)
        u_s = tl.load(us_rows + kb[None, :], mask=s_ok, other=0.0)
        x = _row_groups(x_row, xs_row, k0 + k_in, hidden, kb, GROUP_K, QUANT_X)[None, :, :]
        acc_g += tl.sum(tl.sum(g.to(tl.float32) * x, axis=2) * g_s, axis=1)
        acc_u += tl.sum(tl.sum(u.to(tl.float32) * x, axis=2) * u_s, axis=1)
        g, u = g_next, u_next
    h = _act(acc_g, ACT) * acc_u
    tl.store(h_ptr + pair.to(tl.int64) * inter + offs_n, h, mask=n_ok)


MMA_COLS = 16  # the dot's N side in the MMA gate_up: the pair's row, then zeros


@triton.jit(do_not_specialize=_ARGS)
def _decode_gate_up_mma_kernel(xq_ptr, xs_ptr, w13_ptr, ws_ptr, h_ptr, ids_ptr, hidden, inter,
                               top_k, first_expert, num_local, stride_x, stride_xs, stride_we,
                               stride_wn, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
                               GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                               COLS: tl.constexpr, PDL: tl.constexpr):
    # program (pair, BLOCK_N columns of I): the weight's rows the dot's M side against the
    # pair's quantized row (column 0 of a [G, COLS] tile, the rest zeros), a group a step
    pdl_gate(PDL)
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair) - first_expert
    if (expert < 0) | (expert >= num_local):
        return
    token = (pair // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    ks = tl.arange(0, GROUP_K)
    first = tl.arange(0, COLS) == 0
    g_rows = (w13_ptr + expert.to(tl.int64) * 2 * inter * hidden
              + offs_n.to(tl.int64)[:, None] * hidden)
    u_rows = g_rows + inter * hidden
    s_base = ws_ptr + expert.to(tl.int64) * stride_we
    gs_rows = s_base + (offs_n // GROUP_N) * stride_wn
    us_rows = s_base + ((inter + offs_n) // GROUP_N) * stride_wn
    x_cols = xq_ptr + token * stride_x + tl.zeros([1, COLS], dtype=tl.int64)
    acc_g = tl.zeros([BLOCK_N, COLS], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, COLS], dtype=tl.float32)
    for k0 in range(0, hidden, GROUP_K):
        k = k0 + ks
        k_ok = k < hidden
        w_ok = n_ok[:, None] & k_ok[None, :]
        g = tl.load(g_rows + k[None, :], mask=w_ok, other=0.0)
        u = tl.load(u_rows + k[None, :], mask=w_ok, other=0.0)
        x = tl.load(x_cols + k[:, None], mask=k_ok[:, None] & first[None, :], other=0.0)
        xs = tl.load(xs_ptr + token * stride_xs + k0 // GROUP_K)
        g_s = tl.load(gs_rows + k0 // GROUP_K, mask=n_ok, other=0.0)
        u_s = tl.load(us_rows + k0 // GROUP_K, mask=n_ok, other=0.0)
        acc_g += tl.dot(g, x) * (g_s * xs)[:, None]
        acc_u += tl.dot(u, x) * (u_s * xs)[:, None]
    # the zero columns add nothing: the sums are column 0
    h = _act(tl.sum(acc_g, axis=1), ACT) * tl.sum(acc_u, axis=1)
    tl.store(h_ptr + pair.to(tl.int64) * inter + offs_n, h, mask=n_ok)


@triton.jit(do_not_specialize=_ARGS)
def _decode_down_kernel(h_ptr, w2_ptr, ws_ptr, out_ptr, ids_ptr, weights_ptr, hidden, inter,
                        top_k, first_expert, num_local, stride_we, stride_wn,
                        TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                        GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, PDL: tl.constexpr):
    # [TOP_K, BLOCK_N, GROUPS, GROUP_K] weight tiles a step: GROUPS scale groups of I
    row = tl.program_id(0).to(tl.int64)
    offs_j = tl.arange(0, TOP_K)
    pair = row * top_k + offs_j
    # the ids and top-k weights are two kernels old: read before the gate, through L2
    mine, expert, weight = _down_row(ids_ptr, weights_ptr, pair, offs_j, top_k, first_expert,
                                     num_local, True)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    gs = tl.arange(0, GROUPS)
    ks = gs[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]  # [GROUPS, G] of a step
    step = GROUPS * GROUP_K
    w_ptrs = (w2_ptr + ((expert[:, None] * hidden + offs_n[None, :]) * inter)[:, :, None, None]
              + ks[None, None, :, :])
    w_ok = mine[:, None, None, None] & n_ok[None, :, None, None]
    w = tl.load(w_ptrs, mask=w_ok & (ks < inter)[None, None, :, :], other=0.0)
    pdl_gate(PDL)
    h_ptrs = h_ptr + pair[:, None, None] * inter + ks[None, :, :]
    s_ptrs = (ws_ptr + expert[:, None, None] * stride_we
              + (offs_n // GROUP_N)[None, :, None] * stride_wn)
    s_ok = mine[:, None, None] & n_ok[None, :, None]
    acc = tl.zeros([TOP_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, step):
        nk = k0 + step + ks
        w_next = tl.load(w_ptrs + k0 + step, mask=w_ok & (nk < inter)[None, None, :, :],
                         other=0.0)
        h = tl.load(h_ptrs + k0, mask=mine[:, None, None] & (k0 + ks < inter)[None, :, :],
                    other=0.0)
        # quantize_groups' codes x scales of each pair's groups, times its top-k weight
        hq = tl.reshape(quantized_groups(tl.reshape(h, [TOP_K * GROUPS, GROUP_K])),
                        [TOP_K, GROUPS, GROUP_K])
        hw = hq * weight[:, None, None]
        kb = k0 // GROUP_K + gs
        w_s = tl.load(s_ptrs + kb[None, None, :],
                      mask=s_ok & (kb * GROUP_K < inter)[None, None, :], other=0.0)
        acc += tl.sum(tl.sum(w.to(tl.float32) * hw[:, None, :, :], axis=3) * w_s, axis=2)
        w = w_next
    y = tl.sum(acc, 0)
    tl.store(out_ptr + row * hidden + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=_ARGS)
def _decode_down_mma_kernel(hq_ptr, hs_ptr, w2_ptr, ws_ptr, out_ptr, part_ptr, cnt_ptr, ids_ptr,
                            weights_ptr, hidden, inter, top_k, first_expert, num_local,
                            stride_hs, stride_we, stride_wn, BLOCK_N: tl.constexpr,
                            GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, COLS: tl.constexpr,
                            SPLIT: tl.constexpr, PDL: tl.constexpr):
    # program (row, BLOCK_N columns of H, part): the part's pairs of the row (j = part,
    # part + SPLIT, ...), each a group of I a step: the expert's weight rows the dot's M side
    # against the pair's quantized group of h (column 0 of a [G, COLS] tile, the rest
    # zeros); the parts' sums added in part order by the last to finish (gemm.split_sum)
    pdl_gate(PDL)  # h is the quantizer's output, and the split counters the kernel before's
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    part = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    ks = tl.arange(0, GROUP_K)
    first = tl.arange(0, COLS) == 0
    acc = tl.zeros([BLOCK_N, COLS], dtype=tl.float32)
    for j in range(part, top_k, SPLIT):
        pair = row.to(tl.int64) * top_k + j
        expert = tl.load(ids_ptr + pair) - first_expert  # id -1 gives < 0
        if (expert >= 0) & (expert < num_local):
            weight = tl.load(weights_ptr + pair).to(tl.float32)
            w_rows = w2_ptr + (expert.to(tl.int64) * hidden + offs_n)[:, None] * inter
            s_rows = ws_ptr + expert.to(tl.int64) * stride_we + (offs_n // GROUP_N) * stride_wn
            h_cols = hq_ptr + pair * inter + tl.zeros([1, COLS], dtype=tl.int64)
            for k0 in range(0, inter, GROUP_K):
                k = k0 + ks
                k_ok = k < inter
                w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                h = tl.load(h_cols + k[:, None], mask=k_ok[:, None] & first[None, :], other=0.0)
                h_s = tl.load(hs_ptr + pair * stride_hs + k0 // GROUP_K)
                w_s = tl.load(s_rows + k0 // GROUP_K, mask=n_ok, other=0.0)
                acc += tl.dot(w, h) * (w_s * (h_s * weight))[:, None]
    y = tl.sum(acc, axis=1)  # the zero columns add nothing
    last, y = split_sum(y, part_ptr, cnt_ptr, row * hidden + offs_n, n_ok,
                        row * tl.num_programs(1) + pid_n, part, tl.num_programs(0) * hidden,
                        SPLIT)
    if last:
        tl.store(out_ptr + row.to(tl.int64) * hidden + offs_n, y.to(out_ptr.dtype.element_ty),
                 mask=n_ok)


def decode_gate_up_fp8(x: torch.Tensor, x_scale: Optional[torch.Tensor], w13: torch.Tensor,
                       w13_s: torch.Tensor, ids_P: torch.Tensor, top_k: int, first_expert: int,
                       act: str, block: tuple[int, int], cfg: dict[str, Any],
                       ws: Optional[Workspace] = None) -> torch.Tensor:
    """h float32 [P, I]: x in bf16 or fp8 with its [N, ceil(H/G)] scales; rows of pairs this
    rank does not own are left unwritten (down skips them). cfg MMA: the MMA kernel, which
    takes the rows quantized (bf16 rows are quantized first, in a launch of their own, into
    the workspace's input records where it has them)."""
    num_local, two_i, hidden = w13.shape
    inter, group = two_i // 2, block[1]
    check_tiles(cfg, group, "decode gate_up", whole_groups=False, decode=True)
    pairs = ids_P.shape[0]
    h = take(ws and ws.act_f32, pairs, "act_f32", inter, dtype=torch.float32, device=x.device)
    if not pairs:
        return h
    grid = (pairs, triton.cdiv(inter, cfg["BLOCK_N"]))
    args = (h, ids_P, hidden, inter, top_k, first_expert, num_local)
    if cfg.get("MMA"):
        check_dot_k(x, block, "the MMA decode gate_up")
        xq, xs = (x, x_scale) if x_scale is not None else quantize_input(x, group, ws)
        _decode_gate_up_mma_kernel[grid](xq, xs, w13, w13_s, *args, xq.stride(0), xs.stride(0),
                                         w13_s.stride(0), w13_s.stride(1),
                                         ACT=ACT_CODES[act], BLOCK_N=cfg["BLOCK_N"],
                                         GROUP_N=block[0], GROUP_K=group, COLS=MMA_COLS,
                                         num_warps=cfg["num_warps"],
                                         num_stages=cfg["num_stages"], **pdl_args(x.device))
        return h
    quant = x_scale is None
    xs = x if quant else x_scale
    _decode_gate_up_kernel[grid](x, xs, w13, w13_s, *args, x.stride(0), xs.stride(0),
                                 w13_s.stride(0), w13_s.stride(1), ACT=ACT_CODES[act],
                                 BLOCK_N=cfg["BLOCK_N"], GROUPS=cfg["BLOCK_K"] // group,
                                 GROUP_N=block[0], GROUP_K=group, QUANT_X=quant,
                                 num_warps=cfg["num_warps"], **pdl_args(x.device))
    return h


def decode_down_fp8(h: torch.Tensor, w2: torch.Tensor, w2_s: torch.Tensor,
                    ids_P: torch.Tensor, weights_P: torch.Tensor, num_rows: int, top_k: int,
                    first_expert: int, block: tuple[int, int], cfg: dict[str, Any],
                    out_dtype: torch.dtype, ws: Optional[Workspace] = None) -> torch.Tensor:
    """h float32 [P, I]. cfg MMA: the MMA kernel, which takes h quantized (in a launch of its
    own, into the workspace's act records where it has them)."""
    num_local, hidden, inter = w2.shape
    check_tiles(cfg, block[1], "decode down", whole_groups=False, decode=True)
    out = torch.empty(num_rows, hidden, dtype=out_dtype, device=h.device)
    if num_rows and cfg.get("MMA"):
        check_dot_k(h, block, "the MMA decode down")
        hq, hs = quantize_act(h, block[1], ws)
        n_tiles = triton.cdiv(hidden, cfg["BLOCK_N"])
        split, part, cnt = split_buffers(h.device, down_split(num_rows * n_tiles, top_k,
                                                              _programs(h.device)),
                                         num_rows, hidden, num_rows * n_tiles)
        _decode_down_mma_kernel[(num_rows, n_tiles, split)](
            hq, hs, w2, w2_s, out, out if part is None else part, out if cnt is None else cnt,
            ids_P, weights_P, hidden, inter, top_k, first_expert, num_local, hs.stride(0),
            w2_s.stride(0), w2_s.stride(1), BLOCK_N=cfg["BLOCK_N"], GROUP_N=block[0],
            GROUP_K=block[1], COLS=MMA_COLS, SPLIT=split, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"], **pdl_args(h.device))
    elif num_rows:
        grid = (num_rows, triton.cdiv(hidden, cfg["BLOCK_N"]))
        _decode_down_kernel[grid](h, w2, w2_s, out, ids_P, weights_P, hidden, inter, top_k,
                                  first_expert, num_local, w2_s.stride(0), w2_s.stride(1),
                                  TOP_K=triton.next_power_of_2(top_k), BLOCK_N=cfg["BLOCK_N"],
                                  GROUPS=cfg["BLOCK_K"] // block[1], GROUP_N=block[0],
                                  GROUP_K=block[1],
                                  num_warps=cfg["num_warps"], **pdl_args(h.device))
    return out


def down_split(tiles: int, top_k: int, programs: int) -> int:
    """The parts the MMA down splits a row's top-k pairs into: as many pairs a part as keep
    2 programs an SM busy (tiles x parts >= 2 x programs), from one (a part a pair) up; 1 off
    a GPU (programs 0)."""
    if not programs:
        return 1
    per_part = max(1, -(-top_k * tiles // (2 * programs)))
    return -(-top_k // per_part)


def _programs(device: torch.device) -> int:
    return _sm_count(device.index or 0) if device.type == "cuda" else 0


def decode_experts_fp8(x: torch.Tensor, x_scale: Optional[torch.Tensor], w13: torch.Tensor,
                       w13_s: torch.Tensor, w2: torch.Tensor, w2_s: torch.Tensor,
                       ids_P: torch.Tensor, weights_P: torch.Tensor, top_k: int,
                       first_expert: int, act: str, block: tuple[int, int],
                       cfg: dict[str, Any], out_dtype: torch.dtype,
                       ws: Optional[Workspace] = None) -> torch.Tensor:
    """x: the rows in out_dtype, or fp8 beside their scales x_scale."""
    h = decode_gate_up_fp8(x, x_scale, w13, w13_s, ids_P, top_k, first_expert, act, block,
                           cfg["gate_up"], ws)
    return decode_down_fp8(h, w2, w2_s, ids_P, weights_P, x.shape[0], top_k, first_expert,
                           block, cfg["down"], out_dtype, ws)
