"""Process groups, built once from the layout into one object that layers receive.

Layers never call dist.get_rank() or use the default group: they read this object.
A single-process engine gets a ParallelState whose groups are all of size 1 (group None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from moeserve.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class Axis:
    """One axis of the mesh as this rank sees it: its group, its rank in it, and the size."""

    group: Optional[dist.ProcessGroup]
    rank: int
    size: int
    ranks: tuple[int, ...]  # global ranks of the group, in group order


@dataclass(frozen=True)
class ParallelState:
    layout: ParallelLayout
    rank: int  # rank within the engine's tp world
    device: torch.device
    world: Axis  # all tp ranks
    attn_tp: Axis
    attn_dp: Axis  # same attn_tp rank across DP groups
    ep: Axis  # same moe_tp rank across EP ranks
    moe_tp: Axis
    cpu: Optional[dist.ProcessGroup]  # gloo group over the world, for metadata

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rank)

    @property
    def ep_rank(self) -> int:
        return self.layout.ep_rank(self.rank)


def _axis(rank_lists: list[list[int]], rank: int, backend: Optional[str]) -> Axis:
    """Create every group of one axis (all ranks must call this in the same order) and keep
    the one holding `rank`."""
    mine: Optional[Axis] = None
    for ranks in rank_lists:
        group = dist.new_group(ranks, backend=backend) if backend else None
        if rank in ranks:
            mine = Axis(group if len(ranks) > 1 else None, ranks.index(rank), len(ranks),
                        tuple(ranks))
    assert mine is not None, f"rank {rank} is in no group of {rank_lists}"
    return mine


def single_process_state(layout: Optional[ParallelLayout] = None,
                         device: str | torch.device = "cpu") -> ParallelState:
    layout = layout or ParallelLayout(tp=1, dp=1, ep=1, dense_tp=1, a2a=False)
    if layout.tp != 1:
        raise ValueError(f"a single process cannot run tp={layout.tp}; start {layout.tp} ranks")
    one = Axis(None, 0, 1, (0,))
    return ParallelState(layout, 0, torch.device(device), one, one, one, one, one, None)


def init_parallel_state(layout: ParallelLayout, device: str | torch.device = "cpu"
                        ) -> ParallelState:
    """Build every group of `layout` on the already-initialised default process group.

    The default group's world must be exactly the engine's tp ranks. Every rank calls this,
    in the same order, once at startup.
    """
    if not dist.is_initialized():
        if layout.tp == 1:
            return single_process_state(layout, device)
        raise RuntimeError("torch.distributed is not initialised; call "
                           "dist.init_process_group first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size != layout.tp:
        raise ValueError(f"the process group has {world_size} ranks but the layout needs "
                         f"tp={layout.tp}")
    backend = dist.get_backend()
    all_ranks = [list(range(layout.tp))]
    world = _axis(all_ranks, rank, backend)
    attn_tp = _axis(layout.attn_tp_groups(), rank, backend)
    attn_dp = _axis(layout.attn_dp_groups(), rank, backend)
    ep = _axis(layout.ep_groups(), rank, backend)
    moe_tp = _axis(layout.moe_tp_groups(), rank, backend)
    cpu = dist.new_group(all_ranks[0], backend="gloo") if backend != "gloo" else world.group
    return ParallelState(layout, rank, torch.device(device), world, attn_tp, attn_dp, ep,
                         moe_tp, cpu)
