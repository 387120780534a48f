"""The down GEMM of fused_moe.py as a persistent, warp-specialised Gluon kernel for sm90.

Same contract and the same bits as fused_moe's Triton down kernel: y_PH[p] = weight_p *
(h[row of p] . w2[e]) for every row of every used block, written at the pair's own slot.
What differs is how the work is scheduled, in three partitions of one program per SM:

    tiles      t = program, program + programs, ...: (block t // num_n, BLOCK_N columns)
    loader     2 warps: TMA loads of h's rows [BLOCK_M, BLOCK_K] (contiguous in block order)
               and of w2[e]'s rows [BLOCK_N, BLOCK_K] into a ring of STAGES buffers
               (mbarriers ready / empty); it runs ahead across tiles, so the next tile's
               operands arrive while the last one is written out
    MMA        num_warps warps: asynchronous wgmma over the ring; then the tile times the
               pairs' weights, in bf16, into out_smem. No global load on this path but the
               next tile's expert, issued a tile ahead
    store      2 warps: per tile, the pairs' weights into w_smem (the dependent loads, pair
               then weight, off the MMA path), then the finished tile from out_smem to the
               pairs' rows of y, one warp writing one pair's BLOCK_N columns at a time

Triton's own kernel (fused_moe._down_kernel) issues loads and MMAs from the same warps with a
CTA barrier at each K step, waits for its first loads at every tile and writes each tile out
before the next starts: at K = 768 (Qwen3-30B-A3B) that was a third of a tile's time.

With "ATOMIC_SUM", the store warps add each row into its token's row of the [N, H] output
(fused_moe.down_summed) rather than writing it at the pair's slot.

With "HALF_TAIL" (BLOCK_M >= 128), a block of at most BLOCK_M / 2 rows (an expert's last)
loads only those rows of h and takes MMAs of half the rows, as fused_moe.py's kernels do.

Config: "WS": 1 in a down entry (BLOCK_M >= 64; shared memory: STAGES x (BLOCK_M + BLOCK_N)
x BLOCK_K x 2 bytes plus the BLOCK_M x BLOCK_N bf16 tile, at most 227 KB). `usable` says
whether a call qualifies (a CUDA device of compute capability 9.x, bf16, hidden % BLOCK_N == 0
so that a tile never crosses two experts in the [E * H, I] view of w2, 16-byte aligned
rows); fused_moe takes the Triton kernel when it does not.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # Gluon ships with triton >= 3.5; the CPU build of CI may lack its NVIDIA modules
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma,
                                                                   warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed triton
    gluon = None


def sm90(*tensors: torch.Tensor) -> bool:
    """Gluon's Hopper kernels can run on these tensors: CUDA, compute capability 9.x."""
    return (gluon is not None and all(t.is_cuda for t in tensors)
            and torch.cuda.get_device_capability(tensors[0].device)[0] == 9)


def usable(w2: torch.Tensor, h: torch.Tensor, cfg: dict[str, Any], block_m: int) -> bool:
    # a wgmma tile has 64 rows a warpgroup: a half tile needs BLOCK_M >= 128
    if block_m < (128 if cfg.get("HALF_TAIL") else 64) or not sm90(w2, h):
        return False
    _, hidden, inter = w2.shape
    return (hidden % cfg["BLOCK_N"] == 0 and (inter * w2.element_size()) % 16 == 0
            and w2.is_contiguous() and h.is_contiguous() and w2.data_ptr() % 16 == 0
            and h.data_ptr() % 16 == 0 and w2.dtype == h.dtype == torch.bfloat16)


if gluon is not None:
    # registers a thread of the loader warp and of the store warps keep (setmaxnreg)
    LOADER_REGS = gl.constexpr(40)
    STORE_REGS = gl.constexpr(80)
    STORE_CHUNK = 16  # rows of a tile that the store warps write at a time

    def _mma_layout(block_m: int, block_n: int, num_warps: int):
        """The wgmma accumulator layout: warps down M first (64 rows a warpgroup), then N."""
        warps = [4, 1]
        while warps[0] * warps[1] != num_warps:
            if block_m > 16 * warps[0]:
                warps[0] *= 2
            else:
                warps[1] *= 2
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps,
                                         instr_shape=[16, min(256, block_n // warps[1]), 16])

    @gluon.jit
    def _loader(a_desc, a_half_desc, b_desc, a_bufs, b_bufs, ready, empty, block_expert_ptr,
                block_rows_ptr, num_tiles, num_n, hidden, inter, HALF_TAIL: gl.constexpr):
        """HALF_TAIL: a block of at most BLOCK_M / 2 rows loads only that many rows of h."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        HALF: gl.constexpr = a_half_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        it = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            blk = t // num_n
            expert = gl.load(block_expert_ptr + blk)
            if expert >= 0:
                half = HALF_TAIL and gl.load(block_rows_ptr + blk) <= HALF
                w_row = expert * hidden + (t % num_n) * BLOCK_N
                for k in range(0, inter, BLOCK_K):
                    s = it % STAGES
                    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                    if half:
                        mbarrier.expect(ready.index(s), a_half_desc.block_type.nbytes
                                        + b_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(a_half_desc, [blk * BLOCK_M, k],
                                                        ready.index(s),
                                                        a_bufs.index(s).slice(0, HALF, dim=0))
                    else:
                        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes
                                        + b_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(a_desc, [blk * BLOCK_M, k],
                                                        ready.index(s), a_bufs.index(s))
                    tma.async_copy_global_to_shared(b_desc, [w_row, k], ready.index(s),
                                                    b_bufs.index(s))
                    it += 1

    @gluon.jit
    def _mma_tile(a_bufs, b_bufs, ready, empty, it, inter, M: gl.constexpr,
                  BLOCK_K: gl.constexpr, acc_layout: gl.constexpr):
        """One tile's MMAs over the ring (the first M rows of each h stage); returns the
        accumulator and the ring position after it."""
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
        acc = gl.zeros((M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        for k in range(0, inter, BLOCK_K):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            a = a_bufs.index(s).slice(0, M, dim=0)
            acc = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            # at most one MMA in flight: the one before this has read its stage
            acc, _, _ = warpgroup_mma_wait(1, deps=(acc, a, b_bufs.index(s)))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=k > 0)
            it += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
        return acc, it

    @gluon.jit
    def _weighted_out(acc, w_smem, w_ready, out_smem, out_free, out_ready, done,
                      acc_layout: gl.constexpr):
        """The tile times the pairs' top-k weights, in bf16, into the first rows of
        out_smem."""
        M: gl.constexpr = acc.shape[0]
        mbarrier.wait(w_ready, done & 1)
        weight = w_smem.slice(0, M).load(gl.SliceLayout(1, acc_layout))
        y = (acc * weight[:, None]).to(out_smem.dtype)
        mbarrier.wait(out_free, (done & 1) ^ 1)
        out_smem.slice(0, M, dim=0).store(y)
        mbarrier.arrive(out_ready)

    @gluon.jit
    def _mma(a_bufs, b_bufs, ready, empty, block_expert_ptr, block_rows_ptr, out_smem,
             out_ready, out_free, w_smem, w_ready, num_tiles, num_n, inter,
             BLOCK_K: gl.constexpr, acc_layout: gl.constexpr, half_layout: gl.constexpr,
             HALF_TAIL: gl.constexpr):
        """The MMAs over the ring; each finished tile, times the pairs' top-k weights (which
        the store warps put in w_smem), goes to out_smem in bf16. The only global loads, the
        next tile's expert and rows, are issued a tile ahead. HALF_TAIL: a block of at most
        BLOCK_M / 2 rows takes MMAs of half the rows."""
        BLOCK_M: gl.constexpr = out_smem.type.shape[0]
        step = gl.num_programs(0)
        first = gl.program_id(0)
        expert_next = gl.load(block_expert_ptr + first // num_n)
        rows_next = gl.load(block_rows_ptr + first // num_n)
        it = 0
        done = 0
        for t in range(first, num_tiles, step):
            expert = expert_next
            rows = rows_next
            after = gl.minimum(t + step, num_tiles - 1) // num_n
            expert_next = gl.load(block_expert_ptr + after)
            rows_next = gl.load(block_rows_ptr + after)
            if expert >= 0:
                if HALF_TAIL and rows <= BLOCK_M // 2:
                    # (its own name: a value merged after the branches has one type)
                    half, it = _mma_tile(a_bufs, b_bufs, ready, empty, it, inter, BLOCK_M // 2,
                                         BLOCK_K, half_layout)
                    _weighted_out(half, w_smem, w_ready, out_smem, out_free, out_ready, done,
                                  half_layout)
                else:
                    acc, it = _mma_tile(a_bufs, b_bufs, ready, empty, it, inter, BLOCK_M,
                                        BLOCK_K, acc_layout)
                    _weighted_out(acc, w_smem, w_ready, out_smem, out_free, out_ready, done,
                                  acc_layout)
                done += 1

    @gluon.jit
    def _store_out(out_smem, out_ready, out_free, w_smem, w_ready, y_ptr, sorted_ptr,
                   block_expert_ptr, block_rows_ptr, topk_weights_ptr, num_tiles, num_n,
                   hidden, top_k, CHUNK: gl.constexpr, chunk_layout: gl.constexpr,
                   w_layout: gl.constexpr, ATOMIC_SUM: gl.constexpr):
        """Per tile: its pairs' top-k weights into w_smem for the MMA warps (the dependent
        loads happen here, off their path), then the finished tile from out_smem to the
        pairs' rows of y, CHUNK rows at a time (one warp writes one pair's BLOCK_N columns,
        16 bytes a thread), while the MMA warps go on with the next tile. ATOMIC_SUM: each
        row is added into its token's row of the [N, H] output (16-byte bf16 atomics)."""
        BLOCK_M: gl.constexpr = out_smem.type.shape[0]
        BLOCK_N: gl.constexpr = out_smem.type.shape[1]
        offs_c = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, chunk_layout))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, chunk_layout))
        offs_w = gl.arange(0, BLOCK_M, layout=w_layout)
        done = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            blk = t // num_n
            expert = gl.load(block_expert_ptr + blk)
            rows = gl.load(block_rows_ptr + blk)
            if expert >= 0:
                w_ok = offs_w < rows
                w_pair = gl.load(sorted_ptr + blk * BLOCK_M + offs_w, mask=w_ok, other=0)
                # the MMA warps read the last tile's weights before its out_ready
                w_smem.store(gl.load(topk_weights_ptr + w_pair, mask=w_ok, other=0.0))
                mbarrier.arrive(w_ready)
                cols = (t % num_n) * BLOCK_N + offs_n
                mbarrier.wait(out_ready, done & 1)
                for c in gl.static_range(BLOCK_M // CHUNK):
                    r = c * CHUNK + offs_c
                    ok = r < rows
                    pair = gl.load(sorted_ptr + blk * BLOCK_M + r, mask=ok, other=0)
                    vals = out_smem.slice(c * CHUNK, CHUNK, dim=0).load(chunk_layout)
                    if ATOMIC_SUM:  # (cols < hidden always holds: the mask's full shape)
                        token = (pair // top_k).to(gl.int64)
                        gl.atomic_add(y_ptr + token[:, None] * hidden + cols[None, :], vals,
                                      mask=ok[:, None] & (cols < hidden)[None, :],
                                      sem="relaxed")
                    else:
                        gl.store(y_ptr + pair.to(gl.int64)[:, None] * hidden + cols[None, :],
                                 vals, mask=ok[:, None])
                mbarrier.arrive(out_free)
                done += 1

    # num_blocks follows the step's size: unspecialised, as fused_moe's kernels, so one
    # compile serves every size of a tile config (plan/warmup.py's rule)
    @gluon.jit(do_not_specialize=["num_blocks", "top_k"])
    def _down_ws_kernel(a_desc, a_half_desc, b_desc, y_ptr, sorted_ptr, block_expert_ptr,
                        block_rows_ptr, topk_weights_ptr, num_blocks, hidden, inter, top_k,
                        STAGES: gl.constexpr, HALF_TAIL: gl.constexpr,
                        ACC_LAYOUT: gl.constexpr, HALF_LAYOUT: gl.constexpr, CHUNK: gl.constexpr,
                        CHUNK_LAYOUT: gl.constexpr, OUT_SMEM_LAYOUT: gl.constexpr,
                        W_LAYOUT: gl.constexpr, W_SMEM_LAYOUT: gl.constexpr,
                        ATOMIC_SUM: gl.constexpr):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K],
                                           a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K],
                                           b_desc.layout)
        out_smem = gl.allocate_shared_memory(y_ptr.dtype.element_ty, [BLOCK_M, BLOCK_N],
                                             OUT_SMEM_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        out_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        out_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        w_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], W_SMEM_LAYOUT)
        w_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(out_ready, count=1)
        mbarrier.init(out_free, count=1)
        mbarrier.init(w_ready, count=1)
        num_n = hidden // BLOCK_N
        num_tiles = num_blocks * num_n
        gl.warp_specialize([
            (_mma, (a_bufs, b_bufs, ready, empty, block_expert_ptr, block_rows_ptr, out_smem,
                    out_ready, out_free, w_smem, w_ready, num_tiles, num_n, inter, BLOCK_K,
                    ACC_LAYOUT, HALF_LAYOUT, HALF_TAIL)),
            (_loader, (a_desc, a_half_desc, b_desc, a_bufs, b_bufs, ready, empty,
                       block_expert_ptr, block_rows_ptr, num_tiles, num_n, hidden, inter,
                       HALF_TAIL)),
            (_store_out, (out_smem, out_ready, out_free, w_smem, w_ready, y_ptr, sorted_ptr,
                          block_expert_ptr, block_rows_ptr, topk_weights_ptr, num_tiles,
                          num_n, hidden, top_k, CHUNK, CHUNK_LAYOUT, W_LAYOUT, ATOMIC_SUM)),
        ], [2, 2], [LOADER_REGS, STORE_REGS])


def down_ws(h: torch.Tensor, w2: torch.Tensor, y: torch.Tensor, blocks, topk_weights_P,
            cfg: dict[str, Any], sum_top_k: int = 0) -> None:
    """fused_moe.down's GEMM into y (caller checked `usable`); sum_top_k > 0: y is the zeroed
    [N, H] output and each pair's row is added into its token's (fused_moe.down_summed)."""
    num_local, hidden, inter = w2.shape
    bm, bn, bk = blocks.block_m, cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    a_desc = TensorDescriptor.from_tensor(h, [bm, bk], a_layout)
    # the h rows of a half tile: the same smem layout (its swizzle depends on BLOCK_K alone)
    a_half_desc = TensorDescriptor.from_tensor(h, [bm // 2, bk], a_layout)
    b_desc = TensorDescriptor.from_tensor(w2.view(num_local * hidden, inter), [bn, bk],
                                          b_layout)
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count
    tiles = blocks.num_blocks * (hidden // bn)
    warps = cfg["num_warps"]
    # registers: the kernel runs num_warps + 4 warps (the loader's and the store's 2 + 2);
    # the MMA warps get what those leave of maxnreg x all warps
    maxnreg = min(255, 65536 // (32 * (warps + 4))) // 8 * 8
    _down_ws_kernel[(min(sms, tiles),)](
        a_desc, a_half_desc, b_desc, y, blocks.sorted_pairs, blocks.block_expert,
        blocks.block_rows, topk_weights_P, blocks.num_blocks, hidden, inter, max(sum_top_k, 1),
        STAGES=cfg["num_stages"], HALF_TAIL=bool(cfg.get("HALF_TAIL")),
        ACC_LAYOUT=_mma_layout(bm, bn, warps), HALF_LAYOUT=_mma_layout(bm // 2, bn, warps),
        CHUNK=STORE_CHUNK,
        CHUNK_LAYOUT=gl.BlockedLayout([1, bn // 32], [1, 32], [2, 1], [1, 0]),
        OUT_SMEM_LAYOUT=gl.NVMMASharedLayout.get_default_for([bm, bn], gl.bfloat16),
        W_LAYOUT=gl.BlockedLayout([1], [32], [2], [0]),
        W_SMEM_LAYOUT=gl.SwizzledSharedLayout(1, 1, 1, [0]), ATOMIC_SUM=sum_top_k > 0,
        num_warps=warps,
        maxnreg=maxnreg)
