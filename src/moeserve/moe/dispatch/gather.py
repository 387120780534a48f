"""The gather dispatcher: every rank sees every rank's tokens, computes the part of the output
its experts (or expert shards) own, and a reduce-scatter sums the parts back to the owners.

Experts are sharded over the whole tp world (EP ranks x moe_tp ranks), so the exchange runs on
the world axis. Ranks hold distinct rows under DP attention (scattered across attn_tp when
attn_tp > 1): the dispatch all-gathers them with the step's uneven per-rank sizes (zero-token
ranks included) and combine reduce-scatters. With one DP rank every rank already holds the same
rows: no gather, and combine is an all-reduce (left, where the caller allows and the window
takes it, to the norm after the block: layers/pending.Unreduced). Partial sums of the
moe_tp shards ride the same reduction. The all-gather receives the packed rows (hidden, ids,
weights) into the plan's dp_gather.rows; this layer has read them before the next block
gathers into it. On the GPUs of one node both run one-shot on the world's window up to
--symm-comm-max-bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moeserve.moe.dispatch.base import (DISPATCHERS, DispatchedTokens, Dispatcher, pack_tokens,
                                        unpack_tokens)
from moeserve.layers.communicator import (gather_world_rows, gathers_world_rows,
                                          layer_scatters, reduce_world_rows, world_buffer,
                                          world_collectives)
from moeserve.batch.buffers import ModelBuffers
from moeserve.batch.step import StepContext
from moeserve.parallel.symm_comm import SymmetricCollectives


@dataclass(frozen=True, kw_only=True)
class GatherHandle:
    step: StepContext
    num_tokens: int  # M: this rank's rows


@DISPATCHERS.register("gather")
class GatherDispatcher(Dispatcher):
    reduces_partial_sums = True
    graph_safe = True  # shapes come from the step only

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scattered = layer_scatters(self.state.layout, moe=True)
        self.exchanges_rows = gathers_world_rows(self.state, self.scattered)
        self.gather_buffer: Optional[torch.Tensor] = None  # None: each gather allocates
        self.symm: Optional[SymmetricCollectives] = None  # None: NCCL (gloo) alone

    def bind(self, buffers: ModelBuffers) -> None:
        self.gather_buffer = world_buffer(buffers.gather, self.state, self.scattered,
                                          "the gather dispatcher")
        self.symm = world_collectives(buffers.comm, self.state)

    def dispatch(self, x_MH: torch.Tensor, topk_ids_MK: torch.Tensor,
                 topk_weights_MK: torch.Tensor, step: StepContext
                 ) -> tuple[DispatchedTokens, GatherHandle]:
        handle = GatherHandle(step=step, num_tokens=x_MH.shape[0])
        if not self.exchanges_rows:
            return DispatchedTokens(x_NH=x_MH, topk_ids_NK=topk_ids_MK,
                                    topk_weights_NK=topk_weights_MK), handle
        rows = gather_world_rows(pack_tokens(x_MH, topk_ids_MK, topk_weights_MK), step,
                                 self.state, self.scattered, self.gather_buffer, self.symm)
        return unpack_tokens(rows, x_MH.shape[1], topk_ids_MK.shape[1], x_MH.dtype), handle

    def combine(self, y_NH: torch.Tensor, handle: GatherHandle, pending_ok: bool = False):
        y_MH = reduce_world_rows(y_NH, handle.step, self.state, self.scattered, self.symm,
                                 pending_ok)
        assert getattr(y_MH, "partial", y_MH).shape[0] == handle.num_tokens
        return y_MH
