"""The fused MoE experts in Triton: align, two grouped GEMMs, the top-k sum (4 launches); a
config with a "decode" entry takes the two GEMV launches of decode_moe.py instead.

Legend: N rows, K top-k, P = N K pairs, E local experts, H hidden, I intermediate (this rank's
moe_tp shard), B aligned blocks of BLOCK_M rows (align_torch.py).

    align        pairs grouped by local expert, each expert's segment padded to BLOCK_M
    gate_up      h_BI[b, i] = act(x[tok] . w13[e, i]) * (x[tok] . w13[e, I + i])  (rows in
                 block order; both halves of w13 in one program, so act-and-mul is fused)
    down         y_PH[p] = weight_p * (h[row of p] . w2[e])  (written at the pair's own slot;
                 with "WS" on sm90, by the warp-specialised Gluon kernel of down_ws.py)
    top-k sum    out_NH[n] = sum over the pairs of row n that this rank owns of y_PH[p]

With "HALF_TAIL" in a GEMM's config, a block of at most BLOCK_M / 2 rows (an expert's last,
the only one that can be partly empty) runs a tile of half the rows: at 512 rows an expert
and BLOCK_M 128, about half the experts end in a block of a few rows, which would otherwise
cost a whole tile of MMAs. The kernel then holds both tile shapes, which can slow its full
tiles: the tuner sets it per GEMM and size only where it measured faster.

A program whose block belongs to no expert returns before loading anything, so only the
experts that some pair uses are read. The grid is sized from max_blocks(P), a bound that
depends on shapes alone: nothing is read back to the host and the whole thing can be captured
in a CUDA graph. The top-k sum is a separate pass over y_PH, in fp32 with one rounding, and
every run of the same input gives the same bits; with "ATOMIC_SUM" in down's config
(down_summed) down's tiles add their rows into a zeroed [N, H] output with atomics of the
model's dtype instead: no [P, H] round trip through HBM (at 8192 tokens of Qwen3-30B-A3B the
pass reads 268 MB, 74 us on an H200), but each add rounds, and in an order that varies, so
runs of the same input may differ in the last bits. The tuner sets it where it measured
faster.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from moeserve.kernels.launch.pdl import pdl_args, pdl_gate
from moeserve.kernels.elementwise.act import ACT_CODES, _act
from moeserve.kernels.moe import down_ws
from moeserve.kernels.moe.align import align_triton
from moeserve.kernels.moe.align_torch import Workspace, take
from moeserve.kernels.moe.configs import MIN_TILE_M
from moeserve.kernels.moe.decode_moe import decode_experts
from moeserve.kernels.launch.choice import interpreting


@triton.jit
def _tile_of(num_blocks, n_size, block_expert_ptr, block_rows_ptr, BLOCK_N: tl.constexpr,
             GROUP_M, PDL: tl.constexpr):
    """Program id -> (block, n tile, the block's expert (-1: an unused block), its rows),
    read past the PDL gate (the align before this kernel wrote them); GROUP_M consecutive
    blocks share their weight tiles in L2."""
    pdl_gate(PDL)
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_size, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n, tl.load(block_expert_ptr + pid_m), tl.load(block_rows_ptr + pid_m)


@triton.jit
def _block_pairs(sorted_ptr, row0, rows, M: tl.constexpr):
    """The first M row offsets of the block at grouped row row0, which of them hold a pair
    (the block has `rows`), and those pairs' ids."""
    offs_m = tl.arange(0, M)
    row_ok = offs_m < rows
    pair = tl.load(sorted_ptr + row0 + offs_m, mask=row_ok, other=0)
    return offs_m, row_ok, pair


@triton.jit
def _weight_tile(w, ptrs, expert, row0, k0, k_left, n_ok, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] MMA operand of rows row0.. of expert's weight, columns k0..: a TMA
    load through the [E, rows, K] descriptor `w` (zero past the edges), or pointer loads."""
    if TMA:
        tile = w.load([expert, row0, k0]).reshape(BLOCK_N, BLOCK_K).T
    elif EVEN_K:
        tile = tl.load(ptrs, mask=n_ok[None, :], other=0.0)
    else:
        k_ok = tl.arange(0, BLOCK_K) < k_left
        tile = tl.load(ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    return tile


@triton.jit
def _row_tile(ptrs, row_ok, k_left, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    if EVEN_K:
        tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        k_ok = tl.arange(0, BLOCK_K) < k_left
        tile = tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return tile


@triton.jit
def _gate_up_tile(x_ptr, w13_ptr, h_ptr, sorted_ptr, expert, row0, rows, pid_n, hidden, inter,
                  top_k, ACT: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                  PAIRED: tl.constexpr):
    """The first M rows of the block at row0 against BLOCK_N columns of both halves of w13."""
    offs_m, row_ok, pair = _block_pairs(sorted_ptr, row0, rows, M)
    token = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * hidden + offs_k[None, :]
    if TMA:  # w13_ptr is a TensorDescriptor of [E, 2I, H]
        g_ptrs = 0
    else:
        w_base = w13_ptr + expert.to(tl.int64) * (2 * inter) * hidden
        g_ptrs = w_base + offs_n[None, :].to(tl.int64) * hidden + offs_k[:, None]
    if PAIRED:  # w13_ptr is a [E, 2, I, H] descriptor: both halves' rows in one MMA operand
        acc = tl.zeros((M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            a = _row_tile(a_ptrs, row_ok, hidden - k0, BLOCK_K, EVEN_K)
            w = w13_ptr.load([expert, 0, pid_n * BLOCK_N, k0]).reshape(2 * BLOCK_N, BLOCK_K)
            acc = tl.dot(a, w.T, acc)
            a_ptrs += BLOCK_K
        acc_g, acc_u = acc.reshape(M, 2, BLOCK_N).permute(0, 2, 1).split()
    else:
        acc_g = tl.zeros((M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            a = _row_tile(a_ptrs, row_ok, hidden - k0, BLOCK_K, EVEN_K)
            g = _weight_tile(w13_ptr, g_ptrs, expert, pid_n * BLOCK_N, k0, hidden - k0, n_ok,
                             BLOCK_N, BLOCK_K, TMA, EVEN_K)
            u = _weight_tile(w13_ptr, g_ptrs + inter * hidden, expert, inter + pid_n * BLOCK_N,
                             k0, hidden - k0, n_ok, BLOCK_N, BLOCK_K, TMA, EVEN_K)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
    h = (_act(acc_g, ACT) * acc_u).to(h_ptr.dtype.element_ty)
    row = (row0 + offs_m).to(tl.int64)
    tl.store(h_ptr + row[:, None] * inter + offs_n[None, :], h,
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_blocks", "top_k", "GROUP_M"])
def _gate_up_kernel(x_ptr, w13_ptr, h_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr,
                    num_blocks, hidden, inter, top_k, GROUP_M,
                    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                    HALF_TAIL: tl.constexpr, PAIRED: tl.constexpr, PDL: tl.constexpr):
    """HALF_TAIL: a block of at most BLOCK_M / 2 rows takes a tile of half the rows (one kernel
    with both tile shapes, so the tail shares its expert's weight tiles in L2 with the
    expert's other blocks; a second launch for the tails re-read them from HBM and ran up to
    30% slower on the H200)."""
    pid_m, pid_n, expert, rows = _tile_of(num_blocks, inter, block_expert_ptr, block_rows_ptr,
                                          BLOCK_N, GROUP_M, PDL)
    if expert < 0:
        return
    if HALF_TAIL and rows <= BLOCK_M // 2:
        _gate_up_tile(x_ptr, w13_ptr, h_ptr, sorted_ptr, expert, pid_m * BLOCK_M, rows, pid_n,
                      hidden, inter, top_k, ACT, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, TMA,
                      PAIRED)
    else:
        _gate_up_tile(x_ptr, w13_ptr, h_ptr, sorted_ptr, expert, pid_m * BLOCK_M, rows, pid_n,
                      hidden, inter, top_k, ACT, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA, PAIRED)


@triton.jit
def _store_down(acc, y_ptr, topk_weights_ptr, pair, row_ok, offs_n, n_ok, hidden, top_k,
                ATOMIC_SUM: tl.constexpr):
    """down's epilogue: each row of acc scaled by its pair's top-k weight, written at the
    pair's slot (ATOMIC_SUM: added into its token's row of the zeroed [N, H] output)."""
    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    y = (acc * weight[:, None]).to(y_ptr.dtype.element_ty)
    ok = row_ok[:, None] & n_ok[None, :]
    if ATOMIC_SUM:
        token = (pair // top_k).to(tl.int64)
        tl.atomic_add(y_ptr + token[:, None] * hidden + offs_n[None, :], y, mask=ok,
                      sem="relaxed")
    else:
        tl.store(y_ptr + pair.to(tl.int64)[:, None] * hidden + offs_n[None, :], y, mask=ok)


@triton.jit
def _down_tile(h_ptr, w2_ptr, y_ptr, sorted_ptr, topk_weights_ptr, expert, row0, rows, pid_n,
               hidden, inter, top_k, M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
               ATOMIC_SUM: tl.constexpr):
    """The first M rows of the block at row0 against BLOCK_N rows of w2, each row scaled by
    its pair's top-k weight and written at the pair's slot (ATOMIC_SUM: added into its
    token's row of the zeroed [N, H] output)."""
    offs_m, row_ok, pair = _block_pairs(sorted_ptr, row0, rows, M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    row = (row0 + offs_m).to(tl.int64)
    a_ptrs = h_ptr + row[:, None] * inter + offs_k[None, :]
    if TMA:  # w2_ptr is a TensorDescriptor of [E, H, I]
        b_ptrs = 0
    else:
        b_ptrs = (w2_ptr + expert.to(tl.int64) * hidden * inter
                  + offs_n[None, :].to(tl.int64) * inter + offs_k[:, None])
    acc = tl.zeros((M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        a = _row_tile(a_ptrs, row_ok, inter - k0, BLOCK_K, EVEN_K)
        b = _weight_tile(w2_ptr, b_ptrs, expert, pid_n * BLOCK_N, k0, inter - k0, n_ok,
                         BLOCK_N, BLOCK_K, TMA, EVEN_K)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    _store_down(acc, y_ptr, topk_weights_ptr, pair, row_ok, offs_n, n_ok, hidden, top_k,
                ATOMIC_SUM)


@triton.jit(do_not_specialize=["num_blocks", "top_k", "GROUP_M"])
def _down_kernel(h_ptr, w2_ptr, y_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr,
                 topk_weights_ptr, num_blocks, hidden, inter, top_k, GROUP_M,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, TMA: tl.constexpr, HALF_TAIL: tl.constexpr,
                 ATOMIC_SUM: tl.constexpr, PDL: tl.constexpr):
    pid_m, pid_n, expert, rows = _tile_of(num_blocks, hidden, block_expert_ptr, block_rows_ptr,
                                          BLOCK_N, GROUP_M, PDL)
    if expert < 0:
        return
    if HALF_TAIL and rows <= BLOCK_M // 2:
        _down_tile(h_ptr, w2_ptr, y_ptr, sorted_ptr, topk_weights_ptr, expert, pid_m * BLOCK_M,
                   rows, pid_n, hidden, inter, top_k, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K,
                   TMA, ATOMIC_SUM)
    else:
        _down_tile(h_ptr, w2_ptr, y_ptr, sorted_ptr, topk_weights_ptr, expert, pid_m * BLOCK_M,
                   rows, pid_n, hidden, inter, top_k, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA,
                   ATOMIC_SUM)


@triton.jit(do_not_specialize=["first_expert", "num_local"])
def _topk_sum_kernel(y_ptr, ids_ptr, out_ptr, hidden, first_expert, num_local,
                     TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_gate(PDL)
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        # unrolled, each pair's row loaded whatever its expert, so that no load waits for an
        # id's (a loop of dependent loads costs a memory latency a pair); a pair of another
        # rank's expert then adds 0, as the masked load's 0 did
        v = tl.load(y_ptr + (n * TOP_K + k) * hidden + offs_h, mask=h_ok, other=0.0)
        local = tl.load(ids_ptr + n * TOP_K + k) - first_expert
        mine = (local >= 0) & (local < num_local)  # -1 is never mine: first_expert >= 0
        acc += tl.where(mine, v.to(tl.float32), 0.0)
    tl.store(out_ptr + n * hidden + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def _launch_opts(cfg: dict[str, Any], block_m: int) -> dict[str, Any]:
    half_tail = bool(cfg.get("HALF_TAIL"))
    if half_tail and block_m < 2 * MIN_TILE_M:
        raise ValueError(f"HALF_TAIL needs BLOCK_M >= {2 * MIN_TILE_M} (got {block_m}): a "
                         f"half tile is an MMA of at least {MIN_TILE_M} rows")
    return {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
            "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
            "BLOCK_M": block_m, "HALF_TAIL": half_tail}


def _tma_ok(w: torch.Tensor) -> bool:
    """TMA needs sm90+ (or the interpreter), 16-byte aligned rows, a contiguous weight."""
    if not w.is_contiguous() or (w.shape[-1] * w.element_size()) % 16 or w.data_ptr() % 16:
        return False
    if interpreting():
        return True
    return w.is_cuda and torch.cuda.get_device_capability(w.device)[0] >= 9


def _weights_arg(w: torch.Tensor, cfg: dict[str, Any]) -> tuple[Any, bool]:
    """The kernel's weight argument: a [1, BLOCK_N, BLOCK_K]-block TMA descriptor of the
    [E, rows, K] weight when the config asks for TMA and the device has it, else the tensor."""
    if not cfg.get("TMA") or not _tma_ok(w):
        return w, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    block = [1] * (w.dim() - 2) + [cfg["BLOCK_N"], cfg["BLOCK_K"]]
    if w.dim() == 4:  # w13 as [E, 2, I, H]: a tile holds BLOCK_N rows of each half
        block[1] = 2
    return TensorDescriptor.from_tensor(w, block), True


def gate_up(x_NH, w13, blocks, top_k: int, act: str, cfg: dict[str, Any],
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    h = take(out, blocks.num_blocks * blocks.block_m, "act", inter, dtype=x_NH.dtype,
             device=x_NH.device)
    if blocks.num_blocks == 0:
        return h
    grid = (blocks.num_blocks * triton.cdiv(inter, cfg["BLOCK_N"]),)
    paired = bool(cfg.get("PAIRED") and cfg.get("TMA")) and _tma_ok(w13)
    w_arg, tma = _weights_arg(w13.view(num_local, 2, inter, hidden) if paired else w13, cfg)
    _gate_up_kernel[grid](x_NH, w_arg, h, blocks.sorted_pairs, blocks.block_expert,
                          blocks.block_rows, blocks.num_blocks, hidden, inter, top_k,
                          cfg["GROUP_M"], ACT=ACT_CODES[act], EVEN_K=hidden % cfg["BLOCK_K"] == 0,
                          TMA=tma, PAIRED=paired, **_launch_opts(cfg, blocks.block_m),
                          **pdl_args(x_NH.device))
    return h


def down(h, w2, blocks, topk_weights_P: torch.Tensor, num_pairs: int,
         cfg: dict[str, Any], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y_PH: each pair's weighted output at its own slot (the top-k sum is topk_sum's)."""
    y = take(out, num_pairs, "down", w2.shape[1], dtype=h.dtype, device=h.device)
    if blocks.num_blocks:
        _down_launch(h, w2, blocks, topk_weights_P, y, 1, cfg, atomic=False)
    return y


def down_summed(h, w2, blocks, topk_weights_P: torch.Tensor, num_rows: int, top_k: int,
                cfg: dict[str, Any]) -> torch.Tensor:
    """out_NH: down with the top-k sum done by its tiles, each adding its rows into their
    tokens' rows of a zeroed output with bf16 (or the dtype's) atomics: no [P, H] buffer and
    no pass that reads it back, at the price of a sum rounded at every add, in an order that
    varies from run to run (the bits may differ between runs of the same input)."""
    out = torch.zeros(num_rows, w2.shape[1], dtype=h.dtype, device=h.device)
    if blocks.num_blocks:
        _down_launch(h, w2, blocks, topk_weights_P, out, top_k, cfg, atomic=True)
    return out


def _down_launch(h, w2, blocks, topk_weights_P, dst, top_k: int, cfg: dict[str, Any],
                 atomic: bool) -> None:
    num_local, hidden, inter = w2.shape
    if cfg.get("WS") and down_ws.usable(w2, h, cfg, blocks.block_m):
        down_ws.down_ws(h, w2, dst, blocks, topk_weights_P, cfg, top_k if atomic else 0)
        return
    grid = (blocks.num_blocks * triton.cdiv(hidden, cfg["BLOCK_N"]),)
    w_arg, tma = _weights_arg(w2, cfg)
    _down_kernel[grid](h, w_arg, dst, blocks.sorted_pairs, blocks.block_expert,
                       blocks.block_rows, topk_weights_P, blocks.num_blocks, hidden, inter,
                       top_k, cfg["GROUP_M"], EVEN_K=inter % cfg["BLOCK_K"] == 0, TMA=tma,
                       ATOMIC_SUM=atomic, **_launch_opts(cfg, blocks.block_m),
                       **pdl_args(h.device))


def topk_sum(y_PH, topk_ids_NK, first_expert: int, num_local: int) -> torch.Tensor:
    n, k = topk_ids_NK.shape
    hidden = y_PH.shape[1]
    out = torch.empty(n, hidden, dtype=y_PH.dtype, device=y_PH.device)
    if n == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(hidden))
    _topk_sum_kernel[(n, triton.cdiv(hidden, block_h))](
        y_PH, topk_ids_NK, out, hidden, first_expert, num_local, TOP_K=k, BLOCK_H=block_h,
        num_warps=4, **pdl_args(y_PH.device))
    return out


def leaves_topk_sum(config: dict[str, Any]) -> bool:
    """Whether a tile config's path sums the top-k in a pass of its own (topk_sum), which a
    caller may take over (fused_experts' sum_topk): not the decode GEMVs, nor a down
    projection that sums with atomics."""
    return "decode" not in config and not config["down"].get("ATOMIC_SUM")


def fused_experts(x_NH: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_ids_NK: torch.Tensor, topk_weights_NK: torch.Tensor,
                  first_expert: int, act: str, config: dict[str, Any],
                  ws: Optional[Workspace] = None, sum_topk: bool = True) -> torch.Tensor:
    """sum_k w_k expert_k(x) over the pairs whose expert is in [first_expert, first + E);
    the intermediates in `ws` when given (the output is always a new tensor: it leaves the
    layer). sum_topk=False where leaves_topk_sum(config): the pairs' weighted rows
    [N * k, H] instead, for the caller to sum as topk_sum would (in ws's down buffer)."""
    num_local = w13.shape[0]
    n, k = topk_ids_NK.shape
    x_NH = x_NH.contiguous()
    ids = topk_ids_NK.to(torch.int32).contiguous()
    weights = topk_weights_NK.to(torch.float32).contiguous().view(-1)
    if "decode" in config:  # a few rows: two GEMV launches (decode_moe.py)
        return decode_experts(x_NH, w13, w2, ids.view(-1), weights, k, first_expert, act,
                              config["decode"], ws and ws.act)
    blocks = align_triton(ids, first_expert, num_local, config["BLOCK_M"], ws)
    h = gate_up(x_NH, w13, blocks, k, act, config["gate_up"], ws and ws.act)
    if config["down"].get("ATOMIC_SUM"):
        return down_summed(h, w2, blocks, weights, n, k, config["down"])
    y = down(h, w2, blocks, weights, n * k, config["down"], ws and ws.down)
    return topk_sum(y, ids, first_expert, num_local) if sum_topk else y
