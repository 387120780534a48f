"""moe_align in Triton (same output as align_torch.py; see its docstring for the format).

Two ways, by the size of the step (P pairs):
- up to ONE_PROGRAM_PAIRS (2048) pairs, one program: count the pairs per expert
  (histograms), write the block map expert-major (round j writes every expert's j-th block),
  store each expert's first row as its cursor, then each pair takes its slot by an atomic add
  on its expert's cursor. One launch, no memset, no [pairs or blocks, experts] tiles.
- larger steps, two launches over chunks of pairs: count (each chunk's histogram atomically
  added to the counts; the value before the add is where the chunk's pairs start in each
  expert's segment), then scatter (each program adds the experts' first rows to its chunk's
  starts, and its pairs take their slots by atomic adds on those cursors of the chunk's own:
  a cursor per expert serialised every pair of an expert on one address, 15.4 us at 65536
  pairs on the H200); the scatter's first program also writes the block map, as above.
With atomics the order inside an expert's segment is arbitrary, which changes no result:
every row of a GEMM tile is computed independently and the top-k sum is taken per pair slot.
No launch reads a count back to the host.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moeserve.kernels.launch.pdl import pdl_args, pdl_gate
from moeserve.kernels.moe.align_torch import AlignedBlocks, Workspace, take
from moeserve.kernels.moe.configs import ALIGN_CHUNK, align_scratch_len, max_blocks

# one program aligns a step of up to this many pairs; past it the two launches are faster
# (graph replays on an H200: the one program's time grows with the pairs, the two launches'
# stays near 6 us, and they cross between 2048 and 3072 pairs for 8 to 128 experts)
ONE_PROGRAM_PAIRS = 2048
_COUNT_CHUNK = ALIGN_CHUNK


@triton.jit
def _local_of(ids_ptr, offs, num_pairs, first_expert, num_local):
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    local = ids - first_expert
    own = (ids >= 0) & (local >= 0) & (local < num_local)
    return tl.where(own, local, 0), own


@triton.jit
def _place_by_expert(counts, e_idx, block_expert_ptr, block_rows_ptr, num_blocks,
                     BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """The whole block map from per-expert counts [E_PAD], expert-major: round j writes every
    expert's j-th block (as many rounds as the most blocks of one expert), then the unused
    blocks; return each expert's first row. One program, no [blocks, experts] search."""
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(nblk, 0)
    blk_start = blk_end - nblk
    for j in range(0, tl.max(nblk, 0)):
        has = j < nblk
        tl.store(block_expert_ptr + blk_start + j, e_idx, mask=has)
        tl.store(block_rows_ptr + blk_start + j, tl.minimum(counts - j * BLOCK_M, BLOCK_M),
                 mask=has)
    for b0 in range(tl.sum(nblk, 0), num_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + b, tl.full([CHUNK], -1, tl.int32), mask=b < num_blocks)
        tl.store(block_rows_ptr + b, tl.zeros([CHUNK], tl.int32), mask=b < num_blocks)
    return blk_start * BLOCK_M


# runtime ints that change with the step are not specialised (no recompile per value)
_STEP_ARGS = ["num_pairs", "first_expert", "num_local", "num_blocks"]


@triton.jit(do_not_specialize=_STEP_ARGS)
def _align_by_cursors(ids_ptr, num_pairs, first_expert, num_local, cursor_ptr, sorted_ptr,
                      block_expert_ptr, block_rows_ptr, num_blocks, BLOCK_M: tl.constexpr,
                      E_PAD: tl.constexpr, CHUNK: tl.constexpr, PLACE_CHUNK: tl.constexpr,
                      PDL: tl.constexpr):
    """One program: counts, the block map, then each pair's slot from an atomic add on its
    expert's cursor (cursor_ptr: E_PAD int32 words of scratch, set here)."""
    pdl_gate(PDL)
    e_idx = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        local, own = _local_of(ids_ptr, p0 + tl.arange(0, CHUNK), num_pairs, first_expert,
                               num_local)
        counts += tl.histogram(local, E_PAD, mask=own)
    cursor = _place_by_expert(counts, e_idx, block_expert_ptr, block_rows_ptr, num_blocks,
                              BLOCK_M, PLACE_CHUNK)
    tl.store(cursor_ptr + e_idx, cursor)
    tl.debug_barrier()  # every cursor stored before any thread adds to one
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        local, own = _local_of(ids_ptr, offs, num_pairs, first_expert, num_local)
        slot = tl.atomic_add(cursor_ptr + local, 1, mask=own, sem="relaxed")
        tl.store(sorted_ptr + slot, offs, mask=own)


@triton.jit(do_not_specialize=_STEP_ARGS[:3])
def _count_kernel(ids_ptr, num_pairs, first_expert, num_local, counts_ptr, chunk_ptr,
                  E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Adds the chunk's histogram to counts and keeps, per expert, where the chunk's pairs
    start within the expert's segment (the counts before its add)."""
    pdl_gate(PDL)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    local, own = _local_of(ids_ptr, offs, num_pairs, first_expert, num_local)
    e_idx = tl.arange(0, E_PAD)
    before = tl.atomic_add(counts_ptr + e_idx, tl.histogram(local, E_PAD, mask=own),
                           mask=e_idx < num_local)
    tl.store(chunk_ptr + tl.program_id(0) * E_PAD + e_idx, before)


@triton.jit(do_not_specialize=_STEP_ARGS)
def _scatter_kernel(ids_ptr, num_pairs, first_expert, num_local, counts_ptr, chunk_ptr,
                    sorted_ptr, block_expert_ptr, block_rows_ptr, num_blocks,
                    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                    PLACE_CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Each pair to its expert's first row + its chunk's start within the expert + its rank in
    the chunk, the last from an atomic add on the chunk's own cursors (few pairs share one,
    where a cursor per expert had every pair of the step). Every program finds the experts'
    first rows from the counts (a prefix sum over E_PAD, cheap); program 0 also writes the
    block map."""
    pdl_gate(PDL)
    e_idx = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + e_idx)
    if tl.program_id(0) == 0:
        first_row = _place_by_expert(counts, e_idx, block_expert_ptr, block_rows_ptr,
                                     num_blocks, BLOCK_M, PLACE_CHUNK)
    else:
        nblk = (counts + BLOCK_M - 1) // BLOCK_M
        first_row = (tl.cumsum(nblk, 0) - nblk) * BLOCK_M
    row = chunk_ptr + tl.program_id(0) * E_PAD
    tl.store(row + e_idx, tl.load(row + e_idx) + first_row)
    tl.debug_barrier()  # the chunk's cursors stored before any thread adds to one
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    local, own = _local_of(ids_ptr, offs, num_pairs, first_expert, num_local)
    slot = tl.atomic_add(row + local, 1, mask=own, sem="relaxed")
    tl.store(sorted_ptr + slot, offs, mask=own)


def _e_pad(num_local: int) -> int:
    return max(16, triton.next_power_of_2(num_local))


def one_program(num_pairs: int) -> bool:
    """Whether align_triton aligns these pairs in one program (else in two launches)."""
    return num_pairs <= ONE_PROGRAM_PAIRS


def align_triton(topk_ids_NK: torch.Tensor, first_expert: int, num_local: int,
                 block_m: int, ws: Optional[Workspace] = None) -> AlignedBlocks:
    """The block map of the pairs (align_torch.py's contract), in `ws` when given."""
    ids = topk_ids_NK.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    ids = ids.contiguous()
    pairs, dev = ids.numel(), ids.device
    nb = max_blocks(pairs, block_m, num_local)
    i32 = dict(dtype=torch.int32, device=dev)
    sorted_pairs = take(ws and ws.sorted_pairs, nb * block_m, "sorted_pairs", **i32)
    block_expert = take(ws and ws.block_expert, nb, "block_expert", **i32)
    block_rows = take(ws and ws.block_rows, nb, "block_rows", **i32)
    out = AlignedBlocks(sorted_pairs, block_expert, block_rows, block_m)
    if pairs == 0:
        return out
    e_pad = _e_pad(num_local)
    pdl = pdl_args(dev)
    scratch = take(ws and ws.align, align_scratch_len(pairs, num_local), "align", **i32)
    if one_program(pairs):
        _align_by_cursors[(1,)](ids, pairs, first_expert, num_local, scratch, sorted_pairs,
                                block_expert, block_rows, nb, BLOCK_M=block_m, E_PAD=e_pad,
                                CHUNK=min(ALIGN_CHUNK, max(16, triton.next_power_of_2(pairs))),
                                PLACE_CHUNK=128, num_warps=4, **pdl)
        return out
    grid = (triton.cdiv(pairs, _COUNT_CHUNK),)
    counts = scratch[:e_pad].zero_()
    chunk_start = scratch[e_pad:].view(grid[0], e_pad)
    _count_kernel[grid](ids, pairs, first_expert, num_local, counts, chunk_start, E_PAD=e_pad,
                        CHUNK=_COUNT_CHUNK, num_warps=4, **pdl)
    _scatter_kernel[grid](ids, pairs, first_expert, num_local, counts, chunk_start,
                          sorted_pairs, block_expert, block_rows, nb, BLOCK_M=block_m,
                          E_PAD=e_pad, CHUNK=_COUNT_CHUNK, PLACE_CHUNK=128, num_warps=4, **pdl)
    return out
