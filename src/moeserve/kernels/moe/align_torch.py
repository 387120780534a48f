"""moe_align in plain torch: group this rank's (token, k) pairs by local expert, pad each expert's
segment to a multiple of BLOCK_M. Runs on CPU or GPU without a host synchronisation; align.py
computes the same thing in Triton with fewer launches, and the tests compare the two.

Legend: N rows, K top-k, P = N K pairs (pair p = n K + k), E local experts, B blocks.

    sorted_pairs [B BLOCK_M] int32  pair ids, block b's rows at [b BLOCK_M, b BLOCK_M + rows_b);
                                    the rest of each block is padding and is never read
    block_expert [B] int32          local expert of block b, -1 for a block nobody uses
    block_rows   [B] int32          valid rows of block b (0 for unused blocks)

B = max_blocks(P, BLOCK_M, E) is a static bound (it depends on shapes only), so a kernel grid
can be sized without looking at the routing: an expert with c pairs takes ceil(c / BLOCK_M)
blocks, and every used block holds at least one pair.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from moeserve.kernels.moe.configs import max_blocks


class Workspace(NamedTuple):
    """The fused runner's intermediates: the plan's `moe.runner.<field>` records, allocated
    once by the binder (runtime/buffers.py) and shared by every MoE layer (they run one after
    another on one stream). The fields with a default are only an fp8 runner's."""

    sorted_pairs: torch.Tensor  # [R] int32
    block_expert: torch.Tensor  # [B] int32
    block_rows: torch.Tensor  # [B] int32
    act: torch.Tensor  # [R, I]
    down: torch.Tensor  # [P, H]
    align: torch.Tensor  # [S] int32, align.py's scratch
    # fp8 weights (fused_moe_fp8.py): act is fp8 and these hold its per-group scales and the
    # rows quantized before gate_up (absent where the dispatcher delivers them quantized)
    act_scale: Optional[torch.Tensor] = None  # [R, ceil(I/G)] float32 (grouped: group-major)
    input: Optional[torch.Tensor] = None  # [T, H] fp8
    input_scale: Optional[torch.Tensor] = None  # [T, ceil(H/G)] float32
    act_f32: Optional[torch.Tensor] = None  # [P, I] float32, the decode gate_up's product


# the records of every triton runner (the others are an fp8 runner's)
BASE_FIELDS = tuple(f for f in Workspace._fields if f not in Workspace._field_defaults)


def take_group_major(buf: Optional[torch.Tensor], rows: int, name: str, groups: int,
                     device: torch.device) -> torch.Tensor:
    """take()'s rows of a [R, groups] float32 record, laid out group-major: a contiguous
    [groups, rows] view of its front (the grouped path's h scales, which the warp-specialised
    fp8 down loads a group of a block's rows at a time by TMA); .t() is the [rows, groups]
    view the other kernels index with its strides."""
    if buf is None:
        return torch.empty(groups, rows, dtype=torch.float32, device=device)
    take(buf, rows, name, groups, dtype=torch.float32, device=device)  # the size check
    return buf.view(-1)[:groups * rows].view(groups, rows)


def take(buf: Optional[torch.Tensor], rows: int, name: str, *shape: int, dtype: torch.dtype,
         device: torch.device) -> torch.Tensor:
    """The first `rows` rows of a workspace buffer (a new tensor without one). A step larger
    than the plan's record is refused: the scheduler's budget never makes one."""
    if buf is None:
        return torch.empty(rows, *shape, dtype=dtype, device=device)
    if rows > buf.shape[0] or tuple(buf.shape[1:]) != shape or buf.dtype != dtype:
        raise RuntimeError(
            f"this MoE step needs {rows} x {list(shape)} {dtype} of the plan's moe.runner.{name}"
            f", which is {list(buf.shape)} {buf.dtype}: the step exceeds the token budget the "
            "plan was made for (`moeserve plan` shows it)")
    return buf[:rows]


class AlignedBlocks(NamedTuple):
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_rows: torch.Tensor
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]




def local_keys(topk_ids: torch.Tensor, first_expert: int, num_local: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(local expert of every pair, or num_local for pairs not on this rank; ownership mask),
    both flat [P]."""
    ids = topk_ids.reshape(-1).long()
    local = ids - first_expert
    own = (ids >= 0) & (local >= 0) & (local < num_local)
    return torch.where(own, local, torch.full_like(local, num_local)), own


def align_torch(topk_ids_NK: torch.Tensor, first_expert: int, num_local: int,
                block_m: int) -> AlignedBlocks:
    dev = topk_ids_NK.device
    pairs = topk_ids_NK.numel()
    nb = max_blocks(pairs, block_m, num_local)
    key, _ = local_keys(topk_ids_NK, first_expert, num_local)
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    nblk = (counts[:num_local] + block_m - 1) // block_m
    blk_end = torch.cumsum(nblk, 0)
    blk_start = blk_end - nblk

    b = torch.arange(nb, device=dev)
    e_b = torch.searchsorted(blk_end, b, right=True)
    used = e_b < num_local
    e_safe = e_b.clamp(max=max(num_local - 1, 0))
    rows = (counts[e_safe] - (b - blk_start[e_safe]) * block_m).clamp(max=block_m)
    block_expert = torch.where(used, e_b, torch.full_like(e_b, -1)).to(torch.int32)
    block_rows = torch.where(used, rows, torch.zeros_like(rows)).to(torch.int32)

    order = torch.argsort(key, stable=True)
    key_sorted = key[order]
    first_of_key = torch.cumsum(counts, 0) - counts  # unpadded start of each key in `order`
    rank = torch.arange(pairs, device=dev) - first_of_key[key_sorted]
    start = torch.cat([blk_start, blk_start.new_zeros(1)]) * block_m
    dump = nb * block_m  # pairs of other ranks land in one extra slot, cut off below
    dest = torch.where(key_sorted < num_local, start[key_sorted] + rank,
                       torch.full_like(rank, dump))
    sorted_pairs = torch.zeros(nb * block_m + 1, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    return AlignedBlocks(sorted_pairs[:-1], block_expert, block_rows, block_m)
