"""The skinny linear of a decode step: y[M, N] = x[M, K] @ W[N, K]^T (+ b) for a few rows.

At a few rows a projection is a memory-bound GEMV: the cost is streaming W once. cuBLAS picks
GEMM tiles that leave most SMs idle at M = 1 (or a split-K with a second kernel). Two kernels
here, each one launch, no split over K (every program writes its own outputs: deterministic):

  FMA  (1-2 rows; routers up to 16) each program takes BLOCK_N rows of W, streams them
       along K once for up to 4 rows of x, and keeps one [BLOCK_N, BLOCK_K] fp32 tile of
       products per row (in the layout the W tile is loaded in, so no data moves between
       threads in the loop), reduced over K once at the end. More rows take more row groups
       (a second grid dim), each streaming W again (from L2, mostly).
  MMA  (up to 16 rows) the product transposed, y^T = W x^T, on tensor cores: the W tile is
       the MMA's wide side and x's rows, padded to 16, its narrow one, so a program streams
       BLOCK_N rows of W for all 16 rows at once, its K loop pipelined over `stages` buffers.
       The FMA kernel's products grow with the rows (registers, and x re-read by every
       program); here they do not.

Any of bf16/fp16/fp32 for x and W (they may differ: DeepSeek's router reads bf16 and wants
F.linear(x.float(), W.float())), fp32 accumulation (the MMA kernel takes fp32 or mixed
operands as fp32, exactly: input_precision "ieee"), the output in `out_dtype` (x's by
default, rounded once after the bias is added, as cuBLAS's epilogue does), optionally plus a
residual added after that rounding (the MoE layer's routed output plus its shared expert's
down).

Tiles: kernels/skinny/tiles.py's TILES maps (N, K) ranges to each kernel's tiles and the rows
up to which each beats cuBLAS (`beats_cublas`); benchmarks/step_kernels.py --try-tiles
measures the alternatives.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moeserve.kernels.launch.pdl import pdl_args, pdl_gate
from moeserve.kernels.skinny.tiles import tiles_for


@triton.jit
def _row_product(acc, w, x_row, k, mask_k, valid):
    x = tl.load(x_row + k, mask=mask_k & valid, other=0.0).to(tl.float32)
    return acc + w * x[None, :]


@triton.jit
def _rows_product(acc0, acc1, acc2, acc3, w, X, stride_xm, k, mask_k, rows,
                  ROWS: tl.constexpr):
    """The W tile's products with each of the group's rows (up to 4)."""
    acc0 = _row_product(acc0, w, X, k, mask_k, rows > 0)
    if ROWS > 1:
        acc1 = _row_product(acc1, w, X + stride_xm, k, mask_k, rows > 1)
    if ROWS > 2:
        acc2 = _row_product(acc2, w, X + 2 * stride_xm, k, mask_k, rows > 2)
    if ROWS > 3:
        acc3 = _row_product(acc3, w, X + 3 * stride_xm, k, mask_k, rows > 3)
    return acc0, acc1, acc2, acc3


@triton.jit
def _row_store(acc, y_row, offs_n, mask_n, bias, valid, res_row, HAS_RES: tl.constexpr):
    y = tl.sum(acc, 1) + bias
    if HAS_RES:  # the product rounded first, then the sum rounded: torch's F.linear, then +
        res = tl.load(res_row + offs_n, mask=mask_n & valid, other=0.0).to(tl.float32)
        y = y.to(y_row.dtype.element_ty).to(tl.float32) + res
    tl.store(y_row + offs_n, y.to(y_row.dtype.element_ty), mask=mask_n & valid)


@triton.jit
def _skinny_kernel(X, W, B, R, Y, M, N, K, stride_xm, stride_wn, stride_rm, stride_ym,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # program (n block, row group): ROWS rows of x against BLOCK_N rows of W, one [BLOCK_N,
    # BLOCK_K] fp32 tile of products per row, all in the layout the W tile is loaded in
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    # the first W tile before the gate: no kernel writes W, so under PDL it streams in while
    # the kernel before this one finishes
    mask_k = offs_k < K
    w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    pdl_gate(PDL)
    rows = M - pid_m * ROWS
    X += pid_m * ROWS * stride_xm
    Y += pid_m * ROWS * stride_ym
    R += pid_m * ROWS * stride_rm
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc0, acc1, acc2, acc3 = _rows_product(acc0, acc1, acc2, acc3, w.to(tl.float32), X,
                                           stride_xm, offs_k, mask_k, rows, ROWS)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc0, acc1, acc2, acc3 = _rows_product(acc0, acc1, acc2, acc3, w.to(tl.float32), X,
                                               stride_xm, k, mask_k, rows, ROWS)
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    _row_store(acc0, Y, offs_n, mask_n, bias, rows > 0, R, HAS_RES)
    if ROWS > 1:
        _row_store(acc1, Y + stride_ym, offs_n, mask_n, bias, rows > 1, R + stride_rm, HAS_RES)
    if ROWS > 2:
        _row_store(acc2, Y + 2 * stride_ym, offs_n, mask_n, bias, rows > 2, R + 2 * stride_rm,
                   HAS_RES)
    if ROWS > 3:
        _row_store(acc3, Y + 3 * stride_ym, offs_n, mask_n, bias, rows > 3, R + 3 * stride_rm,
                   HAS_RES)


@triton.jit
def _mma_product(acc, w, x, NATIVE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, BLOCK_K] . x [BLOCK_M, BLOCK_K]^T."""
    if NATIVE:  # x and W of one 16-bit type
        return tl.dot(w, tl.trans(x), acc)
    return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")


@triton.jit
def _skinny_mma_kernel(X, W, B, R, Y, M, N, K, stride_xm, stride_wn, stride_rm, stride_ym,
                       HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NATIVE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       STAGES: tl.constexpr, PDL: tl.constexpr):
    # program (n block, row group): y^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, K] . x [BLOCK_M, K]^T
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    # the first W tile before the gate (as the FMA kernel), the rest pipelined after it
    mask_k = offs_k < K
    w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    pdl_gate(PDL)
    x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    acc = _mma_product(tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), w, x, NATIVE)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        mask_k = offs_k < K - k0
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc = _mma_product(acc, w, x, NATIVE)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    mask = mask_n[:, None] & mask_m[None, :]
    y_ptrs = Y + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    if HAS_RES:  # the product rounded first, then the sum rounded: torch's F.linear, then +
        res = tl.load(R + offs_m.to(tl.int64)[None, :] * stride_rm + offs_n[:, None],
                      mask=mask, other=0.0).to(tl.float32)
        acc = acc.to(Y.dtype.element_ty).to(tl.float32) + res
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  out_dtype: Optional[torch.dtype] = None,
                  tiles: Optional[tuple[int, ...]] = None,
                  residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] (last dim contiguous) @ weight [N, K]^T + bias [N] -> [..., N] in out_dtype
    (x's dtype by default), plus `residual` [..., N] when given (added to the rounded product,
    as `F.linear(...) + residual` adds). Meant for a few rows; correct for any number."""
    n, k = weight.shape
    assert x.shape[-1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1, \
        (x.shape, x.stride(), weight.shape, weight.stride())
    assert bias is None or (bias.shape == (n,) and bias.stride(0) == 1)
    x_MK = x if x.dim() == 2 else x.reshape(-1, k)
    m = x_MK.shape[0]
    res = None if residual is None else residual.reshape(m, n)
    assert res is None or res.stride(-1) == 1
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m and n:
        t = tiles_for(m, n, k, tiles)
        args = (x_MK, weight, weight if bias is None else bias, y if res is None else res, y,
                m, n, k, x_MK.stride(0), weight.stride(0), 0 if res is None else res.stride(0),
                y.stride(0))
        grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.rows))
        flags = {"HAS_BIAS": bias is not None, "HAS_RES": res is not None,
                 "BLOCK_N": t.block_n, "BLOCK_K": t.block_k, "num_warps": t.warps,
                 **pdl_args(x.device)}
        if t.mma:
            native = x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            _skinny_mma_kernel[grid](*args, NATIVE=native, BLOCK_M=t.rows, STAGES=t.stages,
                                     num_stages=1, **flags)
        else:
            _skinny_kernel[grid](*args, ROWS=t.rows, **flags)
    return y.view(*x.shape[:-1], n)
