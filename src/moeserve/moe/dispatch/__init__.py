"""MoE dispatchers behind one contract (base.py): local, gather, all_to_all."""

from __future__ import annotations

from typing import Optional

import torch

from moeserve.config.spec import ModelSpec
from moeserve.moe.dispatch import all_to_all, gather, local  # noqa: F401  (they register)
from moeserve.moe.dispatch.base import DISPATCHERS, DispatchedTokens, Dispatcher
from moeserve.parallel.groups import ParallelState
from moeserve.parallel.layout import ParallelLayout
from moeserve.plan.capacity import CapacityPlan

__all__ = ["DISPATCHERS", "DispatchedTokens", "Dispatcher", "create_dispatcher",
           "default_dispatcher"]


def default_dispatcher(layout: ParallelLayout) -> str:
    if layout.tp == 1:
        return "local"
    return "all_to_all" if layout.a2a else "gather"


def create_dispatcher(spec: ModelSpec, state: ParallelState, plan: CapacityPlan,
                      dtype: torch.dtype = torch.float32, name: Optional[str] = None
                      ) -> Dispatcher:
    """The dispatcher for the layout (local on one rank; all_to_all with
    --moe-a2a-backend all_to_all; gather otherwise). One dispatcher can serve every MoE layer
    of a model: layers run one after another, and the all-to-all workspace is per rank."""
    return DISPATCHERS.get(name or default_dispatcher(state.layout))(spec, state, plan, dtype)
