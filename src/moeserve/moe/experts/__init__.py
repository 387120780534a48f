"""Expert runners behind one base class (base.py): reference (torch), grouped_mm
(torch._grouped_mm), triton (fused kernels; triton imported on first use)."""

from __future__ import annotations

from typing import Optional

import torch

from moeserve.config.quant import QuantSpec
from moeserve.config.spec import ModelSpec
from moeserve.moe.experts import grouped_mm, reference, triton_fused  # noqa: F401  (they register)
from moeserve.moe.experts.base import EXPERT_RUNNERS, Experts
from moeserve.parallel.groups import ParallelState

__all__ = ["EXPERT_RUNNERS", "Experts", "create_experts"]


def create_experts(name: str, spec: ModelSpec, state: ParallelState,
                   dtype: torch.dtype = torch.float32, quant: Optional[QuantSpec] = None
                   ) -> Experts:
    return EXPERT_RUNNERS.get(name)(spec, state, dtype, quant)
