"""The fp8 grouped GEMMs of fused_moe_fp8.py (W8A8, 128 x 128 block scales) as persistent,
warp-specialised Gluon kernels for sm90, in which two consumer warpgroups take turns on the
tensor cores.

A K step of a block-scaled GEMM is an fp8 wgmma into a scratch accumulator, then its
promotion into the tile's float32 sum, scaled by the rows' and the weight block's scales:

    acc += (a_q . b_q) * a_scale[row, kb] * b_scale[n // 128, kb]

In one instruction stream the tensor cores idle while the promotion runs (Triton's kernels:
about 500 TFLOP/s at 8192 tokens on an H200). Here a program (one per SM) runs two consumer
warpgroups that wait on the same kind of stage and issue their wgmmas about together; the
tensor cores run one's while the other promotes (or writes a tile out).

    down     tiles (block t // num_n, the 128 columns t % num_n), BLOCK_M = 64 rows; consumer c
             takes the program's tiles program + c x programs, + 2 programs, ..., each with
             its own loader warp and ring of stages: TMA loads of h's rows (block order), their
             scales (group-major [I / 128, rows]) and w2's rows. The tile's epilogue: times
             the pairs' top-k weights, to the pair's slot of y or (ATOMIC_SUM) added into its
             token's row
    gate_up  tiles (block, the 128 columns of h), the program's every one; one ring whose
             stages hold x's rows (gathered by token with cp.async by the loader warp, 16
             bytes a copy, with their scales) and the tile's gate and up rows of w13 (TMA);
             consumer 0 sums the gate columns, consumer 1 the up columns, over the same
             stages, so a stage's rows of x are loaded once for both. Consumer 1 hands its
             sum over in shared memory; consumer 0 writes act(gate) * up quantized per row
             (the tile's 128 columns are one group of h): the codes at the block's rows, the
             scales group-major

A K step is BLOCK_K = 64 or 128 columns of one scale group (SUB = 128 / BLOCK_K stages a
group, promoted together); a tile's weight-block scales along K are loaded a tile ahead. The
arithmetic is that of fused_moe_fp8's Triton kernels with BLOCK_K 128 (a group's products
summed in the MMA, then scaled; the epilogue rounds on the e4m3 grid in float32 as
kernels/fp8/gemm.round_e4m3): on an H200 the same bits.

Why no wider tiles: a consumer holds its float32 sum and the wgmma's scratch (64 x 128 each,
128 registers a thread); gate and up in one consumer (three such tiles) spill.

`usable` says whether a call qualifies: a config with "WS", sm90, block scales of 128 x 128,
BLOCK_M 64, BLOCK_N 128, H and I multiples of 128, a contiguous 16-byte aligned weight; and
`gathers` whether gate_up's rows can be gathered (contiguous, 16-byte aligned, their scales
a float apart). fused_moe_fp8 takes the Triton kernel where either says no.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:  # Gluon ships with triton >= 3.5; the CPU build of CI may lack its NVIDIA modules
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                                   tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed triton
    gluon = None

from moeserve.kernels.elementwise.act import ACT_CODES
from moeserve.kernels.fp8.gemm import _sm_count
from moeserve.kernels.moe.configs import FP8_WS_BLOCK, FP8_WS_GROUP
from moeserve.kernels.moe.down_ws import sm90

# rows of a consumer's tile (one warpgroup's wgmma); a tile's output columns: one weight
# scale block (gate_up: one h group); the scale block (both sides) the kernels take
WS_BLOCK_M, WS_BLOCK_N = FP8_WS_BLOCK
WS_GROUP = FP8_WS_GROUP


def usable(w: torch.Tensor, block: tuple[int, int], block_m: int, cfg: dict[str, Any]) -> bool:
    """Whether the Gluon kernel takes this GEMM (w: w13 [E, 2I, H] or w2 [E, H, I], fp8)."""
    if (not cfg.get("WS") or block_m != WS_BLOCK_M or tuple(block) != (WS_GROUP, WS_GROUP)
            or cfg.get("BLOCK_K") not in (64, 128) or cfg.get("BLOCK_N") != WS_BLOCK_N
            or not sm90(w)):
        return False
    return (w.is_contiguous() and w.data_ptr() % 16 == 0 and w.dtype == torch.float8_e4m3fn
            and w.shape[1] % WS_GROUP == 0 and w.shape[2] % WS_GROUP == 0)


def gathers(xq: torch.Tensor, xs: torch.Tensor) -> bool:
    """Whether gate_up's loader can gather these rows (16-byte copies of whole rows) and their
    scales (a group's a float)."""
    return (xq.is_contiguous() and xq.data_ptr() % 16 == 0 and xs.stride(1) == 1
            and xs.dtype == torch.float32)


if gluon is not None:
    # registers a thread of each partition keeps (setmaxnreg); 168 a thread at launch (12
    # warps: the loaders' warpgroup is padded), 64512 in all
    DOWN_REGS = gl.constexpr([232, 40, 40])  # [consumer 1, loader 0, loader 1]
    GATE_UP_REGS = gl.constexpr([200, 104])  # [consumer 1, loader]: it gathers rows
    FP8_MAX = gl.constexpr(448.0)

    @gluon.jit
    def _round_e4m3(v):
        """kernels/fp8/gemm.round_e4m3 in Gluon: v (|v| <= 448) to the e4m3 grid, float32."""
        a = gl.abs(v)
        e = ((a.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = gl.maximum(e, -6)
        magic = ((e + 147) << 23).to(gl.float32, bitcast=True)
        r = (a + magic) - magic
        return gl.where(v < 0, -r, r)

    @gluon.jit
    def _act(g, ACT: gl.constexpr):
        """elementwise/act._act in Gluon."""
        if ACT == 0:
            out = g / (1.0 + gl.exp(-g))
        elif ACT == 1:
            out = 0.5 * g * (1.0 + gl.erf(g * 0.7071067811865476))
        else:
            inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            out = g / (1.0 + gl.exp(-2.0 * inner))
        return out

    @gluon.jit
    def _stage(it, c, STAGES: gl.constexpr):
        """(stage index in the two rings, its phase) of consumer c's it-th K step."""
        return c * STAGES + it % STAGES, (it // STAGES) & 1

    @gluon.jit
    def _block_scales(ws_ptr, expert, nb, stride_we, stride_wn, groups, KP: gl.constexpr,
                      layout: gl.constexpr):
        """A tile's weight-block scales along K, [KP] (a lane each)."""
        kb = gl.arange(0, KP, layout=layout)
        return gl.load(ws_ptr + expert.to(gl.int64) * stride_we + nb * stride_wn + kb,
                       mask=kb < groups, other=0.0)

    @gluon.jit
    def _tile_ahead(block_expert_ptr, ws_ptr, t, num_tiles, num_n, row0, stride_we, stride_wn,
                    groups, KP: gl.constexpr, layout: gl.constexpr):
        """Tile t's expert and weight-block scales (block row row0 + its column tile; the last
        tile's past the end), loaded a tile before the consumer takes the tile."""
        t = gl.minimum(t, num_tiles - 1)
        expert = gl.load(block_expert_ptr + t // num_n)
        return expert, _block_scales(ws_ptr, gl.maximum(expert, 0), row0 + t % num_n,
                                     stride_we, stride_wn, groups, KP, layout)

    @gluon.jit
    def _scalar(v, kb, KP: gl.constexpr, layout: gl.constexpr):
        """Lane kb of a lane-distributed vector v [KP]: a K step's weight-block scale."""
        return gl.sum(gl.where(gl.arange(0, KP, layout=layout) == kb, v, 0.0), axis=0)

    @gluon.jit
    def _promote(acc, tmp, a_s, bsv, kb, KP: gl.constexpr, kv_layout: gl.constexpr):
        return acc + tmp * (a_s * _scalar(bsv, kb, KP, kv_layout))[:, None]

    @gluon.jit
    def _emit(acc, weight, y_ptr, pair, ok, cols, hidden, top_k, OUT_LAYOUT: gl.constexpr,
              ATOMIC_SUM: gl.constexpr):
        """A down tile's sums (or a part of its columns), weighted by its rows' top-k weights:
        added into the tokens' rows (ATOMIC_SUM) or stored at the pairs' rows."""
        out = gl.convert_layout((acc * weight[:, None]).to(y_ptr.dtype.element_ty), OUT_LAYOUT)
        mask = ok[:, None] & (cols < hidden)[None, :]
        if ATOMIC_SUM:
            token = (pair // top_k).to(gl.int64)
            gl.atomic_add(y_ptr + token[:, None] * hidden + cols[None, :], out, mask=mask,
                          sem="relaxed")
        else:
            gl.store(y_ptr + pair.to(gl.int64)[:, None] * hidden + cols[None, :], out,
                     mask=mask)

    @gluon.jit
    def _group_mma(a_bufs, b_bufs, ready, it, c, tmp, SUB: gl.constexpr, STAGES: gl.constexpr,
                   CP_ASYNC: gl.constexpr):
        """One scale group's wgmmas over SUB stages into tmp (not yet waited on)."""
        for sub in gl.static_range(SUB):
            s, phase = _stage(it + sub, c, STAGES)
            mbarrier.wait(ready.index(s), phase)
            if CP_ASYNC:  # rows written by cp.async (the generic proxy), read by wgmma
                fence_async_shared()
            tmp = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), tmp,
                                use_acc=sub > 0, is_async=True)
            tmp = warpgroup_mma_wait(1, deps=(tmp,))
        return tmp

    @gluon.jit
    def _release(empty, it, c, SUB: gl.constexpr, STAGES: gl.constexpr):
        for sub in gl.static_range(SUB):
            s, _ = _stage(it + sub, c, STAGES)
            mbarrier.arrive(empty.index(s))

    @gluon.jit
    def _row_scales(s_bufs, it, c, SUB: gl.constexpr, STAGES: gl.constexpr,
                    layout: gl.constexpr):
        s, _ = _stage(it + SUB - 1, c, STAGES)
        return s_bufs.index(s).load(layout)

    # ---------------------------------------------------------------- down

    @gluon.jit
    def _down_loader(a_desc, s_desc, b_desc, a_bufs, s_bufs, b_bufs, ready, empty,
                     block_expert_ptr, num_tiles, num_n, hidden, inter, c: gl.constexpr,
                     SUB: gl.constexpr):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0] // 2
        nbytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes
                                + s_desc.block_type.nbytes)
        it = 0
        for t in range(gl.program_id(0) + c * gl.num_programs(0), num_tiles,
                       2 * gl.num_programs(0)):
            blk = t // num_n
            expert = gl.load(block_expert_ptr + blk)
            if expert >= 0:
                w_row = expert * hidden + (t % num_n) * BLOCK_N
                for kb in range(0, inter // (SUB * BLOCK_K)):
                    for sub in gl.static_range(SUB):
                        s, phase = _stage(it, c, STAGES)
                        mbarrier.wait(empty.index(s), phase ^ 1)
                        mbarrier.expect(ready.index(s), nbytes)
                        k = (kb * SUB + sub) * BLOCK_K
                        tma.async_copy_global_to_shared(a_desc, [blk * BLOCK_M, k],
                                                        ready.index(s), a_bufs.index(s))
                        tma.async_copy_global_to_shared(b_desc, [w_row, k], ready.index(s),
                                                        b_bufs.index(s))
                        tma.async_copy_global_to_shared(s_desc, [kb, blk * BLOCK_M],
                                                        ready.index(s), s_bufs.index(s))
                        it += 1

    @gluon.jit
    def _down_consumer(a_bufs, s_rows, b_bufs, ready, empty, ws_ptr, y_ptr, sorted_ptr,
                       block_expert_ptr, block_rows_ptr, topk_weights_ptr, num_tiles, num_n,
                       hidden, inter, top_k, stride_we, stride_wn, c: gl.constexpr,
                       SUB: gl.constexpr, KP: gl.constexpr, ACC_LAYOUT: gl.constexpr,
                       OUT_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
                       ATOMIC_SUM: gl.constexpr):
        BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
        BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
        STAGES: gl.constexpr = a_bufs.type.shape[0] // 2
        ROW_L: gl.constexpr = gl.SliceLayout(1, ACC_LAYOUT)
        groups = inter // (SUB * a_bufs.type.shape[2])
        offs_r = gl.arange(0, BLOCK_M, layout=ROW_L)
        offs_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, OUT_LAYOUT))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, OUT_LAYOUT))
        step = 2 * gl.num_programs(0)
        first = gl.program_id(0) + c * gl.num_programs(0)
        expert_next, bsv_next = _tile_ahead(block_expert_ptr, ws_ptr, first, num_tiles, num_n,
                                            0, stride_we, stride_wn, groups, KP, KV_LAYOUT)
        it = 0
        for t in range(first, num_tiles, step):
            expert = expert_next
            bsv = bsv_next
            expert_next, bsv_next = _tile_ahead(block_expert_ptr, ws_ptr, t + step, num_tiles,
                                                num_n, 0, stride_we, stride_wn, groups, KP,
                                                KV_LAYOUT)
            if expert >= 0:
                blk = t // num_n
                rows = gl.load(block_rows_ptr + blk)
                pair_r = gl.load(sorted_ptr + blk * BLOCK_M + offs_r, mask=offs_r < rows,
                                 other=0)
                weight = gl.load(topk_weights_ptr + pair_r, mask=offs_r < rows, other=0.0)
                ok = offs_o < rows
                pair = gl.load(sorted_ptr + blk * BLOCK_M + offs_o, mask=ok, other=0)
                acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=ACC_LAYOUT)
                # the wgmma's scratch: made per tile, so that it is dead in the epilogue
                tmp = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=ACC_LAYOUT)
                for kb in range(0, groups):
                    tmp = _group_mma(a_bufs, b_bufs, ready, it, c, tmp, SUB, STAGES, False)
                    tmp = warpgroup_mma_wait(0, deps=(tmp,))
                    a_s = _row_scales(s_rows, it, c, SUB, STAGES, ROW_L)
                    _release(empty, it, c, SUB, STAGES)
                    acc = _promote(acc, tmp, a_s, bsv, kb, KP, KV_LAYOUT)
                    it += SUB
                _emit(acc, weight, y_ptr, pair, ok, (t % num_n) * BLOCK_N + offs_n, hidden,
                      top_k, OUT_LAYOUT, ATOMIC_SUM)

    @gluon.jit(do_not_specialize=["num_blocks", "top_k"])
    def _down_fp8_ws_kernel(a_desc, s_desc, b_desc, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr,
                            block_rows_ptr, topk_weights_ptr, num_blocks, hidden, inter, top_k,
                            stride_we, stride_wn, STAGES: gl.constexpr, SUB: gl.constexpr,
                            KP: gl.constexpr, ACC_LAYOUT: gl.constexpr,
                            OUT_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
                            ROWS_SMEM: gl.constexpr, ATOMIC_SUM: gl.constexpr):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, BLOCK_M, BLOCK_K],
                                           a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [2 * STAGES, BLOCK_N, BLOCK_K],
                                           b_desc.layout)
        s_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 1, BLOCK_M], s_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2 * STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        # the scales' [1, BLOCK_M] TMA boxes (no swizzle) read as [BLOCK_M] rows
        s_rows = s_bufs._reinterpret(gl.float32, [2 * STAGES, BLOCK_M], ROWS_SMEM)
        num_n = hidden // BLOCK_N
        num_tiles = num_blocks * num_n
        gl.warp_specialize([
            (_down_consumer, (a_bufs, s_rows, b_bufs, ready, empty, ws_ptr, y_ptr, sorted_ptr,
                              block_expert_ptr, block_rows_ptr, topk_weights_ptr, num_tiles,
                              num_n, hidden, inter, top_k, stride_we, stride_wn, 0, SUB, KP,
                              ACC_LAYOUT, OUT_LAYOUT, KV_LAYOUT, ATOMIC_SUM)),
            (_down_consumer, (a_bufs, s_rows, b_bufs, ready, empty, ws_ptr, y_ptr, sorted_ptr,
                              block_expert_ptr, block_rows_ptr, topk_weights_ptr, num_tiles,
                              num_n, hidden, inter, top_k, stride_we, stride_wn, 1, SUB, KP,
                              ACC_LAYOUT, OUT_LAYOUT, KV_LAYOUT, ATOMIC_SUM)),
            (_down_loader, (a_desc, s_desc, b_desc, a_bufs, s_bufs, b_bufs, ready, empty,
                            block_expert_ptr, num_tiles, num_n, hidden, inter, 0, SUB)),
            (_down_loader, (a_desc, s_desc, b_desc, a_bufs, s_bufs, b_bufs, ready, empty,
                            block_expert_ptr, num_tiles, num_n, hidden, inter, 1, SUB)),
        ], [4, 1, 1], DOWN_REGS)

    # ---------------------------------------------------------------- gate_up

    @gluon.jit
    def _gate_up_loader(x_ptr, xs_ptr, g_desc, a_bufs, s_rows, g_bufs, u_bufs, ready, empty,
                        sorted_ptr, block_expert_ptr, block_rows_ptr, num_tiles, num_n, hidden,
                        inter, top_k, stride_xs, SUB: gl.constexpr, A_LAYOUT: gl.constexpr,
                        S_LAYOUT: gl.constexpr):
        """x's rows (gathered by token) and their scales by cp.async, each thread arriving on
        the stage's barrier when its copies land; the gate and up rows of w13 by TMA."""
        BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        BLOCK_N: gl.constexpr = g_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        nbytes: gl.constexpr = 2 * g_desc.block_type.nbytes
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, A_LAYOUT))
        offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, A_LAYOUT))
        offs_s = gl.arange(0, BLOCK_M, layout=S_LAYOUT)
        it = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            blk = t // num_n
            expert = gl.load(block_expert_ptr + blk)
            if expert >= 0:
                rows = gl.load(block_rows_ptr + blk)
                # rows past the block's own read token 0 (their outputs are not stored)
                pair = gl.load(sorted_ptr + blk * BLOCK_M + offs_m, mask=offs_m < rows,
                               other=0)
                a_ptrs = (x_ptr + (pair // top_k).to(gl.int64)[:, None] * hidden
                          + offs_k[None, :])
                pair_s = gl.load(sorted_ptr + blk * BLOCK_M + offs_s, mask=offs_s < rows,
                                 other=0)
                s_ptrs = xs_ptr + (pair_s // top_k).to(gl.int64) * stride_xs
                w_row = expert * (2 * inter) + (t % num_n) * BLOCK_N
                for kb in range(0, hidden // (SUB * BLOCK_K)):
                    for sub in gl.static_range(SUB):
                        s, phase = _stage(it, 0, STAGES)
                        mbarrier.wait(empty.index(s), phase ^ 1)
                        k = (kb * SUB + sub) * BLOCK_K
                        async_copy.async_copy_global_to_shared(a_bufs.index(s), a_ptrs + k)
                        async_copy.async_copy_global_to_shared(s_rows.index(s), s_ptrs + kb)
                        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
                        mbarrier.expect(ready.index(s), nbytes)
                        tma.async_copy_global_to_shared(g_desc, [w_row, k], ready.index(s),
                                                        g_bufs.index(s))
                        tma.async_copy_global_to_shared(g_desc, [w_row + inter, k],
                                                        ready.index(s), u_bufs.index(s))
                        it += 1

    @gluon.jit
    def _gate_up_consumer(a_bufs, s_rows, w_bufs, ready, empty, x_smem, x_ready, x_free,
                          ws_ptr, h_ptr, hs_ptr, block_expert_ptr, block_rows_ptr, num_tiles,
                          num_n, hidden, inter, stride_we, stride_wn, stride_hg,
                          c: gl.constexpr, SUB: gl.constexpr, KP: gl.constexpr,
                          ACT: gl.constexpr, ACC_LAYOUT: gl.constexpr,
                          OUT_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr):
        """Consumer 0 sums the tile's gate columns, consumer 1 its up columns, over the same
        stages (each stage's rows of x loaded once for both); 1 hands its sum to 0 through
        x_smem, and 0 writes act(gate) * up quantized."""
        BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
        BLOCK_N: gl.constexpr = w_bufs.type.shape[1]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        ROW_L: gl.constexpr = gl.SliceLayout(1, ACC_LAYOUT)
        groups = hidden // (SUB * a_bufs.type.shape[2])
        offs_r = gl.arange(0, BLOCK_M, layout=ROW_L)
        offs_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, OUT_LAYOUT))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, OUT_LAYOUT))
        step = gl.num_programs(0)
        first = gl.program_id(0)
        # this consumer's weight-block rows: gate n, up num_n + n
        expert_next, bsv_next = _tile_ahead(block_expert_ptr, ws_ptr, first, num_tiles, num_n,
                                            c * num_n, stride_we, stride_wn, groups, KP,
                                            KV_LAYOUT)
        it = 0
        done = 0
        for t in range(first, num_tiles, step):
            expert = expert_next
            bsv = bsv_next
            expert_next, bsv_next = _tile_ahead(block_expert_ptr, ws_ptr, t + step, num_tiles,
                                                num_n, c * num_n, stride_we, stride_wn, groups,
                                                KP, KV_LAYOUT)
            if expert >= 0:
                acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=ACC_LAYOUT)
                tmp = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=ACC_LAYOUT)
                for kb in range(0, groups):
                    tmp = _group_mma(a_bufs, w_bufs, ready, it, 0, tmp, SUB, STAGES, True)
                    tmp = warpgroup_mma_wait(0, deps=(tmp,))
                    a_s = _row_scales(s_rows, it, 0, SUB, STAGES, ROW_L)
                    _release(empty, it, 0, SUB, STAGES)
                    acc = _promote(acc, tmp, a_s, bsv, kb, KP, KV_LAYOUT)
                    it += SUB
                if c == 1:
                    mbarrier.wait(x_free, (done & 1) ^ 1)
                    x_smem.store(acc)
                    mbarrier.arrive(x_ready)
                else:
                    blk = t // num_n
                    rows = gl.load(block_rows_ptr + blk)
                    mbarrier.wait(x_ready, done & 1)
                    up = x_smem.load(ACC_LAYOUT)
                    mbarrier.arrive(x_free)
                    hv = _act(acc, ACT) * up
                    # one group a tile: the row's scale is its amax / 448 (gemm.group_scale)
                    scale = gl.maximum(gl.max(gl.abs(hv), axis=1), 1e-10) * (1.0 / 448.0)
                    q = _round_e4m3(gl.minimum(gl.maximum(gl.div_rn(hv, scale[:, None]),
                                                          -FP8_MAX), FP8_MAX))
                    out = gl.convert_layout(q.to(h_ptr.dtype.element_ty), OUT_LAYOUT)
                    nb = t % num_n
                    row = (blk * BLOCK_M + offs_o).to(gl.int64)
                    cols = nb * BLOCK_N + offs_n
                    gl.store(h_ptr + row[:, None] * inter + cols[None, :], out,
                             mask=(offs_o < rows)[:, None] & (cols < inter)[None, :])
                    gl.store(hs_ptr + nb * stride_hg + blk * BLOCK_M + offs_r, scale,
                             mask=offs_r < rows)
                done += 1

    @gluon.jit(do_not_specialize=["num_blocks", "top_k"])
    def _gate_up_fp8_ws_kernel(x_ptr, xs_ptr, g_desc, ws_ptr, h_ptr, hs_ptr, sorted_ptr,
                               block_expert_ptr, block_rows_ptr, num_blocks, hidden, inter,
                               top_k, stride_xs, stride_we, stride_wn, stride_hg,
                               STAGES: gl.constexpr, SUB: gl.constexpr, BLOCK_K: gl.constexpr,
                               KP: gl.constexpr, ACT: gl.constexpr, ACC_LAYOUT: gl.constexpr,
                               OUT_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
                               A_SMEM: gl.constexpr, ROWS_SMEM: gl.constexpr,
                               X_SMEM: gl.constexpr, A_LAYOUT: gl.constexpr,
                               S_LAYOUT: gl.constexpr):
        BLOCK_M: gl.constexpr = 64
        BLOCK_N: gl.constexpr = g_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], A_SMEM)
        g_bufs = gl.allocate_shared_memory(g_desc.dtype, [STAGES, BLOCK_N, BLOCK_K],
                                           g_desc.layout)
        u_bufs = gl.allocate_shared_memory(g_desc.dtype, [STAGES, BLOCK_N, BLOCK_K],
                                           g_desc.layout)
        s_rows = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], ROWS_SMEM)
        x_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], X_SMEM)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        x_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        x_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            # the TMA's expect arrival and the loader warp's 32 cp.async arrivals
            mbarrier.init(ready.index(i), count=33)
            mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
        mbarrier.init(x_ready, count=1)
        mbarrier.init(x_free, count=1)
        num_n = inter // BLOCK_N
        num_tiles = num_blocks * num_n
        gl.warp_specialize([
            (_gate_up_consumer, (a_bufs, s_rows, g_bufs, ready, empty, x_smem, x_ready, x_free,
                                 ws_ptr, h_ptr, hs_ptr, block_expert_ptr, block_rows_ptr,
                                 num_tiles, num_n, hidden, inter, stride_we, stride_wn,
                                 stride_hg, 0, SUB, KP, ACT, ACC_LAYOUT, OUT_LAYOUT,
                                 KV_LAYOUT)),
            (_gate_up_consumer, (a_bufs, s_rows, u_bufs, ready, empty, x_smem, x_ready, x_free,
                                 ws_ptr, h_ptr, hs_ptr, block_expert_ptr, block_rows_ptr,
                                 num_tiles, num_n, hidden, inter, stride_we, stride_wn,
                                 stride_hg, 1, SUB, KP, ACT, ACC_LAYOUT, OUT_LAYOUT,
                                 KV_LAYOUT)),
            (_gate_up_loader, (x_ptr, xs_ptr, g_desc, a_bufs, s_rows, g_bufs, u_bufs, ready,
                               empty, sorted_ptr, block_expert_ptr, block_rows_ptr, num_tiles,
                               num_n, hidden, inter, top_k, stride_xs, SUB, A_LAYOUT,
                               S_LAYOUT)),
        ], [4, 1], GATE_UP_REGS)

    @functools.lru_cache(maxsize=None)
    def _smem(shape: tuple[int, ...]):
        return gl.NVMMASharedLayout.get_default_for(list(shape), gl.float8e4nv)

    def _acc_layout(block_n: int):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, block_n, 32])

    @functools.lru_cache(maxsize=None)
    def _layouts(groups: int, out_dtype, cols: int) -> dict[str, Any]:
        """A launch's layouts for sums of `cols` columns, made once (building them cost a
        launch tens of µs)."""
        kp = 1 << max(0, groups - 1).bit_length()
        vec = 16 // (1 if out_dtype == gl.float8e4nv else 2)  # 16 bytes a thread
        return dict(KP=kp, ACC_LAYOUT=_acc_layout(cols),
                    OUT_LAYOUT=gl.BlockedLayout([1, vec], [32 * vec // cols, cols // vec],
                                                [4, 1], [1, 0]),
                    KV_LAYOUT=gl.BlockedLayout([1], [32], [4], [0]),
                    ROWS_SMEM=gl.SwizzledSharedLayout(1, 1, 1, [0]))

    def _common(groups: int, block_k: int, out_dtype) -> dict[str, Any]:
        return dict(SUB=WS_GROUP // block_k, **_layouts(groups, out_dtype, WS_BLOCK_N))

    @functools.lru_cache(maxsize=None)
    def _gather(block_k: int) -> dict[str, Any]:
        """gate_up's layouts of x's gathered rows and their scales (the loader warp's
        cp.async: 16 bytes a copy), its stages' and the exchanged tile's shared layouts."""
        return dict(A_SMEM=_smem((WS_BLOCK_M, block_k)),
                    X_SMEM=gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
                    A_LAYOUT=gl.BlockedLayout([1, 16], [32 * 16 // block_k, block_k // 16],
                                              [1, 1], [1, 0]),
                    S_LAYOUT=gl.BlockedLayout([2], [32], [1], [0]))

    # h's scales: [1, BLOCK_M] float32 TMA boxes, unswizzled
    _ROWS_TMA = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
                  torch.float32: gl.float32}


def _programs(device: torch.device, tiles: int) -> int:
    """One program an SM, at most one a tile."""
    return max(1, min(_sm_count(device.index or 0), tiles))


def down_fp8_ws(h: torch.Tensor, hs_GR: torch.Tensor, w2: torch.Tensor, w2_s: torch.Tensor,
                blocks, topk_weights_P: torch.Tensor, dst: torch.Tensor, top_k: int,
                cfg: dict[str, Any], atomic: bool) -> None:
    """fused_moe_fp8.down's GEMM (the caller checked `usable`): h fp8 [rows, I] in block
    order, its scales group-major hs_GR [I / 128, rows]."""
    num_local, hidden, inter = w2.shape
    bm, bn, bk = WS_BLOCK_M, WS_BLOCK_N, cfg["BLOCK_K"]
    a_desc = TensorDescriptor.from_tensor(h, [bm, bk], _smem((bm, bk)))
    b_desc = TensorDescriptor.from_tensor(w2.view(num_local * hidden, inter), [bn, bk],
                                          _smem((bn, bk)))
    s_desc = TensorDescriptor.from_tensor(hs_GR, [1, bm], _ROWS_TMA)
    tiles = blocks.num_blocks * (hidden // bn)
    # a program's two consumers take a tile each
    _down_fp8_ws_kernel[(_programs(h.device, -(-tiles // 2)),)](
        a_desc, s_desc, b_desc, w2_s, dst, blocks.sorted_pairs, blocks.block_expert,
        blocks.block_rows, topk_weights_P, blocks.num_blocks, hidden, inter, max(top_k, 1),
        w2_s.stride(0), w2_s.stride(1), STAGES=cfg["num_stages"], ATOMIC_SUM=atomic,
        **_common(inter // WS_GROUP, bk, _GL_DTYPES[dst.dtype]), num_warps=4)


def gate_up_fp8_ws(xq: torch.Tensor, xs: torch.Tensor, w13: torch.Tensor, w13_s: torch.Tensor,
                   blocks, top_k: int, act: str, cfg: dict[str, Any], h: torch.Tensor,
                   hs_GR: torch.Tensor) -> None:
    """fused_moe_fp8.gate_up's GEMM into h [rows, I] fp8 and hs_GR [I / 128, rows] (the caller
    checked `usable`): x's rows gathered by token, xs [N, H / 128] their scales."""
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    bn, bk = WS_BLOCK_N, cfg["BLOCK_K"]
    g_desc = TensorDescriptor.from_tensor(w13.view(num_local * two_i, hidden), [bn, bk],
                                          _smem((bn, bk)))
    tiles = blocks.num_blocks * (inter // bn)
    _gate_up_fp8_ws_kernel[(_programs(xq.device, tiles),)](
        xq, xs, g_desc, w13_s, h, hs_GR, blocks.sorted_pairs, blocks.block_expert,
        blocks.block_rows, blocks.num_blocks, hidden, inter, top_k, xs.stride(0),
        w13_s.stride(0), w13_s.stride(1), hs_GR.stride(0), STAGES=cfg["num_stages"],
        BLOCK_K=bk, ACT=ACT_CODES[act],
        **_common(hidden // WS_GROUP, bk, gl.float8e4nv), **_gather(bk), num_warps=4)
