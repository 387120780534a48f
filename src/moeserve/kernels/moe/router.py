"""The softmax + greedy top-k router's Triton kernels (imported only on CUDA or under Triton's
interpreter; kernels/select.py chooses them). M rows, E experts, H hidden, K top-k.

  topk_softmax  from logits [M, E]: top-k of the fp32 softmax, optional renormalisation,
                scaling, rounding of the weights to the model dtype, ids -1 / weights 0 for
                padding rows; at decode sizes it may also quantize the MoE's input rows for
                fp8 experts (programs of its own in the same launch: no quantizer launch)
  router_topk   the same from x [M, H] and the gate's weight [E, H]: the logits GEMM and the
                choice in one launch, for prefill-sized steps (moe/router.py says from how
                many rows). Each program computes ROWS rows' logits in registers (fp32 sums,
                rounded to the model dtype where transformers' block rounds them) and
                chooses from them; the logits never reach memory.

Which of the two a router takes, by rows and experts, is moe/router.router_gemm_suits.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8.gemm import quantize_group
from moeserve.kernels.launch.pdl import pdl_args, pdl_gate

TOPK_ONE_ROW_MAX = 64  # up to this many rows, topk_softmax takes one row a program


def topk_tile(rows: int, experts: int) -> tuple[int, int]:
    """topk_softmax's rows a program and warps: one row a program of one warp at decode
    sizes; past TOPK_ONE_ROW_MAX rows the fastest of 8 tiles timed on an H200 at 512-16384
    rows (`python -m benchmarks moe`)."""
    if rows <= TOPK_ONE_ROW_MAX:
        return 1, 1
    if experts <= 16:  # Mixtral's 8: 4 rows of one warp took 2-3x as long from 8192 rows
        return 16, 4
    if experts > 64 and rows >= 4096:  # 128 experts: 6.75 against 7.21 us at 8192 rows
        return 32, 8
    return 4, 1  # 64 experts at 16384 rows: 6.51 against 8.06 us


def router_tile(rows: int, experts: int) -> dict:
    """router_topk's tile (rows a program, H a step, warps, stages): the fastest of 14 timed
    on an H200 at the sizes moe/router.py sends here."""
    if experts % 8 and rows < 8192:  # 60 experts, 512-4096 rows
        return {"ROWS": 64, "BLOCK_H": 64, "num_warps": 8, "num_stages": 3}
    if experts > 64:  # 128 experts, 16384 rows
        return {"ROWS": 64, "BLOCK_H": 64, "num_warps": 4, "num_stages": 4}
    if experts <= 16 and rows >= 16384:  # 8 experts, 16384 rows
        return {"ROWS": 128, "BLOCK_H": 128, "num_warps": 8, "num_stages": 3}
    return {"ROWS": 64, "BLOCK_H": 128, "num_warps": 4, "num_stages": 3}


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


@triton.jit
def _choose_and_store(x, rows, row_ok, E, num_valid, scale, Ids, Weights,
                      TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      RENORM: tl.constexpr, ROUND_BF16: tl.constexpr, ROUND_F16: tl.constexpr):
    """x: fp32 logits [ROWS, BLOCK_E], -inf past E. The softmax over E, then TOP_K rounds of
    argmax (the lowest id among equal scores); each row's ids and weights in the order taken."""
    offs = tl.arange(0, BLOCK_E)
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([x.shape[0], BLOCK_K], tl.int32)
    ws = tl.zeros([x.shape[0], BLOCK_K], tl.float32)
    work = tl.where((offs < E)[None, :], p, -1.0)
    for j in tl.static_range(TOP_K):
        top, best = tl.max(work, 1, return_indices=True)  # one reduction for both
        taken = offs_k[None, :] == j
        ids = tl.where(taken, best[:, None], ids)
        ws = tl.where(taken, top[:, None], ws)
        work = tl.where(offs[None, :] == best[:, None], -1.0, work)
    if RENORM:
        ws = ws / (tl.sum(ws, 1)[:, None] + 1e-20)
    ws = ws * scale
    if ROUND_BF16:
        ws = ws.to(tl.bfloat16).to(tl.float32)
    if ROUND_F16:
        ws = ws.to(tl.float16).to(tl.float32)
    pad = (rows >= num_valid)[:, None]
    out = rows.to(tl.int64)[:, None] * TOP_K + offs_k[None, :]
    mask = row_ok[:, None] & (offs_k < TOP_K)[None, :]
    tl.store(Ids + out, tl.where(pad, -1, ids), mask=mask)
    tl.store(Weights + out, tl.where(pad, 0.0, ws), mask=mask)


@triton.jit
def _topk_softmax_kernel(Logits, Ids, Weights, stride_l, M, E, num_valid, scale, X, XQ, XS, H,
                         stride_x, stride_xq, stride_xs, TOP_K: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         RENORM: tl.constexpr, ROUND_BF16: tl.constexpr,
                         ROUND_F16: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_gate(PDL)
    if GROUP > 0:  # ROWS 1; the programs past the first of a row quantize its groups
        if tl.program_id(1) > 0:
            row = tl.program_id(0) + tl.arange(0, 1)
            quantize_group(X, XQ, XS, row, row < M, tl.program_id(1) - 1, H, stride_x,
                           stride_xq, stride_xs, 1, GROUP, BLOCK_G)
            return
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_E)
    row_ok = rows < M
    x = tl.load(Logits + rows.to(tl.int64)[:, None] * stride_l + offs[None, :],
                mask=row_ok[:, None] & (offs < E)[None, :], other=float("-inf")).to(tl.float32)
    _choose_and_store(x, rows, row_ok, E, num_valid, scale, Ids, Weights, TOP_K, BLOCK_E,
                      BLOCK_K, RENORM, ROUND_BF16, ROUND_F16)


Outputs = tuple[torch.Tensor, torch.Tensor]  # ids [M, K] int32, weights [M, K] float32
RowQuant = tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]  # x, group, codes, scales


def _outputs(m: int, top_k: int, device: torch.device, out: Optional[Outputs]) -> Outputs:
    """`out` (the first M rows of the plan's contiguous router buffers), else new tensors."""
    if out is not None:
        return out
    return (torch.empty(m, top_k, dtype=torch.int32, device=device),
            torch.empty(m, top_k, dtype=torch.float32, device=device))


def topk_softmax(logits_ME: torch.Tensor, top_k: int, renormalize: bool, scale: float,
                 num_valid: int, round_to: torch.dtype = torch.float32,
                 tile: Optional[tuple[int, int]] = None, out: Optional[Outputs] = None,
                 quantize: Optional[RowQuant] = None) -> Outputs:
    """ids [M, K] int32 and weights [M, K] float32 of the softmax + greedy top-k router, into
    `out` when given; tile (rows a program, warps) overrides topk_tile's. quantize (x [M, H],
    its group G, fp8 [M, H] and float32 [M, ceil(H/G)] outputs; only with one row a program,
    quantizes_rows): the same launch also quantizes x's rows per G columns, as
    kernels/fp8/gemm.quantize_groups does, in programs of their own beside the top-k's."""
    m, e = logits_ME.shape
    assert logits_ME.stride(-1) == 1
    ids, weights = _outputs(m, top_k, logits_ME.device, out)
    if m:
        rows, warps = tile or topk_tile(m, e)
        x, group, xq, xs = quantize or (logits_ME, 0, logits_ME, logits_ME)
        groups = triton.cdiv(x.shape[1], group) if quantize else 0
        assert not quantize or (rows == 1 and x.stride(-1) == xq.stride(-1) == 1
                                and xs.stride(-1) == 1 and xq.shape == x.shape
                                and xs.shape == (m, groups))
        _topk_softmax_kernel[(triton.cdiv(m, rows), 1 + groups)](
            logits_ME, ids, weights, logits_ME.stride(0), m, e, num_valid, scale, x, xq, xs,
            x.shape[1], x.stride(0), xq.stride(0), xs.stride(0), TOP_K=top_k, ROWS=rows,
            BLOCK_E=_pow2(e), BLOCK_K=_pow2(top_k), RENORM=renormalize,
            ROUND_BF16=round_to == torch.bfloat16, ROUND_F16=round_to == torch.float16,
            GROUP=group, BLOCK_G=_pow2(group), num_warps=warps, **pdl_args(logits_ME.device))
    return ids, weights


def quantizes_rows(rows: int, experts: int) -> bool:
    """Whether topk_softmax takes `quantize` at this size: one row a program."""
    return topk_tile(rows, experts)[0] == 1


@triton.jit(do_not_specialize=["M", "num_valid"])
def _router_topk_kernel(X, W, Ids, Weights, stride_x, M, E, H, num_valid, scale,
                        TOP_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_H: tl.constexpr,
                        IEEE: tl.constexpr, ROUND_LOGITS: tl.constexpr, RENORM: tl.constexpr,
                        ROUND_BF16: tl.constexpr, ROUND_F16: tl.constexpr, PDL: tl.constexpr):
    """ROWS rows of x against all of W (E <= BLOCK_E), then _choose_and_store."""
    pdl_gate(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    offs_h = tl.arange(0, BLOCK_H)
    x_ptrs = X + rows.to(tl.int64)[:, None] * stride_x + offs_h[None, :]
    w_ptrs = W + offs_e[:, None] * H + offs_h[None, :]
    acc = tl.zeros([ROWS, BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        if EVEN_H:
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=e_ok[:, None], other=0.0)
        else:
            h_ok = offs_h < H - h0
            a = tl.load(x_ptrs, mask=row_ok[:, None] & h_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=e_ok[:, None] & h_ok[None, :], other=0.0)
        if IEEE:  # fp32 inputs: fp32 products, not tf32
            acc = tl.dot(a, w.T, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.T, acc)
        x_ptrs += BLOCK_H
        w_ptrs += BLOCK_H
    if ROUND_LOGITS:  # transformers' block computes the logits in the model dtype
        acc = acc.to(X.dtype.element_ty).to(tl.float32)
    logits = tl.where(e_ok[None, :], acc, float("-inf"))
    _choose_and_store(logits, rows, row_ok, E, num_valid, scale, Ids, Weights, TOP_K, BLOCK_E,
                      BLOCK_K, RENORM, ROUND_BF16, ROUND_F16)


def router_topk(x_MH: torch.Tensor, w_EH: torch.Tensor, top_k: int, renormalize: bool,
                scale: float, num_valid: int, round_logits: bool,
                round_to: torch.dtype = torch.float32, tile: Optional[dict] = None,
                out: Optional[Outputs] = None) -> Outputs:
    """topk_softmax(x @ w.T) in one launch: x [M, H] (last dim contiguous) and a contiguous
    w [E, H] of x's dtype, E <= 256; round_logits rounds the fp32 sums to x's dtype first.
    Into `out` when given."""
    m, h = x_MH.shape
    e = w_EH.shape[0]
    if (x_MH.stride(-1) != 1 or not w_EH.is_contiguous() or w_EH.shape[1] != h
            or w_EH.dtype != x_MH.dtype or e > 256):
        raise ValueError(f"router_topk takes x [M, H] with a contiguous last dim and a "
                         f"contiguous w [E <= 256, H] of x's dtype; got x {tuple(x_MH.shape)} "
                         f"{x_MH.dtype}, w {tuple(w_EH.shape)} {w_EH.dtype}")
    ids, weights = _outputs(m, top_k, x_MH.device, out)
    if m:
        t = dict(router_tile(m, e), **(tile or {}))
        rows = t.pop("ROWS")
        _router_topk_kernel[(triton.cdiv(m, rows),)](
            x_MH, w_EH, ids, weights, x_MH.stride(0), m, e, h, num_valid, scale, TOP_K=top_k,
            ROWS=rows, BLOCK_E=max(16, _pow2(e)), BLOCK_K=_pow2(top_k),
            EVEN_H=h % t["BLOCK_H"] == 0, IEEE=x_MH.dtype == torch.float32,
            ROUND_LOGITS=round_logits, RENORM=renormalize,
            ROUND_BF16=round_to == torch.bfloat16, ROUND_F16=round_to == torch.float16,
            **t, **pdl_args(x_MH.device))
    return ids, weights
