"""MoE dispatchers behind one contract (base.py): local, gather, all_to_all (NCCL), nvlink
(one-sided stores into symmetric memory)."""

from __future__ import annotations

from typing import Optional

import torch

from moeserve.config.spec import ModelSpec
from moeserve.moe.dispatch import all_to_all, gather, local, nvlink  # noqa: F401  (register)
from moeserve.moe.dispatch.base import DISPATCHERS, DispatchedTokens, Dispatcher
from moeserve.parallel.groups import ParallelState
from moeserve.parallel.layout import ParallelLayout
from moeserve.plan.capacity import CapacityPlan

__all__ = ["DISPATCHERS", "DispatchedTokens", "Dispatcher", "create_dispatcher",
           "default_dispatcher"]


def default_dispatcher(layout: ParallelLayout, transport: str = "all_to_all") -> str:
    """local on one rank; the plan's transport (all_to_all or nvlink) on the all-to-all path;
    gather otherwise."""
    if layout.tp == 1:
        return "local"
    return transport if layout.a2a else "gather"


def create_dispatcher(spec: ModelSpec, state: ParallelState, plan: CapacityPlan,
                      dtype: torch.dtype = torch.float32, name: Optional[str] = None
                      ) -> Dispatcher:
    """The dispatcher for the layout (default_dispatcher, with the transport the plan
    resolved from --moe-a2a-backend). One dispatcher can serve every MoE layer of a model:
    layers run one after another, and the all-to-all workspace is per rank."""
    transport = plan.backends.a2a if plan.backends is not None else "all_to_all"
    name = name or default_dispatcher(state.layout, transport)
    return DISPATCHERS.get(name)(spec, state, plan, dtype)
