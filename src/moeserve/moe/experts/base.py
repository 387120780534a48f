"""Expert runners: the local experts' weights and the grouped gated MLP over the tokens that
reach them. One abstract base and the registry of runners (moe/experts/__init__.py imports
them all and creates them).

Weights (N rows, H hidden, I_local = I / moe_tp, E_local = E / ep):
    w13 [E_local, 2 I_local, H]   gate rows, then up rows, of this rank's moe_tp shard
    w2  [E_local, H, I_local]
EP rank e holds experts [e E_local, (e+1) E_local) whole along H; moe_tp rank t holds rows
[t I_local, (t+1) I_local) of each one's intermediate dim, so its output is a partial sum that
the dispatcher's combine reduces (once, with the expert-parallel exchange).

With `quant` (config/quant.py) both are float8_e4m3fn beside their block scales, stacked the
same way: w13_scale_inv [E_local, 2 I_local / bn, ceil(H / bk)], w2_scale_inv [E_local,
ceil(H / bn), I_local / bk] (gate and up each fill whole blocks; a moe_tp shard keeps whole
blocks of the down projection's input). Each GEMM is W8A8: its input quantized per row per bk
columns (the gate_up input may arrive quantized from the dispatcher, with `x_scale`).

forward(x_NH, topk_ids_NK, topk_weights_NK, x_scale) -> y_NH: for each row, the sum over the
ids this rank owns of weight x expert(x) (a duplicate id counts twice, as in the HF blocks); ids of
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
from moeserve.config.quant import QuantSpec
from moeserve.kernels.fp8 import reference as fp8
from moeserve.layers.mlp import activation
from moeserve.config.spec import ModelSpec
from moeserve.layers.weights import (QuantParam, check_segments, check_shard_blocks,
                                     empty_param, load_gated_mlp, scale_param)
from moeserve.parallel.groups import ParallelState

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module, ABC):
    deterministic = False  # see the module's docstring

    # False: the runner has no W8A8 path and refuses fp8 weights
    supports_fp8 = False

    def __init__(self, spec: ModelSpec, state: ParallelState, dtype: torch.dtype,
                 quant: Optional[QuantSpec] = None) -> None:
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
        self.dtype, self.quant = dtype, quant
        self.block = None if quant is None else quant.block
        w_dtype = dtype
        if quant is not None:
            if not self.supports_fp8:
                raise ValueError(f"the {type(self).__name__} expert runner has no fp8 path; "
                                 "use --moe-runner-backend reference for fp8 weights")
            check_segments("expert gate/up", (self.i_local, self.i_local), quant.block_n)
            check_shard_blocks("expert down input", spec.moe_intermediate_size, self.i_local,
                               lay.moe_tp, quant.block_k)
            w_dtype = fp8.FP8
        self.w13 = empty_param(self.num_local, 2 * self.i_local, self.hidden, dtype=w_dtype)
        self.w2 = empty_param(self.num_local, self.hidden, self.i_local, dtype=w_dtype)
        self.w13_scale_inv: Optional[torch.nn.Parameter] = None
        self.w2_scale_inv: Optional[torch.nn.Parameter] = None
        if quant is not None:
            self.w13_scale_inv = scale_param(*self.w13.shape, block=quant.block)
            self.w2_scale_inv = scale_param(*self.w2.shape, block=quant.block)

    def input_rows(self, x_NH: torch.Tensor, x_scale: Optional[torch.Tensor]
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(rows, their scales) as the gate_up GEMM takes them: fp8 with per-group scales for
        fp8 weights (quantized here unless the dispatcher did), else in the model's dtype."""
        if self.quant is None:
            assert x_scale is None, "unquantized experts take rows in the model's dtype"
            return x_NH, None
        if x_scale is None:
            return fp8.quantize_groups(x_NH, self.quant.block_k)
        return x_NH, x_scale
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
                topk_weights_NK: torch.Tensor, x_scale: Optional[torch.Tensor] = None,
                pending_ok: bool = False):
        """sum_k w_k expert_k(x) [N, H] over this rank's pairs; pending_ok: the caller also
        takes a TopkRows (layers/pending.py), the pairs' rows whose sum the norm after the
        block does, which a runner with a top-k pass of its own may return."""

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
        w13, w2 = self.w13, self.w2
        if self.quant is not None:
            w13 = QuantParam(self.w13, self.w13_scale_inv, self.quant.block)
            w2 = QuantParam(self.w2, self.w2_scale_inv, self.quant.block)
        if not load_gated_mlp(proj, name, src, w13[e], w2[e],
                              intermediate=self.intermediate, rank=self.moe_tp_rank):
            raise ValueError(f"unknown expert projection {proj!r}; experts read {PROJECTIONS}")


EXPERT_RUNNERS: Registry[type[Experts]] = Registry("expert runner")
