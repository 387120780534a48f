"""The layers' one way to the fused kernels of a family: the module of its kernel wrappers
when the device's kernel set (kernels/launch/choice.py) runs Triton, else None, and then the
layer runs its torch formulation of the same function.

    elementwise  RMSNorm, add + RMSNorm, rope (+ KV store), KV store, act-and-mul, gated add,
                 a decode graph's input unpack              (kernels/elementwise/fused.py)
    router       softmax top-k; logits GEMM + top-k         (kernels/moe/router.py)
    skinny       1-16 row projections, routers to 128       (kernels/skinny/gemm.py)
    mla          latent attention's norm + rope + cache store (kernels/mla/kernels.py)
    fp8          W8A8 block-scaled projections, activation quantizer (kernels/fp8/gemm.py)
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from moeserve.kernels.launch.choice import kernels_for


def elementwise(device: torch.device) -> Optional[ModuleType]:
    if not kernels_for(device).triton:
        return None
    from moeserve.kernels.elementwise import fused
    return fused


def router(device: torch.device) -> Optional[ModuleType]:
    if not kernels_for(device).triton:
        return None
    from moeserve.kernels.moe import router as kernels
    return kernels


def skinny(device: torch.device) -> Optional[ModuleType]:
    if not kernels_for(device).triton:
        return None
    from moeserve.kernels.skinny import gemm
    return gemm


def mla(device: torch.device) -> Optional[ModuleType]:
    if not kernels_for(device).triton:
        return None
    from moeserve.kernels.mla import kernels
    return kernels


def fp8(device: torch.device) -> Optional[ModuleType]:
    if not kernels_for(device).triton:
        return None
    from moeserve.kernels.fp8 import gemm
    return gemm
