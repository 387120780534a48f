"""The layout changes around the MoE / MLP block of a decoder layer.

The decoder layer runs (x_TH: the DP rank's T tokens, replicated over its attn_tp ranks):

    h = input_norm(x)
    a = attention(h)                        # partial sums over attn_tp (row-parallel o_proj)
    a = comm.reduce_attn_output(a, step)    # -> this rank's rows
    r = comm.local_rows(x, step) + a
    y = mlp_or_moe(post_norm(r), step)      # MoELayer or DenseMLP, on those rows
    x = comm.gather_rows(r + y, step)       # -> [T, H] again

A layer either keeps its rows replicated over attn_tp (all-reduce after attention) or
scatters them (reduce-scatter after attention, all-gather after the block: the same bytes as
the all-reduce, and the block sees 1/attn_tp of the rows). `layer_scatters` decides, per kind
of layer:

  MoE layer    scatters with the all-to-all backend (SP) and under DP attention (each rank
               then brings distinct rows to the gather across the world);
  dense layer  scatters when it is replicated (--moe-dense-tp-size 1) and under DP attention.

With attn_tp == 1 nothing is scattered (each rank has its own rows already). The rule keeps
every rank's rows distinct whenever rows from several DP ranks are exchanged.

`gather_world_rows` / `reduce_world_rows` are the exchange a block sharded over the whole tp
world needs (gather dispatcher, TP-sharded dense MLPs and shared experts): all-gather every
rank's rows, compute partial sums, reduce-scatter back; or, when every rank already holds the
same rows (one DP rank, not scattered), no gather and an all-reduce.

The all-gathers receive into the plan's buffers (attn_tp_gather.hidden, dp_gather.rows),
which the binder hands over (`bind`, or the `buffer` argument); a gathered result may be a
view of them, which the layer reads before the next layer gathers into the same buffer.
On the GPUs of one node each axis's collectives up to --symm-comm-max-bytes run one-shot on
the plan's comm.symm.<axis> window (`bind`, or the `symm` argument: parallel/symm_comm.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from moeserve.batch.buffers import CommWindows, GatherBuffers
from moeserve.parallel import collectives as C
from moeserve.parallel.groups import ParallelState
from moeserve.parallel.symm_comm import SymmetricCollectives
from moeserve.batch.step import StepContext
from moeserve.layers.pending import Unreduced
from moeserve.plan.budget import layer_scatters

__all__ = ["LayerCommunicator", "gather_world_rows", "gathers_world_rows", "layer_scatters",
           "reduce_world_rows", "rows_distinct", "world_buffer", "world_collectives"]


class LayerCommunicator:
    """The comm ops of one decoder layer; build one per layer with moe=(layer is a MoE layer)."""

    def __init__(self, state: ParallelState, *, moe: bool) -> None:
        self.state = state
        self.moe = moe
        self.scattered = layer_scatters(state.layout, moe=moe)
        self.gather_buffer: Optional[torch.Tensor] = None  # None: each gather allocates
        self.symm: Optional[SymmetricCollectives] = None  # None: NCCL (gloo) alone

    def bind(self, buffers: GatherBuffers, comm: CommWindows = CommWindows()) -> None:
        """The plan's attn_tp_gather.hidden, which every gather_rows receives into, and the
        attn_tp window of the one-shot collectives (where the plan has one)."""
        if self.scattered and buffers.attn_tp is None:
            raise ValueError("this layer gathers its rows over attn_tp, but the plan has no "
                             "attn_tp_gather.hidden record for it")
        self.gather_buffer = buffers.attn_tp if self.scattered else None
        self.symm = comm.collectives("attn_tp", self.state.attn_tp)

    def reduce_attn_output(self, a_TH: torch.Tensor, step: StepContext) -> torch.Tensor:
        """Sum the attention partial sums over attn_tp: [T, H] replicated (reduced in place),
        or this rank's scattered rows [M, H]."""
        axis = self.state.attn_tp
        if not self.scattered:
            return C.all_reduce(a_TH, axis, self.symm)
        sizes = step.scatter_sizes(step.dp_rank)
        return C.reduce_scatter_uneven(a_TH, sizes, axis, self.symm)

    def reduce_attn_add_norm(self, a_TH: torch.Tensor, x_TH: torch.Tensor, norm,
                             step: StepContext
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, r) = (norm(r), r) for r = local_rows(x) + reduce_attn_output(a): where the rows
        stay replicated and the axis's one-shot window takes them, the all-reduce, the add
        and the norm in one launch; else the reduction, then norm.add_forward."""
        x_MH = self.local_rows(x_TH, step)
        if (not self.scattered and self.symm is not None and a_TH.dtype == x_MH.dtype
                and x_MH.stride(-1) == 1 and self.symm.takes_rows(a_TH)):
            return self.symm.all_reduce_add_rms_norm(a_TH.contiguous(), x_MH, norm.weight,
                                                     norm.eps)
        return norm.add_forward(x_MH, self.reduce_attn_output(a_TH, step))

    def local_rows(self, x_TH: torch.Tensor, step: StepContext) -> torch.Tensor:
        """This rank's rows of a replicated [T, H] tensor (the residual)."""
        start, end = step.row_range(self.scattered)
        return x_TH[start:end]

    def gather_rows(self, y_MH: torch.Tensor, step: StepContext) -> torch.Tensor:
        """Back to the DP rank's [T, H], replicated over attn_tp."""
        if not self.scattered:
            return y_MH
        return C.all_gather_uneven(y_MH, step.scatter_sizes(step.dp_rank), self.state.attn_tp,
                                   self.gather_buffer, self.symm)


def rows_distinct(state: ParallelState, scattered: bool) -> bool:
    """Whether the ranks hold different rows (True) or all hold the same rows (False)."""
    lay = state.layout
    if scattered or lay.attn_tp == 1:
        return True
    if lay.dp > 1:  # layer_scatters never asks for this: it would reduce rows twice
        raise ValueError(f"rows replicated over attn_tp={lay.attn_tp} cannot be exchanged "
                         f"across dp={lay.dp} DP ranks; the block must scatter them")
    return False


def gathers_world_rows(state: ParallelState, scattered: bool) -> bool:
    """Whether gather_world_rows exchanges rows (else it returns this rank's own)."""
    return state.world.size > 1 and rows_distinct(state, scattered)


def world_buffer(buffers: GatherBuffers, state: ParallelState, scattered: bool,
                 who: str) -> Optional[torch.Tensor]:
    """The plan's dp_gather.rows for a block that gathers world rows (None for one that
    does not); `who` names the block in the error when the plan has no record for it."""
    if not gathers_world_rows(state, scattered):
        return None
    if buffers.world is None:
        raise ValueError(f"{who} gathers the rows of every rank, but the plan has no "
                         "dp_gather.rows record for it")
    return buffers.world


def world_collectives(comm: CommWindows, state: ParallelState
                      ) -> Optional[SymmetricCollectives]:
    """The world's one-shot collectives for a block that exchanges rows over it (the gather
    dispatcher, a dense MLP split over the world); None where the plan has no window."""
    return comm.collectives("world", state.world)


def gather_world_rows(x_MH: torch.Tensor, step: StepContext, state: ParallelState,
                      scattered: bool, buffer: Optional[torch.Tensor] = None,
                      symm: Optional[SymmetricCollectives] = None) -> torch.Tensor:
    """Every rank's rows, in rank order [N, ...]; the rows themselves when all ranks hold the
    same rows. `buffer`: the plan's dp_gather.rows (world_buffer); `symm`: the world's
    one-shot collectives (world_collectives)."""
    if not gathers_world_rows(state, scattered):
        return x_MH
    return C.all_gather_uneven(x_MH, step.rows_per_rank(scattered), state.world, buffer, symm)


def reduce_world_rows(y_NH: torch.Tensor, step: StepContext, state: ParallelState,
                      scattered: bool, symm: Optional[SymmetricCollectives] = None,
                      pending_ok: bool = False):
    """Sum partial sums over the world and keep this rank's rows (inverse of
    gather_world_rows). pending_ok: the caller takes an Unreduced (layers/pending.py)
    where every rank holds the same rows and the world's one-shot window takes them."""
    if state.world.size == 1:
        return y_NH
    if not rows_distinct(state, scattered):
        if pending_ok and symm is not None and symm.takes_rows(y_NH):
            return Unreduced(y_NH.contiguous(), symm)
        return C.all_reduce(y_NH, state.world, symm)
    return C.reduce_scatter_uneven(y_NH, step.rows_per_rank(scattered), state.world, symm)
