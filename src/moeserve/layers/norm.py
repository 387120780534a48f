"""RMSNorm, as transformers computes it (variance in fp32, weight applied in the input dtype).

  RMSNorm         over the last dim: hidden states, and Qwen3-MoE's per-head q/k norm
                  (applied to [T, heads, head_dim], which needs nothing from other ranks);
                  `add_forward` also adds the residual first (one launch on a GPU)
  ShardedRMSNorm  over a projection split across the ranks of an axis: OLMoE's q/k norm over
                  the whole q (or k) projection. Each rank holds its slice of the weight; the
                  variance needs the sum of squares over the full width, so the ranks all-reduce
                  it. KV heads replicated on several ranks are counted once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeserve.kernels import ops as K
from moeserve.layers.weights import copy_into, empty_param, expect_shape, read
from moeserve.parallel import collectives as C
from moeserve.parallel.groups import Axis


def _rms(x: torch.Tensor, variance: torch.Tensor, eps: float, weight: torch.Tensor,
         dtype: torch.dtype) -> torch.Tensor:
    return weight * (x * torch.rsqrt(variance + eps)).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = empty_param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = K.elementwise(x.device)
        out = (ops.rms_norm(x, self.weight, self.eps)
               if ops is not None and x.dim() in (2, 3) and x.stride(-1) == 1 else None)
        if out is not None:  # one launch on a GPU (kernels/elementwise/fused.py)
            return out
        x32 = x.float()
        return _rms(x32, x32.pow(2).mean(-1, keepdim=True), self.eps, self.weight, x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual) for [R, D] rows; the sum is rounded to its dtype
        before the norm reads it, on every path."""
        ops = K.elementwise(x.device)
        out = (ops.add_rms_norm(x, residual, self.weight, self.eps)
               if ops is not None and x.dim() == 2 and x.shape == residual.shape
               and x.stride(-1) == 1 and residual.stride(-1) == 1 else None)
        if out is not None:  # one launch on a GPU (kernels/elementwise/fused.py)
            return out
        total = x + residual
        return self(total), total

    def load_weight(self, param_name: str, src: Any) -> None:
        expect_shape(param_name, src, (self.dim,))
        copy_into(self.weight, read(src), param_name)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over `full_dim` features of which this rank holds `local_dim`, starting at
    feature `start`; `replicas` ranks hold each feature (replicated KV heads)."""

    def __init__(self, full_dim: int, local_dim: int, start: int, replicas: int, eps: float,
                 axis: Axis, dtype: torch.dtype):
        super().__init__()
        self.full_dim, self.local_dim, self.start = full_dim, local_dim, start
        self.replicas, self.eps, self.axis = replicas, eps, axis
        self.weight = empty_param(local_dim, dtype=dtype)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        x32 = x_TD.float()
        sum_sq = x32.pow(2).sum(-1, keepdim=True)
        if self.axis.size > 1:
            sum_sq = C.all_reduce(sum_sq, self.axis) / self.replicas
        return _rms(x32, sum_sq / self.full_dim, self.eps, self.weight, x_TD.dtype)

    def load_weight(self, param_name: str, src: Any) -> None:
        expect_shape(param_name, src, (self.full_dim,))
        copy_into(self.weight, read(src, rows=(self.start, self.start + self.local_dim)),
                  param_name)
