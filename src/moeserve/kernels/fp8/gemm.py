"""Block-scaled FP8 on the GPU: the per-token-group activation quantizer and the W8A8 GEMM of
the dense projections (kernels/fp8/reference.py is the same arithmetic in torch).

    xq, xs = quantize_groups(x_TK, group)                 fp8 [T, K], float32 [T, ceil(K/group)]
    y_TN = fp8_linear(x_TK, w_NK, w_scale, (bn, bk), bias, residual)

The GEMM walks K one scale group at a time (BLOCK_K = bk): an fp8 x fp8 dot of the tile,
scaled by the rows' activation scales and the columns' weight-block scales, accumulated in
float32. Decode-sized steps take tiles of 16 to 64 rows, and split K into parts (each
stores a float32 partial, the tile's last part to finish sums them in part order) until the
weight streams through every SM; prefills take 128-row tiles (kernels/fp8/tiles.gemm_tiles).
The partials and the tiles' counters are views of the plan's fp8.gemm.* workspace, which the
model binds for its device (bind_workspace); kernels called outside an engine make their own.

Up to SWAP_MAX_ROWS rows (kernels/fp8/tiles.py) a tile is swapped: the weight's 64 rows are
the MMA's M side, so that Hopper's fp8 wgmma takes the tile from shared memory, and the rows its
N side. A GEMV on CUDA cores with the quantizer inside it is slower at one row than the
quantizer's launch and the swapped GEMM together (H200, 5120 x 2048: 7.6 against 6.9 us): its
programs convert every fp8 weight to float32, and at the memory's rate that conversion alone
keeps the SMs busy.

The kernels launch with PDL (kernels/launch/pdl.py), gated before their first load of what
the kernel before wrote.

Rounding: a value is rounded to the e4m3 grid in float32 (nearest, ties to even) before the
cast, so the cast is exact: the GPU's cast and Triton's interpreter, whose cast rounds a carry
into the next binade wrongly, then store the same bits as torch's `.to(float8_e4m3fn)`.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8.reference import empty_groups
from moeserve.kernels.fp8.tiles import (MAX_SPLIT_TILES, MIN_GPU_BLOCK_K, GemmTiles,
                                        SplitWorkspace, gemm_tiles, tile_warps)
from moeserve.kernels.launch.pdl import pdl_args, pdl_gate

FP8_MAX = tl.constexpr(448.0)  # globals a kernel reads must be constexpr
AMAX_FLOOR = tl.constexpr(1e-10)  # reference.AMAX_FLOOR
INV_FP8_MAX = tl.constexpr(1.0 / 448.0)  # reference.INV_FP8_MAX


@triton.jit
def round_e4m3(v):
    """v (|v| <= 448) rounded to a float8_e4m3fn value, in float32: add and subtract 2^(e+20)
    (e the binade of |v|, at least e4m3's smallest normal, -6), whose ulp is e4m3's ulp
    2^(e-3) there."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    magic = ((e + 147) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3 + 23)
    r = (a + magic) - magic
    return tl.where(v < 0, -r, r)


@triton.jit
def group_scale(amax):
    """amax x (1 / 448), as reference.quantize_groups computes it (the codes then divide with
    IEEE division, tl.math.div_rn: a kernel's `/` is approximate on the GPU)."""
    return tl.maximum(amax, AMAX_FLOOR) * INV_FP8_MAX


@triton.jit
def e4m3_codes(x, scale):
    """x / scale (IEEE division) clamped to +-448 and rounded to the e4m3 grid, in float32:
    the quantizer's codes, for any tile x and a scale broadcast against it."""
    return round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX))


@triton.jit
def quantize_group(x_ptr, q_ptr, s_ptr, rows, row_ok, g, K, stride_x, stride_q, stride_s,
                   stride_sg, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Group g of the rows `rows` (those with row_ok) of x: their codes and scales stored
    (BLOCK = GROUP rounded up to a power of two; strides in elements)."""
    r = rows.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    cols = g * GROUP + offs
    mask = row_ok[:, None] & ((offs < GROUP) & (cols < K))[None, :]
    x = tl.load(x_ptr + r[:, None] * stride_x + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    scale = group_scale(tl.max(tl.abs(x), axis=1))
    q = e4m3_codes(x, scale[:, None])
    tl.store(q_ptr + r[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=mask)
    tl.store(s_ptr + r * stride_s + g * stride_sg, scale, mask=row_ok)


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_q, stride_s,
                            stride_sg, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                            ROWS: tl.constexpr, PDL: tl.constexpr):
    pdl_gate(PDL)  # x is the kernel before's output
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    quantize_group(x_ptr, q_ptr, s_ptr, rows, rows < T, tl.program_id(1), K, stride_x,
                   stride_q, stride_s, stride_sg, GROUP, BLOCK)


QUANT_TILE_ROWS = 16  # rows a quantizer program takes past QUANT_ROW_PROGRAMS rows
QUANT_ROW_PROGRAMS = 64  # up to this many rows, a program a row and group (decode steps)


def quantize_groups(x_TK: torch.Tensor, group: int,
                    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (fp8 [T, K], float32 scales [T, ceil(K/group)]), group amax / 448; into
    `out` (tensors of those shapes, the codes row-major, the scales of any strides) when
    given. A program quantizes one group of a row, or of QUANT_TILE_ROWS rows past
    QUANT_ROW_PROGRAMS rows (a program a group of 128 bf16 values left an H100 at a tenth of
    its bandwidth on 8192 rows)."""
    x_TK = x_TK if x_TK.stride(-1) == 1 else x_TK.contiguous()
    t, k = x_TK.shape
    groups = triton.cdiv(k, group)
    if out is None:
        q, s = empty_groups(t, k, group, x_TK.device)
    else:
        q, s = out
        assert q.shape == (t, k) and s.shape == (t, groups) and q.stride(-1) == 1
    if t:
        rows = 1 if t <= QUANT_ROW_PROGRAMS else QUANT_TILE_ROWS
        _quantize_groups_kernel[(triton.cdiv(t, rows), groups)](
            x_TK, q, s, t, k, x_TK.stride(0), q.stride(0), s.stride(0), s.stride(1),
            GROUP=group, BLOCK=triton.next_power_of_2(group), ROWS=rows,
            **pdl_args(x_TK.device))
    return q, s


@triton.jit
def _tile_products(a_ptr, b_ptr, as_ptr, bs_ptr, rows, cols, row_ok, col_ok, k_lo, k_hi, K,
                   stride_am, stride_bn, stride_asm, stride_bsn, GROUP_N: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile's float32 [BLOCK_M, BLOCK_N] sum over the scale groups of K in [k_lo, k_hi):
    rows x weight^T."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + ks
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :],
                    mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + cols[None, :] * stride_bn + k[:, None],
                    mask=col_ok[None, :] & (k[:, None] < K), other=0.0)
        a_s = tl.load(as_ptr + rows * stride_asm + k0 // BLOCK_K, mask=row_ok, other=0.0)
        b_s = tl.load(bs_ptr + (cols // GROUP_N) * stride_bsn + k0 // BLOCK_K, mask=col_ok,
                      other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    return acc


@triton.jit
def _swapped_tile_products(a_ptr, b_ptr, as_ptr, bs_ptr, rows, cols, row_ok, col_ok, k_lo,
                           k_hi, K, stride_am, stride_bn, stride_asm, stride_bsn,
                           GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The same sum as weight x rows^T, transposed at the end: the weight's BLOCK_N rows are
    the MMA's M side, which Hopper's fp8 wgmma takes from 64 up and reads from shared memory
    (a tile of 16 rows of x runs there as mma.sync on operands converted to fp16)."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + ks
        w = tl.load(b_ptr + cols[:, None] * stride_bn + k[None, :],
                    mask=col_ok[:, None] & (k[None, :] < K), other=0.0)
        a = tl.load(a_ptr + rows[None, :] * stride_am + k[:, None],
                    mask=row_ok[None, :] & (k[:, None] < K), other=0.0)
        a_s = tl.load(as_ptr + rows * stride_asm + k0 // BLOCK_K, mask=row_ok, other=0.0)
        w_s = tl.load(bs_ptr + (cols // GROUP_N) * stride_bsn + k0 // BLOCK_K, mask=col_ok,
                      other=0.0)
        acc += tl.dot(w, a) * w_s[:, None] * a_s[None, :]
    return tl.trans(acc)


@triton.jit
def split_sum(acc, part_ptr, cnt_ptr, at, mask, tile, part, size, SPLIT: tl.constexpr):
    """(whether this program runs the epilogue, the sum it takes) of a tile whose K is split
    into SPLIT parts: each part stores its float32 partial at `at` in PART [SPLIT, size]
    and counts itself in on the tile's counter; the last to arrive sums the partials in part
    order (the same bits run to run) and sets the counter back to 0."""
    last = True
    if SPLIT > 1:
        tl.store(part_ptr + part * size + at, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial comes before the release
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = ticket == SPLIT - 1
        tl.debug_barrier()  # every thread's loads come after the acquire
        if last:  # (.cg: other SMs wrote the partials); the counter back to 0
            tl.store(cnt_ptr + tile, 0)
            acc = tl.load(part_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
            for p in tl.static_range(1, SPLIT):
                acc += tl.load(part_ptr + p * size + at, mask=mask, other=0.0,
                               cache_modifier=".cg")
    return last, acc


@triton.jit
def _block_gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, res_ptr, part_ptr, cnt_ptr,
                       M, N, K, stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                       stride_rm, GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                       SWAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                       PDL: tl.constexpr):
    # program (row tile, column tile, K part): the K part's scale groups of the tile; with
    # SPLIT parts, each stores its float32 partial in PART [SPLIT, M, N], and the tile's last
    # part to finish sums them in part order and runs the epilogue
    pdl_gate(PDL)  # the rows are the kernel before's output
    pid_m, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K  # columns of K a part takes
    k_lo, k_hi = part * span, tl.minimum(K, part * span + span)
    if SWAP:
        acc = _swapped_tile_products(a_ptr, b_ptr, as_ptr, bs_ptr, rows, cols, row_ok, col_ok,
                                     k_lo, k_hi, K, stride_am, stride_bn, stride_asm,
                                     stride_bsn, GROUP_N, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = _tile_products(a_ptr, b_ptr, as_ptr, bs_ptr, rows, cols, row_ok, col_ok, k_lo,
                             k_hi, K, stride_am, stride_bn, stride_asm, stride_bsn, GROUP_N,
                             BLOCK_M, BLOCK_N, BLOCK_K)
    mask = row_ok[:, None] & col_ok[None, :]
    at = rows[:, None] * N + cols[None, :]
    last, acc = split_sum(acc, part_ptr, cnt_ptr, at, mask, pid_m * tl.num_programs(1) + pid_n,
                          part, M * N, SPLIT)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            acc += tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask,
                           other=0.0).to(tl.float32)
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# device index -> the plan's workspace, held by the model runner's buffers (weakly here: a
# workspace whose engine is gone is no longer taken)
_BOUND: "weakref.WeakValueDictionary[int, SplitWorkspace]" = weakref.WeakValueDictionary()
_COUNTERS: dict[int, torch.Tensor] = {}  # device index -> counters of launches without one


def _key(device: torch.device) -> int:
    return device.index if device.type == "cuda" else -1


def bind_workspace(ws: SplitWorkspace) -> None:
    """The plan's fp8.gemm.* buffers, which every split launch on their device takes from now
    on, for as long as their owner holds them (a launch whose partials they cannot hold
    splits K into fewer parts)."""
    assert ws.partials.dtype == torch.float32 and ws.counters.dtype == torch.int32
    _BOUND[_key(ws.partials.device)] = ws


def split_buffers(device: torch.device, split: int, m: int, n: int, tiles: int
                  ) -> tuple[int, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(parts, partials [parts, m, n], counters) of a split launch of `tiles` tiles: views of
    the bound workspace, with parts halved until its partials fit; without one (kernels
    called outside an engine: tests, benchmarks), partials of the launch's own and counters
    made on the device's first split launch, which must precede any graph capture. (1, None,
    None): more tiles than counters, K unsplit."""
    ws = _BOUND.get(_key(device))
    if tiles > (MAX_SPLIT_TILES if ws is None else ws.counters.numel()):
        return 1, None, None
    if ws is not None:
        while split > 1 and split * m * n > ws.partials.numel():
            split //= 2
        return split, ws.partials[:split * m * n].view(split, m, n), ws.counters
    cnt = _COUNTERS.get(_key(device))
    if cnt is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the fp8 GEMM's split-K counters are made on first use, which "
                               "must come before graph capture: run the GEMM eagerly first")
        cnt = _COUNTERS[_key(device)] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32,
                                                    device=device)
    return split, torch.empty(split, m, n, dtype=torch.float32, device=device), cnt


def check_dot_k(t: torch.Tensor, block: tuple[int, int], what: str) -> None:
    """A GPU's fp8 dot takes K >= MIN_GPU_BLOCK_K: scale groups narrower than that (the
    interpreter's tests use them) cannot run there, a group a K step."""
    if t.is_cuda and block[1] < MIN_GPU_BLOCK_K:
        raise ValueError(f"fp8 scale blocks {block} are {block[1]} wide along K; {what}'s fp8 "
                         f"dot needs at least {MIN_GPU_BLOCK_K} (checkpoints use 128)")


def block_gemm(xq_MK: torch.Tensor, x_scale: torch.Tensor, w_NK: torch.Tensor,
               w_scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype,
               bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
               tiles: Optional[GemmTiles] = None) -> torch.Tensor:
    """fp8 rows (with per-group scales) x fp8 weight (with block scales)^T, in out_dtype;
    `tiles` (gemm_tiles' answer) for the table's."""
    m, k = xq_MK.shape
    n = w_NK.shape[0]
    bn, bk = block
    check_dot_k(xq_MK, block, "the block GEMM")
    out = torch.empty(m, n, dtype=out_dtype, device=xq_MK.device)
    if m == 0:
        return out
    assert w_NK.stride(-1) == 1 and w_scale.stride(-1) == 1 and xq_MK.stride(-1) == 1
    programs = _sm_count(xq_MK.device.index or 0) if xq_MK.is_cuda else 0
    block_m, block_n, stages, split, swap = tiles or gemm_tiles(m, n, k, programs, bk)
    tiles_mn = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    res = residual if residual is not None else out
    part, cnt = out, out
    if split > 1:  # the parts' float32 partials, the tiles' counters
        split, p, c = split_buffers(out.device, split, m, n, tiles_mn[0] * tiles_mn[1])
        if split > 1:
            part, cnt = p, c
    grid = tiles_mn + (split,)
    _block_gemm_kernel[grid](xq_MK, w_NK, out, x_scale, w_scale,
                             bias if bias is not None else out, res, part, cnt, m, n, k,
                             xq_MK.stride(0), w_NK.stride(0), out.stride(0), x_scale.stride(0),
                             w_scale.stride(0), res.stride(0), GROUP_N=bn, BLOCK_M=block_m,
                             BLOCK_N=block_n, BLOCK_K=bk, SPLIT=split, SWAP=swap,
                             HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                             num_stages=stages, num_warps=tile_warps(block_m, block_n),
                             **pdl_args(xq_MK.device))
    return out


# the rows for which fp8_linear takes cuBLAS's block-scaled GEMM. At decode sizes it timed level
# with or ahead of the Triton GEMM at 3..512 rows on H100 (Qwen3-30B-A3B's and Mixtral's
# attention projections: 5120 x 2048 at 8 rows 10.4 against 16.2 us, at 512 rows 26.3 against
# 37.0); in the decode step it is no PDL kernel, so the kernels beside it lose their overlap:
# the step (Qwen3-30B-A3B in FP8, one run) took 3.6% longer at 8 rows and 2.7% at 64, 3.0% less
# at 256. Prefills from CUBLAS_PREFILL_ROWS (H200, cold weights, the quantizer included on both
# sides): 5120 x 2048 at 1024 rows 73.5 against 53.2 us, at 2048 83.9 against 83.7, at 8192
# 168 against 296; 2048 x 4096 at 1024 rows 31.9 against 47.8, at 8192 148 against 262.
CUBLAS_MIN_ROWS, CUBLAS_MAX_ROWS = 256, 512
CUBLAS_PREFILL_ROWS = 2048


def cublas_takes(x_TK: torch.Tensor, w_NK: torch.Tensor, w_scale: torch.Tensor,
                 block: tuple[int, int]) -> bool:
    """Whether fp8_linear runs these rows through cuBLAS's block-scaled GEMM
    (torch.nn.functional.scaled_mm, 1 x 128 activation and 128 x 128 weight scales): on a
    GPU, 16-bit rows, 128 x 128 blocks with K a multiple of 512 (the weight's contiguous
    scales then serve as they are, transposed), CUBLAS_MIN_ROWS to CUBLAS_MAX_ROWS rows or
    CUBLAS_PREFILL_ROWS and more."""
    m, k = x_TK.shape
    return (x_TK.is_cuda and _BLOCKWISE is not None and block == (128, 128)
            and x_TK.dtype in (torch.bfloat16, torch.float16) and k % 512 == 0
            and w_NK.shape[0] % 128 == 0 and w_scale.is_contiguous()
            and (CUBLAS_MIN_ROWS <= m <= CUBLAS_MAX_ROWS or m >= CUBLAS_PREFILL_ROWS))


def cublas_block_gemm(x_TK: torch.Tensor, w_NK: torch.Tensor, w_scale: torch.Tensor,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W8A8 by cuBLAS: the rows quantized (their scales written outer-dim-major, as cuBLAS
    reads them), then the block-scaled GEMM with the bias in its epilogue; out in x's dtype.
    cuBLAS takes a multiple of 4 rows (H100: 3, 5 and 17 refused): the rows past M are left
    as they are, and so are their outputs, which the view returned leaves out."""
    m, k = x_TK.shape
    rows = -(-m // 4) * 4
    xq = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x_TK.device)
    xs = torch.empty(k // 128, rows, dtype=torch.float32, device=x_TK.device).t()
    quantize_groups(x_TK, 128, out=(xq[:m], xs[:m]))
    one_by, block = _BLOCKWISE
    y = torch.nn.functional.scaled_mm(xq, w_NK.t(), xs, one_by, w_scale.t(), block,
                                      bias=bias, output_dtype=x_TK.dtype)
    return y[:m]


def _blockwise() -> Optional[tuple]:
    kinds = getattr(torch.nn.functional, "ScalingType", None)
    if kinds is None or not hasattr(torch.nn.functional, "scaled_mm"):
        return None
    return kinds.BlockWise1x128, kinds.BlockWise128x128


_BLOCKWISE = _blockwise()


def fp8_linear(x: torch.Tensor, w_NK: torch.Tensor, w_scale: torch.Tensor,
               block: tuple[int, int], bias: Optional[torch.Tensor] = None,
               residual: Optional[torch.Tensor] = None,
               x_quant: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """W8A8 x @ W.T (+ bias) (+ residual): x quantized per token per bk columns, then the
    block-scaled GEMM: cuBLAS's where cublas_takes, else this module's; out in x's dtype.
    x_quant: x's rows already quantized so (the codes and scales quantize_groups gives
    them, by the kernel that made x), which this module's GEMM then takes as they are."""
    x_TK = x.reshape(-1, x.shape[-1])
    if x_TK.stride(-1) != 1:
        x_TK = x_TK.contiguous()
    res = None if residual is None else residual.reshape(-1, w_NK.shape[0])
    if cublas_takes(x_TK, w_NK, w_scale, block):
        y = cublas_block_gemm(x_TK, w_NK, w_scale, bias)
        if res is not None:
            y += res
    else:
        xq, xs = x_quant if x_quant is not None else quantize_groups(x_TK, block[1])
        y = block_gemm(xq, xs, w_NK, w_scale, block, x.dtype, bias, res)
    return y.view(*x.shape[:-1], w_NK.shape[0])
