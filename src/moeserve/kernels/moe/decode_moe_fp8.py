"""The MoE experts for a few rows with block-scaled FP8 weights: decode_moe.py's two GEMV
launches with fp8 operands (legend as there and in fused_moe_fp8.py).

    gate_up   one program per (pair, BLOCK_N columns of I): per K step (BLOCK_K divides G)
                acc += w13q[e, n, k] * (xq[tok, k] xs[tok, kb]) * w13_s[e, n // bn, kb]
              then act(gate) * up, quantized per G columns in the epilogue (BLOCK_N a
              multiple of G): h fp8 [P, I] beside hs [P, ceil(I/G)]; or (BLOCK_N < G, a
              divisor of it) stored in float32 and quantized by quantize_groups after it:
              at one row a tile of whole groups leaves most SMs idle (P I / G programs,
              48 for Qwen3-30B-A3B), the split one streams the weights on all of them
    down      one program per (row, BLOCK_N columns of H), the tiles of all the row's experts
              at once: acc += w2q * (hq hs w_k) * w2_s; the top-k sum in registers

The input rows arrive quantized (fused_moe_fp8.fused_experts_fp8 quantizes them once). As in
decode_moe.py the products are fp32 multiply-adds on CUDA cores: at a few rows the step is
bound by the weight bytes, which fp8 halves.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from moeserve.kernels.elementwise.act import ACT_CODES, _act
from moeserve.kernels.fp8.gemm import quantize_groups
from moeserve.kernels.launch.pdl import pdl_args, pdl_gate
from moeserve.kernels.moe.align_torch import Workspace, take
from moeserve.kernels.moe.decode_moe import (_ARGS, _down_row, _gu_tiles, _h_chunk, _opts,
                                             _w_tile, _x_chunk)
from moeserve.kernels.moe.fp8_tiles import FP8, check_tiles, quantize_rows


@triton.jit
def _gu_step(acc_g, acc_u, g, u, x_ptrs, xs_ptr, gs_ptrs, us_ptrs, token, stride_xs, n_ok,
             offs_k, k0, hidden, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The products of the weight tiles g, u at K chunk k0 with the row's chunk, each scaled
    by its groups' scales."""
    kb = k0 // GROUP_K
    x = _x_chunk(x_ptrs + k0, offs_k, hidden - k0, EVEN_K) * tl.load(xs_ptr + token * stride_xs
                                                                      + kb)
    g_s = tl.load(gs_ptrs + kb, mask=n_ok, other=0.0)
    u_s = tl.load(us_ptrs + kb, mask=n_ok, other=0.0)
    acc_g += g.to(tl.float32) * x[None, :] * g_s[:, None]
    acc_u += u.to(tl.float32) * x[None, :] * u_s[:, None]
    return acc_g, acc_u


@triton.jit(do_not_specialize=_ARGS)
def _decode_gate_up_kernel(x_ptr, xs_ptr, w13_ptr, ws_ptr, h_ptr, hs_ptr, ids_ptr, hidden, inter,
                           top_k, first_expert, num_local, stride_xs, stride_we, stride_wn,
                           stride_hs, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                           EVEN_K: tl.constexpr, QUANT: tl.constexpr, PREFETCH: tl.constexpr,
                           PDL: tl.constexpr):
    pdl_gate(PDL)
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair) - first_expert  # id -1 gives < 0: first_expert >= 0
    if (expert < 0) | (expert >= num_local):
        return
    token = (pair // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * hidden + offs_k
    g_ptrs = (w13_ptr + expert.to(tl.int64) * 2 * inter * hidden
              + offs_n[:, None].to(tl.int64) * hidden + offs_k[None, :])
    u_ptrs = g_ptrs + inter * hidden
    s_base = ws_ptr + expert.to(tl.int64) * stride_we
    gs_ptrs = s_base + (offs_n // GROUP_N) * stride_wn
    us_ptrs = s_base + ((inter + offs_n) // GROUP_N) * stride_wn
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PREFETCH:  # as decode_moe.py's: the next chunk's tiles load before these products
        g, u = _gu_tiles(g_ptrs, u_ptrs, n_ok, offs_k, hidden, EVEN_K)
        for k0 in range(BLOCK_K, hidden, BLOCK_K):
            g_next, u_next = _gu_tiles(g_ptrs + k0, u_ptrs + k0, n_ok, offs_k, hidden - k0,
                                       EVEN_K)
            acc_g, acc_u = _gu_step(acc_g, acc_u, g, u, x_ptrs, xs_ptr, gs_ptrs, us_ptrs,
                                    token, stride_xs, n_ok, offs_k, k0 - BLOCK_K, hidden,
                                    GROUP_K, EVEN_K)
            g, u = g_next, u_next
        last = (hidden - 1) // BLOCK_K * BLOCK_K
        acc_g, acc_u = _gu_step(acc_g, acc_u, g, u, x_ptrs, xs_ptr, gs_ptrs, us_ptrs, token,
                                stride_xs, n_ok, offs_k, last, hidden, GROUP_K, EVEN_K)
    else:
        for k0 in range(0, hidden, BLOCK_K):
            g, u = _gu_tiles(g_ptrs + k0, u_ptrs + k0, n_ok, offs_k, hidden - k0, EVEN_K)
            acc_g, acc_u = _gu_step(acc_g, acc_u, g, u, x_ptrs, xs_ptr, gs_ptrs, us_ptrs,
                                    token, stride_xs, n_ok, offs_k, k0, hidden, GROUP_K,
                                    EVEN_K)
    h = _act(tl.sum(acc_g, 1), ACT) * tl.sum(acc_u, 1)
    row = pair.to(tl.int64)
    if QUANT:
        q, scale = quantize_rows(h[None, :], 1, BLOCK_N, GROUP_K)
        tl.store(h_ptr + row * inter + offs_n,
                 tl.reshape(q, (BLOCK_N,)).to(h_ptr.dtype.element_ty), mask=n_ok)
        groups = tl.program_id(1) * (BLOCK_N // GROUP_K) + tl.arange(0, BLOCK_N // GROUP_K)
        tl.store(hs_ptr + row * stride_hs + groups, tl.reshape(scale, (BLOCK_N // GROUP_K,)),
                 mask=groups * GROUP_K < inter)
    else:  # h_ptr: the float32 product, quantized by the caller
        tl.store(h_ptr + row * inter + offs_n, h, mask=n_ok)


@triton.jit(do_not_specialize=_ARGS)
def _decode_down_kernel(h_ptr, hs_ptr, w2_ptr, ws_ptr, out_ptr, ids_ptr, weights_ptr, hidden,
                        inter, top_k, first_expert, num_local, stride_hs, stride_we, stride_wn,
                        TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_j = tl.arange(0, TOP_K)
    pair = row * top_k + offs_j
    mine, expert, weight = _down_row(ids_ptr, weights_ptr, pair, offs_j, top_k, first_expert,
                                     num_local, False)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pair[:, None] * inter + offs_k[None, :]
    hs_ptrs = hs_ptr + pair * stride_hs
    w_ptrs = (w2_ptr + ((expert[:, None] * hidden + offs_n[None, :]) * inter)[:, :, None]
              + offs_k[None, None, :])
    s_ptrs = ws_ptr + expert[:, None] * stride_we + (offs_n // GROUP_N)[None, :] * stride_wn
    w_ok = mine[:, None, None] & n_ok[None, :, None]
    s_ok = mine[:, None] & n_ok[None, :]
    acc = tl.zeros((TOP_K, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kb = k0 // GROUP_K
        h = _h_chunk(h_ptrs, mine, offs_k, inter - k0, EVEN_K).to(tl.float32)
        hw = h * (tl.load(hs_ptrs + kb, mask=mine, other=0.0) * weight)[:, None]
        w = _w_tile(w_ptrs, w_ok, offs_k, inter - k0, EVEN_K)
        w_s = tl.load(s_ptrs + kb, mask=s_ok, other=0.0)
        acc += w.to(tl.float32) * hw[:, None, :] * w_s[:, :, None]
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(tl.sum(acc, 2), 0)
    tl.store(out_ptr + row * hidden + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def decode_gate_up_fp8(xq: torch.Tensor, xs: torch.Tensor, w13: torch.Tensor,
                       w13_s: torch.Tensor, ids_P: torch.Tensor, top_k: int, first_expert: int,
                       act: str, block: tuple[int, int], cfg: dict[str, Any],
                       ws: Optional[Workspace] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h fp8 [P, I], hs [P, ceil(I/G)]); rows of pairs this rank does not own are left
    unwritten (down skips them)."""
    num_local, two_i, hidden = w13.shape
    inter, group = two_i // 2, block[1]
    check_tiles(cfg, group, "decode gate_up", whole_groups=True, split=True)
    pairs = ids_P.shape[0]
    h = take(ws and ws.act, pairs, "act", inter, dtype=FP8, device=xq.device)
    hs = take(ws and ws.act_scale, pairs, "act_scale", triton.cdiv(inter, group),
              dtype=torch.float32, device=xq.device)
    if pairs:
        quant = cfg["BLOCK_N"] % group == 0
        dst = h if quant else take(ws and ws.act_f32, pairs, "act_f32", inter,
                                   dtype=torch.float32, device=xq.device)
        grid = (pairs, triton.cdiv(inter, cfg["BLOCK_N"]))
        _decode_gate_up_kernel[grid](xq, xs, w13, w13_s, dst, hs, ids_P, hidden, inter, top_k,
                                     first_expert, num_local, xs.stride(0), w13_s.stride(0),
                                     w13_s.stride(1), hs.stride(0), ACT=ACT_CODES[act],
                                     GROUP_N=block[0], GROUP_K=group, QUANT=quant,
                                     PREFETCH=bool(cfg.get("PREFETCH")), **_opts(cfg, hidden),
                                     **pdl_args(xq.device))
        if not quant:  # rows of pairs this rank does not own: garbage that down skips
            quantize_groups(dst, group, out=(h, hs))
    return h, hs


def decode_down_fp8(h: torch.Tensor, hs: torch.Tensor, w2: torch.Tensor, w2_s: torch.Tensor,
                    ids_P: torch.Tensor, weights_P: torch.Tensor, num_rows: int, top_k: int,
                    first_expert: int, block: tuple[int, int], cfg: dict[str, Any],
                    out_dtype: torch.dtype) -> torch.Tensor:
    num_local, hidden, inter = w2.shape
    check_tiles(cfg, block[1], "decode down", whole_groups=False)
    out = torch.empty(num_rows, hidden, dtype=out_dtype, device=h.device)
    if num_rows:
        grid = (num_rows, triton.cdiv(hidden, cfg["BLOCK_N"]))
        _decode_down_kernel[grid](h, hs, w2, w2_s, out, ids_P, weights_P, hidden, inter, top_k,
                                  first_expert, num_local, hs.stride(0), w2_s.stride(0),
                                  w2_s.stride(1), TOP_K=triton.next_power_of_2(top_k),
                                  GROUP_N=block[0], GROUP_K=block[1], **_opts(cfg, inter),
                                  **pdl_args(h.device))
    return out


def decode_experts_fp8(xq: torch.Tensor, xs: torch.Tensor, w13: torch.Tensor,
                       w13_s: torch.Tensor, w2: torch.Tensor, w2_s: torch.Tensor,
                       ids_P: torch.Tensor, weights_P: torch.Tensor, top_k: int,
                       first_expert: int, act: str, block: tuple[int, int],
                       cfg: dict[str, Any], out_dtype: torch.dtype,
                       ws: Optional[Workspace] = None) -> torch.Tensor:
    h, hs = decode_gate_up_fp8(xq, xs, w13, w13_s, ids_P, top_k, first_expert, act, block,
                               cfg["gate_up"], ws)
    return decode_down_fp8(h, hs, w2, w2_s, ids_P, weights_P, xq.shape[0], top_k, first_expert,
                           block, cfg["down"], out_dtype)
