"""Expert runners: the local experts' weights and the grouped gated MLP over the tokens that
reach them. One abstract base and the registry of runners (moe/experts/__init__.py imports
them all and creates them).

Weights (N rows, H hidden, I_local = I / moe_tp, E_local = E / ep):
    w13 [E_local, 2 I_local, H]   gate rows, then up rows, of this rank's moe_tp shard
    w2  [E_local, H, I_local]
EP rank e holds experts [e E_local, (e+1) E_local) whole along H; moe_tp rank t holds rows
[t I_local, (t+1) I_local) of each one's intermediate dim, so its output is a partial sum that
the dispatcher's combine reduces (once, with the expert-parallel exchange).

forward(x_NH, topk_ids_NK, topk_weights_NK) -> y_NH: for each row, the sum over the ids this
rank owns of weight x expert(x) (a duplicate id counts twice, as in the HF blocks); ids of
other ranks and -1 contribute nothing. With `deterministic` set (MoELayer sets it from
--enable-deterministic-inference) each row's sum is added in a fixed order, never by atomic
adds, so the same input gives the same bits on every run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
from torch import nn

from moeserve.config.registry import Registry

from moeserve.kernels.moe.align_torch import Workspace
from moeserve.layers.mlp import activation
from moeserve.config.spec import ModelSpec
from moeserve.layers.weights import empty_param, load_gated_mlp
from moeserve.parallel.groups import ParallelState

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module, ABC):
    deterministic = False  # see the module's docstring

    def __init__(self, spec: ModelSpec, state: ParallelState, dtype: torch.dtype) -> None:
        super().__init__()
        lay = state.layout
        if spec.num_experts % lay.ep or spec.moe_intermediate_size % lay.moe_tp:
            raise ValueError(f"{spec.num_experts} experts of width {spec.moe_intermediate_size} "
                             f"do not split over --ep-size {lay.ep} and moe_tp {lay.moe_tp}")
        self.hidden = spec.hidden_size
        self.intermediate = spec.moe_intermediate_size
        self.num_experts = spec.num_experts
        self.num_local = spec.num_experts // lay.ep
        self.first_expert = state.ep_rank * self.num_local
        self.moe_tp_rank, self.moe_tp_size = state.moe_tp.rank, lay.moe_tp
        self.i_local = spec.moe_intermediate_size // lay.moe_tp
        self.act = activation(spec.hidden_act)
        self.w13 = empty_param(self.num_local, 2 * self.i_local, self.hidden, dtype=dtype)
        self.w2 = empty_param(self.num_local, self.hidden, self.i_local, dtype=dtype)

    def owns(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.num_local

    def local_pairs(self, topk_ids_NK: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, k, local expert) of every top-k entry this rank owns."""
        local_NK = topk_ids_NK.long() - self.first_expert
        own = (topk_ids_NK >= 0) & (local_NK >= 0) & (local_NK < self.num_local)
        row, k = own.nonzero(as_tuple=True)
        return row, k, local_NK[row, k]

    @abstractmethod
    def forward(self, x_NH: torch.Tensor, topk_ids_NK: torch.Tensor,
                topk_weights_NK: torch.Tensor) -> torch.Tensor:
        ...

    def bind_workspace(self, workspace: Optional[Workspace]) -> None:
        """The plan's moe.runner.* buffers, which the plan records only for the runner that
        takes them (triton): every other runner refuses them."""
        if workspace is not None:
            raise ValueError(f"the plan recorded moe.runner.* for the triton expert runner, "
                             f"but this rank runs {type(self).__name__}")

    def warm_up(self, max_rows: int, device: torch.device) -> list[int]:
        """Run what must be compiled before serving for steps of up to max_rows rows; returns
        the row counts run (none: this runner compiles nothing)."""
        return []

    def load_expert(self, expert: int, proj: str, src: Any) -> None:
        """Read this rank's shard of experts.{expert}.{proj}.weight (a full HF tensor or a
        safetensors slice)."""
        if not self.owns(expert):
            raise ValueError(f"expert {expert} is not on this rank (it holds experts "
                             f"{self.first_expert}..{self.first_expert + self.num_local - 1})")
        name = f"experts.{expert}.{proj}.weight"
        e = expert - self.first_expert
        if not load_gated_mlp(proj, name, src, self.w13[e], self.w2[e],
                              intermediate=self.intermediate, rank=self.moe_tp_rank):
            raise ValueError(f"unknown expert projection {proj!r}; experts read {PROJECTIONS}")


EXPERT_RUNNERS: Registry[type[Experts]] = Registry("expert runner")
