"""fp8_ws.py's grouped GEMMs on 128-row blocks (BLOCK_M 128): the two consumer warpgroups
share each tile, one 64-row half each, so a stage's weight rows serve 128 rows of the block.

Why: a 64-row tile reads its weight slab from L2 for 64 rows only; 128 rows halve the weight
bytes a FLOP. Both kernels' tiles are 128 x 256 products (gate_up: 128 gate and 128 up
columns): a 128 x 128 down tile, whose two halves reach their epilogue together rather than
one under the other's MMAs, timed no faster than fp8_ws.py's 64-row down. The down takes a
hidden size that is a multiple of 256 (`down_usable`).

    down     tiles (block t // num_n, the 256 columns t % num_n: two weight-scale blocks);
             one ring: h's 128 rows, their scales and w2's 2 x 128 rows by TMA
    gate_up  tiles (block, the 128 columns of h); one ring: x's 128 rows gathered by cp.async
             (fp8_ws.py's loader: a warpgroup, so that a thread holds few row addresses)
             with their scales, w13's 128 gate and 128 up rows by TMA
    both     consumer c loads rows [64 c, 64 c + 64) of the stage into registers (the
             wgmma's A from registers) and runs four wgmmas of 64 columns each (the first
             slab's two halves, then the second's: gate, up for gate_up), each into a
             64 x 64 scratch promoted into its quarter of the tile's sums (_tile_sums):
             4 x 32 + 32 float32 registers a thread, where 64 x 128 sums of gate and up and
             a scratch (192) spill. down adds its half of the tile into the output (or stores
             it at the pairs' rows); gate_up quantizes act(gate) * up per row, one group

BLOCK_K is 128 (a scale group a stage). The arithmetic is fp8_ws's (and the Triton kernels'
at 128-column K steps).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from moeserve.kernels.elementwise.act import ACT_CODES
from moeserve.kernels.moe import fp8_ws as W

gluon = W.gluon
if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from moeserve.kernels.moe.fp8_ws import (FP8_MAX, _act, _emit, _round_e4m3, _scalar,
                                              _stage)

BLOCK_M, HALF, BLOCK_N, BLOCK_K = 128, 64, 128, 128  # HALF: a consumer's rows

if gluon is not None:
    # the same as the kernels read them (a kernel reads globals that are constexpr)
    _BM, _HALF, _BN, _BK = (gl.constexpr(v) for v in (BLOCK_M, HALF, BLOCK_N, BLOCK_K))
    GATE_UP_REGS = gl.constexpr([208, 88])  # [consumer 1, loader (4 warps)]
    DOWN_REGS = gl.constexpr([216, 64])  # [consumer 1, loader (1 warp, 4 TMA copies)]

    @gluon.jit
    def _quarter(a_r, w, tmp, acc, a_s, b_s, ROW0: gl.constexpr):
        """acc += (a_r . w[ROW0:ROW0 + 64]^T) * a_s * b_s: a 64-column wgmma, A in registers."""
        tmp = warpgroup_mma(a_r, w.slice(ROW0, _HALF, dim=0).permute((1, 0)), tmp,
                            use_acc=False, is_async=True)
        tmp = warpgroup_mma_wait(0, deps=(tmp,))
        return tmp, acc + tmp * (a_s * b_s)[:, None]

    # ---------------------------------------------------------------- down

    @gluon.jit
    def _slab_scales(block_expert_ptr, ws_ptr, t, num_tiles, num_n, stride_we, stride_wn,
                     groups, SPAN: gl.constexpr, off_b, KP: gl.constexpr,
                     layout: gl.constexpr):
        """Tile t's expert and the block scales of its two weight slabs, block rows
        SPAN (t % num_n) and that + off_b (the last tile's past the end), loaded a tile before
        the consumer takes the tile."""
        t = gl.minimum(t, num_tiles - 1)
        expert = gl.load(block_expert_ptr + t // num_n)
        e = gl.maximum(expert, 0)
        nb = SPAN * (t % num_n)
        return (expert, W._block_scales(ws_ptr, e, nb, stride_we, stride_wn, groups, KP, layout),
                W._block_scales(ws_ptr, e, nb + off_b, stride_we, stride_wn, groups, KP,
                                layout))

    @gluon.jit
    def _tile_sums(a_bufs, s_rows, wa_bufs, wb_bufs, ready, empty, it, groups, sva, svb,
                   c: gl.constexpr, KP: gl.constexpr, ACC_LAYOUT: gl.constexpr,
                   A_REGS: gl.constexpr, KV_LAYOUT: gl.constexpr):
        """Rows [64 c, 64 c + 64) of a tile times its two weight slabs over K: four 64 x 64
        float32 quarters (wa's two halves, then wb's), promoted a stage at a time."""
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        ROW_L: gl.constexpr = gl.SliceLayout(1, ACC_LAYOUT)
        q0 = gl.zeros((_HALF, _HALF), dtype=gl.float32, layout=ACC_LAYOUT)
        q1 = gl.zeros((_HALF, _HALF), dtype=gl.float32, layout=ACC_LAYOUT)
        q2 = gl.zeros((_HALF, _HALF), dtype=gl.float32, layout=ACC_LAYOUT)
        q3 = gl.zeros((_HALF, _HALF), dtype=gl.float32, layout=ACC_LAYOUT)
        tmp = gl.zeros((_HALF, _HALF), dtype=gl.float32, layout=ACC_LAYOUT)
        for kb in range(0, groups):
            s, phase = _stage(it, 0, STAGES)
            mbarrier.wait(ready.index(s), phase)
            a_r = a_bufs.index(s).slice(c * _HALF, _HALF, dim=0).load(A_REGS)
            a_s = s_rows.index(s).slice(c * _HALF, _HALF).load(ROW_L)
            sa = _scalar(sva, kb, KP, KV_LAYOUT)
            sb = _scalar(svb, kb, KP, KV_LAYOUT)
            tmp, q0 = _quarter(a_r, wa_bufs.index(s), tmp, q0, a_s, sa, 0)
            tmp, q1 = _quarter(a_r, wa_bufs.index(s), tmp, q1, a_s, sa, _HALF)
            tmp, q2 = _quarter(a_r, wb_bufs.index(s), tmp, q2, a_s, sb, 0)
            tmp, q3 = _quarter(a_r, wb_bufs.index(s), tmp, q3, a_s, sb, _HALF)
            mbarrier.arrive(empty.index(s))
            it += 1
        return it, q0, q1, q2, q3

    @gluon.jit
    def _down_loader(a_desc, s_desc, b_desc, a_bufs, s_bufs, b0_bufs, b1_bufs, ready, empty,
                      block_expert_ptr, num_tiles, num_n, hidden, inter):
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        nbytes: gl.constexpr = (a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
                                + s_desc.block_type.nbytes)
        it = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            blk = t // num_n
            expert = gl.load(block_expert_ptr + blk)
            if expert >= 0:
                w_row = expert * hidden + (t % num_n) * (2 * _BN)
                for kb in range(0, inter // _BK):
                    s, phase = _stage(it, 0, STAGES)
                    mbarrier.wait(empty.index(s), phase ^ 1)
                    mbarrier.expect(ready.index(s), nbytes)
                    tma.async_copy_global_to_shared(a_desc, [blk * _BM, kb * _BK],
                                                    ready.index(s), a_bufs.index(s))
                    tma.async_copy_global_to_shared(b_desc, [w_row, kb * _BK],
                                                    ready.index(s), b0_bufs.index(s))
                    tma.async_copy_global_to_shared(b_desc, [w_row + _BN, kb * _BK],
                                                    ready.index(s), b1_bufs.index(s))
                    tma.async_copy_global_to_shared(s_desc, [kb, blk * _BM],
                                                    ready.index(s), s_bufs.index(s))
                    it += 1

    @gluon.jit
    def _down_consumer(a_bufs, s_rows, b0_bufs, b1_bufs, ready, empty, ws_ptr, y_ptr,
                        sorted_ptr, block_expert_ptr, block_rows_ptr, topk_weights_ptr,
                        num_tiles, num_n, hidden, inter, top_k, stride_we, stride_wn,
                        c: gl.constexpr, KP: gl.constexpr, ACC_LAYOUT: gl.constexpr,
                        A_REGS: gl.constexpr, OUT_LAYOUT: gl.constexpr,
                        KV_LAYOUT: gl.constexpr, ATOMIC_SUM: gl.constexpr):
        """Rows [64 c, 64 c + 64) of each 128 x 256 tile, in four 64 x 64 quarters."""
        ROW_L: gl.constexpr = gl.SliceLayout(1, ACC_LAYOUT)
        groups = inter // _BK
        offs_o = c * _HALF + gl.arange(0, _HALF, layout=gl.SliceLayout(1, OUT_LAYOUT))
        offs_n = gl.arange(0, _HALF, layout=gl.SliceLayout(0, OUT_LAYOUT))
        step = gl.num_programs(0)
        first = gl.program_id(0)
        expert_next, sv0_next, sv1_next = _slab_scales(block_expert_ptr, ws_ptr, first,
                                                       num_tiles, num_n, stride_we, stride_wn,
                                                       groups, 2, 1, KP, KV_LAYOUT)
        it = 0
        for t in range(first, num_tiles, step):
            expert = expert_next
            sv0 = sv0_next
            sv1 = sv1_next
            expert_next, sv0_next, sv1_next = _slab_scales(block_expert_ptr, ws_ptr, t + step,
                                                           num_tiles, num_n, stride_we,
                                                           stride_wn, groups, 2, 1, KP,
                                                           KV_LAYOUT)
            if expert >= 0:
                it, q0, q1, q2, q3 = _tile_sums(a_bufs, s_rows, b0_bufs, b1_bufs, ready, empty,
                                                it, groups, sv0, sv1, c, KP, ACC_LAYOUT,
                                                A_REGS, KV_LAYOUT)
                blk = t // num_n
                rows = gl.load(block_rows_ptr + blk)
                ok = offs_o < rows
                pair = gl.load(sorted_ptr + blk * _BM + offs_o, mask=ok, other=0)
                weight = gl.convert_layout(
                    gl.load(topk_weights_ptr + pair, mask=ok, other=0.0), ROW_L)
                n0 = (t % num_n) * (2 * _BN) + offs_n
                _emit(q0, weight, y_ptr, pair, ok, n0, hidden, top_k, OUT_LAYOUT, ATOMIC_SUM)
                _emit(q1, weight, y_ptr, pair, ok, n0 + _HALF, hidden, top_k, OUT_LAYOUT,
                      ATOMIC_SUM)
                _emit(q2, weight, y_ptr, pair, ok, n0 + 2 * _HALF, hidden, top_k, OUT_LAYOUT,
                      ATOMIC_SUM)
                _emit(q3, weight, y_ptr, pair, ok, n0 + 3 * _HALF, hidden, top_k, OUT_LAYOUT,
                      ATOMIC_SUM)

    @gluon.jit(do_not_specialize=["num_blocks", "top_k"])
    def _down128_kernel(a_desc, s_desc, b_desc, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr,
                        block_rows_ptr, topk_weights_ptr, num_blocks, hidden, inter, top_k,
                        stride_we, stride_wn, STAGES: gl.constexpr, KP: gl.constexpr,
                        ACC_LAYOUT: gl.constexpr, A_REGS: gl.constexpr,
                        OUT_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
                        ROWS_SMEM: gl.constexpr, ATOMIC_SUM: gl.constexpr):
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, _BM, _BK], a_desc.layout)
        b0_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, _BN, _BK], b_desc.layout)
        b1_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, _BN, _BK], b_desc.layout)
        s_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, _BM], s_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both halves release a stage
        s_rows = s_bufs._reinterpret(gl.float32, [STAGES, _BM], ROWS_SMEM)
        num_n = hidden // (2 * _BN)
        num_tiles = num_blocks * num_n
        gl.warp_specialize([
            (_down_consumer, (a_bufs, s_rows, b0_bufs, b1_bufs, ready, empty, ws_ptr, y_ptr,
                               sorted_ptr, block_expert_ptr, block_rows_ptr, topk_weights_ptr,
                               num_tiles, num_n, hidden, inter, top_k, stride_we, stride_wn, 0,
                               KP, ACC_LAYOUT, A_REGS, OUT_LAYOUT, KV_LAYOUT, ATOMIC_SUM)),
            (_down_consumer, (a_bufs, s_rows, b0_bufs, b1_bufs, ready, empty, ws_ptr, y_ptr,
                               sorted_ptr, block_expert_ptr, block_rows_ptr, topk_weights_ptr,
                               num_tiles, num_n, hidden, inter, top_k, stride_we, stride_wn, 1,
                               KP, ACC_LAYOUT, A_REGS, OUT_LAYOUT, KV_LAYOUT, ATOMIC_SUM)),
            (_down_loader, (a_desc, s_desc, b_desc, a_bufs, s_bufs, b0_bufs, b1_bufs, ready,
                             empty, block_expert_ptr, num_tiles, num_n, hidden, inter)),
        ], [4, 1], DOWN_REGS)

    # ---------------------------------------------------------------- gate_up

    @gluon.jit
    def _store_codes(h, scale, h_ptr, row, cols, ok, inter, OUT_LAYOUT: gl.constexpr):
        """h's e4m3 codes at its rows' columns `cols` of the [rows, I] output."""
        code = _round_e4m3(gl.minimum(gl.maximum(gl.div_rn(h, scale[:, None]), -FP8_MAX),
                                      FP8_MAX))
        out = gl.convert_layout(code.to(h_ptr.dtype.element_ty), OUT_LAYOUT)
        gl.store(h_ptr + row[:, None] * inter + cols[None, :], out,
                 mask=ok & (cols < inter)[None, :])

    @gluon.jit
    def _gate_up_consumer(a_bufs, s_rows, g_bufs, u_bufs, ready, empty, ws_ptr, h_ptr, hs_ptr,
                          block_expert_ptr, block_rows_ptr, num_tiles, num_n, hidden, inter,
                          stride_we, stride_wn, stride_hg, c: gl.constexpr, KP: gl.constexpr,
                          ACT: gl.constexpr, ACC_LAYOUT: gl.constexpr, A_REGS: gl.constexpr,
                          OUT_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr):
        """Rows [64 c, 64 c + 64) of each tile: its gate and up sums in four 64 x 64 quarters;
        act(gate) * up quantized per row over the tile's 128 columns (one group of h)."""
        ROW_L: gl.constexpr = gl.SliceLayout(1, ACC_LAYOUT)
        groups = hidden // _BK
        offs_r = c * _HALF + gl.arange(0, _HALF, layout=ROW_L)
        offs_o = c * _HALF + gl.arange(0, _HALF, layout=gl.SliceLayout(1, OUT_LAYOUT))
        offs_n = gl.arange(0, _HALF, layout=gl.SliceLayout(0, OUT_LAYOUT))
        step = gl.num_programs(0)
        first = gl.program_id(0)
        expert_next, gsv_next, usv_next = _slab_scales(block_expert_ptr, ws_ptr, first,
                                                       num_tiles, num_n, stride_we, stride_wn,
                                                       groups, 1, num_n, KP, KV_LAYOUT)
        it = 0
        for t in range(first, num_tiles, step):
            expert = expert_next
            gsv = gsv_next
            usv = usv_next
            expert_next, gsv_next, usv_next = _slab_scales(block_expert_ptr, ws_ptr, t + step,
                                                           num_tiles, num_n, stride_we,
                                                           stride_wn, groups, 1, num_n, KP,
                                                           KV_LAYOUT)
            if expert >= 0:
                it, g0, g1, u0, u1 = _tile_sums(a_bufs, s_rows, g_bufs, u_bufs, ready, empty,
                                                it, groups, gsv, usv, c, KP, ACC_LAYOUT,
                                                A_REGS, KV_LAYOUT)
                h0 = _act(g0, ACT) * u0
                h1 = _act(g1, ACT) * u1
                amax = gl.maximum(gl.max(gl.abs(h0), axis=1), gl.max(gl.abs(h1), axis=1))
                scale = gl.maximum(amax, 1e-10) * (1.0 / 448.0)
                blk = t // num_n
                rows = gl.load(block_rows_ptr + blk)
                nb = t % num_n
                row = (blk * _BM + offs_o).to(gl.int64)
                ok = (offs_o < rows)[:, None]
                _store_codes(h0, scale, h_ptr, row, nb * _BN + offs_n, ok, inter,
                             OUT_LAYOUT)
                _store_codes(h1, scale, h_ptr, row, nb * _BN + _HALF + offs_n, ok, inter,
                             OUT_LAYOUT)
                gl.store(hs_ptr + nb * stride_hg + blk * _BM + offs_r, scale,
                         mask=offs_r < rows)

    @gluon.jit(do_not_specialize=["num_blocks", "top_k"])
    def _gate_up128_kernel(x_ptr, xs_ptr, g_desc, ws_ptr, h_ptr, hs_ptr, sorted_ptr,
                           block_expert_ptr, block_rows_ptr, num_blocks, hidden, inter, top_k,
                           stride_xs, stride_we, stride_wn, stride_hg, STAGES: gl.constexpr,
                           KP: gl.constexpr, ACT: gl.constexpr, ACC_LAYOUT: gl.constexpr,
                           A_REGS: gl.constexpr, OUT_LAYOUT: gl.constexpr,
                           KV_LAYOUT: gl.constexpr, A_SMEM: gl.constexpr,
                           ROWS_SMEM: gl.constexpr, A_LAYOUT: gl.constexpr,
                           S_LAYOUT: gl.constexpr):
        a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, _BM, _BK], A_SMEM)
        g_bufs = gl.allocate_shared_memory(g_desc.dtype, [STAGES, _BN, _BK],
                                           g_desc.layout)
        u_bufs = gl.allocate_shared_memory(g_desc.dtype, [STAGES, _BN, _BK],
                                           g_desc.layout)
        s_rows = gl.allocate_shared_memory(gl.float32, [STAGES, _BM], ROWS_SMEM)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            # the TMA's expect arrival and the loader warpgroup's 128 cp.async arrivals
            mbarrier.init(ready.index(i), count=129)
            mbarrier.init(empty.index(i), count=2)
        num_n = inter // _BN
        num_tiles = num_blocks * num_n
        gl.warp_specialize([
            (_gate_up_consumer, (a_bufs, s_rows, g_bufs, u_bufs, ready, empty, ws_ptr, h_ptr,
                                 hs_ptr, block_expert_ptr, block_rows_ptr, num_tiles, num_n,
                                 hidden, inter, stride_we, stride_wn, stride_hg, 0, KP, ACT,
                                 ACC_LAYOUT, A_REGS, OUT_LAYOUT, KV_LAYOUT)),
            (_gate_up_consumer, (a_bufs, s_rows, g_bufs, u_bufs, ready, empty, ws_ptr, h_ptr,
                                 hs_ptr, block_expert_ptr, block_rows_ptr, num_tiles, num_n,
                                 hidden, inter, stride_we, stride_wn, stride_hg, 1, KP, ACT,
                                 ACC_LAYOUT, A_REGS, OUT_LAYOUT, KV_LAYOUT)),
            # fp8_ws.py's loader, a scale group a stage (its warpgroup holds 128 rows' addresses)
            (W._gate_up_loader, (x_ptr, xs_ptr, g_desc, a_bufs, s_rows, g_bufs, u_bufs, ready,
                                 empty, sorted_ptr, block_expert_ptr, block_rows_ptr, num_tiles,
                                 num_n, hidden, inter, top_k, stride_xs, 1, A_LAYOUT,
                                 S_LAYOUT)),
        ], [4, 4], GATE_UP_REGS)

    @functools.lru_cache(maxsize=None)
    def _launch_layouts(groups: int, out_dtype) -> dict[str, Any]:
        """fp8_ws's layouts for 64-column quarters and the wgmma's A from registers."""
        common = W._layouts(groups, out_dtype, HALF)
        return dict(A_REGS=gl.DotOperandLayout(operand_index=0, parent=common["ACC_LAYOUT"],
                                               k_width=4), **common)

    @functools.lru_cache(maxsize=None)
    def _gather() -> dict[str, Any]:
        """gate_up's layouts of x's 128 gathered rows (the loader warpgroup's cp.async: 16
        bytes a copy) and their scales, and its stages' shared layout."""
        return dict(A_SMEM=W._smem((BLOCK_M, BLOCK_K)),
                    A_LAYOUT=gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]),
                    S_LAYOUT=gl.BlockedLayout([1], [32], [4], [0]))


def usable(w: torch.Tensor, block: tuple[int, int], block_m: int, cfg: dict[str, Any]) -> bool:
    """Whether gate_up128 takes this GEMM (w13 [E, 2I, H], fp8)."""
    return (block_m == BLOCK_M and cfg.get("BLOCK_K") == BLOCK_K
            and W.usable(w, block, W.WS_BLOCK_M, cfg))


def down_usable(w2: torch.Tensor, block: tuple[int, int], block_m: int,
                cfg: dict[str, Any]) -> bool:
    """Whether down128 takes this GEMM (w2 [E, H, I], fp8): its tiles are 256 columns of H."""
    return usable(w2, block, block_m, cfg) and w2.shape[1] % (2 * BLOCK_N) == 0


def gate_up128(xq: torch.Tensor, xs: torch.Tensor, w13: torch.Tensor, w13_s: torch.Tensor,
               blocks, top_k: int, act: str, cfg: dict[str, Any], h: torch.Tensor,
               hs_GR: torch.Tensor) -> None:
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    g_desc = TensorDescriptor.from_tensor(w13.view(num_local * two_i, hidden),
                                          [BLOCK_N, BLOCK_K], W._smem((BLOCK_N, BLOCK_K)))
    tiles = blocks.num_blocks * (inter // BLOCK_N)
    _gate_up128_kernel[(W._programs(xq.device, tiles),)](
        xq, xs, g_desc, w13_s, h, hs_GR, blocks.sorted_pairs, blocks.block_expert,
        blocks.block_rows, blocks.num_blocks, hidden, inter, top_k, xs.stride(0),
        w13_s.stride(0), w13_s.stride(1), hs_GR.stride(0), STAGES=cfg["num_stages"],
        ACT=ACT_CODES[act], **_gather(), **_launch_layouts(hidden // BLOCK_K, gl.float8e4nv),
        num_warps=4)


def down128(h: torch.Tensor, hs_GR: torch.Tensor, w2: torch.Tensor, w2_s: torch.Tensor,
            blocks, topk_weights_P: torch.Tensor, dst: torch.Tensor, top_k: int,
            cfg: dict[str, Any], atomic: bool) -> None:
    num_local, hidden, inter = w2.shape
    a_desc = TensorDescriptor.from_tensor(h, [BLOCK_M, BLOCK_K], W._smem((BLOCK_M, BLOCK_K)))
    b_desc = TensorDescriptor.from_tensor(w2.view(num_local * hidden, inter),
                                          [BLOCK_N, BLOCK_K], W._smem((BLOCK_N, BLOCK_K)))
    s_desc = TensorDescriptor.from_tensor(hs_GR, [1, BLOCK_M], W._ROWS_TMA)
    tiles = blocks.num_blocks * (hidden // (2 * BLOCK_N))
    _down128_kernel[(W._programs(h.device, tiles),)](
        a_desc, s_desc, b_desc, w2_s, dst, blocks.sorted_pairs, blocks.block_expert,
        blocks.block_rows, topk_weights_P, blocks.num_blocks, hidden, inter, max(top_k, 1),
        w2_s.stride(0), w2_s.stride(1), STAGES=cfg["num_stages"], ATOMIC_SUM=atomic,
        **_launch_layouts(inter // BLOCK_K, W._GL_DTYPES[dst.dtype]), num_warps=4)
