"""The single-rank dispatcher: every expert is here, so tokens stay where they are."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.layers.pending import TopkRows
from moeserve.moe.dispatch.base import DISPATCHERS, DispatchedTokens, Dispatcher
from moeserve.batch.step import StepContext
from moeserve.config.spec import ModelSpec
from moeserve.parallel.groups import ParallelState
from moeserve.plan.capacity import CapacityPlan


@dataclass(frozen=True, kw_only=True)
class LocalHandle:
    num_tokens: int


@DISPATCHERS.register("local")
class LocalDispatcher(Dispatcher):
    reduces_partial_sums = True
    graph_safe = True  # shapes come from the step only
    passes_rows = True
    combine_passes = True

    def __init__(self, spec: ModelSpec, state: ParallelState, plan: CapacityPlan,
                 dtype: torch.dtype) -> None:
        if state.world.size != 1:
            raise ValueError(f"the local dispatcher serves one rank, the layout has "
                             f"{state.world.size}; use gather or all_to_all")
        super().__init__(spec, state, plan, dtype)

    def dispatch(self, x_MH: torch.Tensor, topk_ids_MK: torch.Tensor,
                 topk_weights_MK: torch.Tensor, step: StepContext
                 ) -> tuple[DispatchedTokens, LocalHandle]:
        tokens = DispatchedTokens(x_NH=x_MH, topk_ids_NK=topk_ids_MK,
                                  topk_weights_NK=topk_weights_MK)
        return tokens, LocalHandle(num_tokens=x_MH.shape[0])

    def combine(self, y_NH, handle: LocalHandle, pending_ok: bool = False):
        assert isinstance(y_NH, TopkRows) or y_NH.shape[0] == handle.num_tokens
        return y_NH
