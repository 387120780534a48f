"""The MoE experts for a few rows (decode): no align step, no per-pair output, two launches.

Legend: N rows, K top-k, P = N K pairs, E local experts, H hidden, I intermediate (local).

    gate_up   h_PI[p] = act(x[p // K] . w13[e_p, i]) * (x[p // K] . w13[e_p, I + i])
              one program per (pair, BLOCK_N columns of I): a GEMV over the pair's expert
    down      out_NH[n] = sum over k of w_nk (h_PI[n K + k] . w2[e_nk])
              one program per (row, BLOCK_N columns of H) loads the tiles of all the row's
              experts together; the top-k sum happens in fp32 registers, then one rounding;
              no atomics, no [P, H] buffer, no separate pass

Pairs of other ranks and ids of -1 read nothing. Each pair streams its expert's weights once,
so two pairs of one expert read it twice: the path wins when the pairs of a step rarely share
an expert (one row never does: a row's top-k ids are distinct), and loses to the aligned
grouped GEMMs of fused_moe.py once they often do. kernels/configs.py chooses between them
(tuned per size by `python -m benchmarks tune-moe`, else by the expected sharing).

The products are fp32 multiply-adds on CUDA cores, not tensor-core MMAs: at a few rows a step
is bound by the weight bytes (2 H I per pair and projection), and the GEMV layout keeps every
loaded weight tile busy for all its bytes, where a 16-row MMA tile wastes 15/16 of its rows.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from moeserve.kernels.launch.pdl import pdl_args, pdl_gate
from moeserve.kernels.elementwise.act import ACT_CODES, _act
from moeserve.kernels.moe.align_torch import take

# runtime ints that change with the step or the rank are not specialised
_ARGS = ["top_k", "first_expert", "num_local"]


@triton.jit
def _gu_tiles(g_ptrs, u_ptrs, n_ok, offs_k, k_left, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tiles of both halves at this K chunk (k_left columns left)."""
    if EVEN_K:
        g = tl.load(g_ptrs, mask=n_ok[:, None], other=0.0)
        u = tl.load(u_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        ok = n_ok[:, None] & (offs_k < k_left)[None, :]
        g = tl.load(g_ptrs, mask=ok, other=0.0)
        u = tl.load(u_ptrs, mask=ok, other=0.0)
    return g, u


@triton.jit
def _x_chunk(x_ptrs, offs_k, k_left, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_ptrs).to(tl.float32)
    return tl.load(x_ptrs, mask=offs_k < k_left, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=_ARGS)
def _decode_gate_up_kernel(x_ptr, w13_ptr, h_ptr, ids_ptr, hidden, inter, top_k, first_expert,
                           num_local, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                           PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """PREFETCH: each K step loads the next chunk's tiles before it forms the products of
    the tiles it holds, so two chunks a program are in flight (Triton does not pipeline
    these FMA loops itself); the tables set it per size, where it measured faster."""
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
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PREFETCH:
        g, u = _gu_tiles(g_ptrs, u_ptrs, n_ok, offs_k, hidden, EVEN_K)
        for k0 in range(BLOCK_K, hidden, BLOCK_K):
            g_next, u_next = _gu_tiles(g_ptrs + k0, u_ptrs + k0, n_ok, offs_k, hidden - k0,
                                       EVEN_K)
            x = _x_chunk(x_ptrs + k0 - BLOCK_K, offs_k, hidden - k0 + BLOCK_K, EVEN_K)
            acc_g += g.to(tl.float32) * x[None, :]
            acc_u += u.to(tl.float32) * x[None, :]
            g, u = g_next, u_next
        last = (hidden - 1) // BLOCK_K * BLOCK_K
        x = _x_chunk(x_ptrs + last, offs_k, hidden - last, EVEN_K)
        acc_g += g.to(tl.float32) * x[None, :]
        acc_u += u.to(tl.float32) * x[None, :]
    else:
        for k0 in range(0, hidden, BLOCK_K):
            x = _x_chunk(x_ptrs, offs_k, hidden - k0, EVEN_K)
            g, u = _gu_tiles(g_ptrs, u_ptrs, n_ok, offs_k, hidden - k0, EVEN_K)
            acc_g += g.to(tl.float32) * x[None, :]
            acc_u += u.to(tl.float32) * x[None, :]
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    h = _act(tl.sum(acc_g, 1), ACT) * tl.sum(acc_u, 1)
    tl.store(h_ptr + pair.to(tl.int64) * inter + offs_n, h.to(h_ptr.dtype.element_ty),
             mask=n_ok)


@triton.jit
def _down_row(ids_ptr, weights_ptr, pair, offs_j, top_k, first_expert, num_local,
              CG: tl.constexpr):
    """(whether each of the row's pairs is this rank's, its local expert, its top-k weight);
    CG: read through L2 only (.cg)."""
    if CG:
        expert = tl.load(ids_ptr + pair, mask=offs_j < top_k, other=-1, cache_modifier=".cg")
    else:
        expert = tl.load(ids_ptr + pair, mask=offs_j < top_k, other=-1)
    expert -= first_expert
    mine = (offs_j < top_k) & (expert >= 0) & (expert < num_local)  # masked loads read nothing
    if CG:
        weight = tl.load(weights_ptr + pair, mask=mine, other=0.0, cache_modifier=".cg")
    else:
        weight = tl.load(weights_ptr + pair, mask=mine, other=0.0)
    return mine, tl.where(mine, expert, 0).to(tl.int64), weight.to(tl.float32)


@triton.jit
def _w_tile(w_ptrs, w_ok, offs_k, k_left, EVEN_K: tl.constexpr):
    """The [TOP_K, BLOCK_N, BLOCK_K] weight tiles of the row's experts at this K chunk."""
    if EVEN_K:
        return tl.load(w_ptrs, mask=w_ok, other=0.0)
    return tl.load(w_ptrs, mask=w_ok & (offs_k < k_left)[None, None, :], other=0.0)


@triton.jit
def _h_chunk(h_ptrs, mine, offs_k, k_left, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(h_ptrs, mask=mine[:, None], other=0.0)
    return tl.load(h_ptrs, mask=mine[:, None] & (offs_k < k_left)[None, :], other=0.0)


@triton.jit
def _down_product(acc, w, h, weight):
    """acc += the weight tiles times the pairs' h chunk, scaled by their top-k weights."""
    hw = h.to(tl.float32) * weight[:, None]
    return acc + w.to(tl.float32) * hw[:, None, :]


@triton.jit(do_not_specialize=_ARGS)
def _decode_down_kernel(h_ptr, w2_ptr, out_ptr, ids_ptr, weights_ptr, hidden, inter, top_k,
                        first_expert, num_local, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EARLY: tl.constexpr,
                        PDL: tl.constexpr):
    """Each K chunk loads the tiles of all the row's experts at once ([TOP_K, BLOCK_N,
    BLOCK_K]): top_k times the bytes in flight of a loop over the experts, a third of the
    round trips at Qwen3's I = 768.

    EARLY: the ids and top-k weights, and the first chunk's weight tiles, are read before the
    PDL gate, so that the tiles stream in while gate_up finishes. The ids come from the
    router's top-k, two kernels back: gate_up's programs pass their gate only once it has
    finished, and this kernel is placed only after all of them have, so its writes are
    visible; they are read from L2 (.cg), never from a stale L1 line. h, gate_up's output,
    is read after the gate."""
    if not EARLY:
        pdl_gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_j = tl.arange(0, TOP_K)
    pair = row * top_k + offs_j
    mine, expert, weight = _down_row(ids_ptr, weights_ptr, pair, offs_j, top_k, first_expert,
                                     num_local, EARLY)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pair[:, None] * inter + offs_k[None, :]
    w_ptrs = (w2_ptr + ((expert[:, None] * hidden + offs_n[None, :]) * inter)[:, :, None]
              + offs_k[None, None, :])
    w_ok = mine[:, None, None] & n_ok[None, :, None]
    acc = tl.zeros((TOP_K, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if EARLY:  # the first chunk's tiles before the gate; then each K step loads the next
        # chunk's tiles before it forms the products of the ones it holds (two in flight)
        w = _w_tile(w_ptrs, w_ok, offs_k, inter, EVEN_K)
        pdl_gate(PDL)
        for k0 in range(BLOCK_K, inter, BLOCK_K):
            w_next = _w_tile(w_ptrs + k0, w_ok, offs_k, inter - k0, EVEN_K)
            h = _h_chunk(h_ptrs + k0 - BLOCK_K, mine, offs_k, inter - k0 + BLOCK_K, EVEN_K)
            acc = _down_product(acc, w, h, weight)
            w = w_next
        last = (inter - 1) // BLOCK_K * BLOCK_K
        acc = _down_product(acc, w, _h_chunk(h_ptrs + last, mine, offs_k, inter - last,
                                             EVEN_K), weight)
    else:
        for k0 in range(0, inter, BLOCK_K):
            h = _h_chunk(h_ptrs, mine, offs_k, inter - k0, EVEN_K)
            w = _w_tile(w_ptrs, w_ok, offs_k, inter - k0, EVEN_K)
            acc = _down_product(acc, w, h, weight)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    y = tl.sum(tl.sum(acc, 2), 0)
    tl.store(out_ptr + row * hidden + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


# the first chunk's tiles are held in registers across the gate only when they are at most
# this many elements per thread: larger ones cost more occupancy than the head start buys
# (H200, Qwen3-30B-A3B, batch 8 with [8, 16, 64] tiles: graph replay 8.19 -> 8.39 ms)
EARLY_TILE_PER_THREAD = 16


def _opts(cfg: dict[str, Any], k_size: int) -> dict[str, Any]:
    """Launch options. num_stages (optional in the tables) is passed on to Triton, which
    compiles the same code for these FMA loops at 1, 2 and 3 (sm90 PTX compared), so the
    tuner does not sweep it."""
    return {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
            "EVEN_K": k_size % cfg["BLOCK_K"] == 0, "num_warps": cfg["num_warps"],
            "num_stages": cfg.get("num_stages", 3)}


def decode_gate_up(x_NH: torch.Tensor, w13: torch.Tensor, ids_P: torch.Tensor, top_k: int,
                   first_expert: int, act: str, cfg: dict[str, Any],
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h [P, I] (the first P rows of `out` when given); rows of pairs this rank does not own
    are left unwritten (down skips them)."""
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    pairs = ids_P.shape[0]
    h = take(out, pairs, "act", inter, dtype=x_NH.dtype, device=x_NH.device)
    if pairs:
        grid = (pairs, triton.cdiv(inter, cfg["BLOCK_N"]))
        _decode_gate_up_kernel[grid](x_NH, w13, h, ids_P, hidden, inter, top_k, first_expert,
                                     num_local, ACT=ACT_CODES[act],
                                     PREFETCH=bool(cfg.get("PREFETCH")), **_opts(cfg, hidden),
                                     **pdl_args(x_NH.device))
    return h


def decode_down(h_PI: torch.Tensor, w2: torch.Tensor, ids_P: torch.Tensor,
                weights_P: torch.Tensor, num_rows: int, top_k: int, first_expert: int,
                cfg: dict[str, Any]) -> torch.Tensor:
    num_local, hidden, inter = w2.shape
    out = torch.empty(num_rows, hidden, dtype=h_PI.dtype, device=h_PI.device)
    if num_rows:
        grid = (num_rows, triton.cdiv(hidden, cfg["BLOCK_N"]))
        top = triton.next_power_of_2(top_k)
        early = (top * cfg["BLOCK_N"] * cfg["BLOCK_K"]
                 <= EARLY_TILE_PER_THREAD * 32 * cfg["num_warps"])
        _decode_down_kernel[grid](h_PI, w2, out, ids_P, weights_P, hidden, inter, top_k,
                                  first_expert, num_local, TOP_K=top, EARLY=early,
                                  **_opts(cfg, inter), **pdl_args(h_PI.device))
    return out


def decode_experts(x_NH: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   ids_P: torch.Tensor, weights_P: torch.Tensor, top_k: int, first_expert: int,
                   act: str, cfg: dict[str, Any],
                   h_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sum_k w_k expert_k(x) over this rank's pairs; ids_P int32 and weights_P float32, both
    contiguous [N K]; cfg holds "gate_up" and "down" tiles (BLOCK_N, BLOCK_K, num_warps); the
    intermediate in `h_out` when given."""
    h = decode_gate_up(x_NH, w13, ids_P, top_k, first_expert, act, cfg["gate_up"], h_out)
    return decode_down(h, w2, ids_P, weights_P, x_NH.shape[0], top_k, first_expert, cfg["down"])
