"""The MoE layer: router -> dispatch -> experts -> combine, plus shared experts.

    y_MH = MoELayer(spec, state, plan, dtype, layer_id)(x_MH, step)

x_MH are this rank's MoE rows (after the layer communicator's scatter, see
layers/communicator.py); the output has the same rows.

Parameters: gate.weight [E, H] (replicated), gate.e_score_correction_bias [E] (sigmoid scoring),
experts.w13 / experts.w2 (experts/base.py), and with shared experts shared_expert.gate_up.weight,
shared_expert.down.weight (a DenseMLP) and Qwen2-MoE's shared_expert_gate.weight [1, H].

Shared experts: split over the tp world (layout.shared_expert_tp == tp: the gather path with
dense MLPs split, --moe-dense-tp-size unset) they run on the dispatched rows (every rank's rows)
and their partial sums ride the combine's reduction; otherwise (all-to-all backend, or
--moe-dense-tp-size 1) they are replicated and run on this rank's rows after the combine.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels import ops as K
from moeserve.config.quant import QuantSpec
from moeserve.kernels.fp8 import reference as fp8
from moeserve.layers.mlp import DenseMLP, _Proj
from moeserve.config.spec import ModelSpec
from moeserve.moe.dispatch import Dispatcher, create_dispatcher
from moeserve.moe.experts import create_experts
from moeserve.moe.experts.base import PROJECTIONS
from moeserve.moe.router import Router
from moeserve.layers.weights import WeightError, copy_into, expect_shape, read
from moeserve.layers.communicator import layer_scatters
from moeserve.batch.buffers import ModelBuffers
from moeserve.parallel.groups import ParallelState
from moeserve.batch.step import StepContext
from moeserve.plan.capacity import CapacityPlan

_EXPERT_NAME = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class MoELayer(nn.Module):
    def __init__(self, spec: ModelSpec, state: ParallelState, plan: CapacityPlan,
                 dtype: torch.dtype = torch.float32, layer_id: int = 0, *,
                 experts: str = "reference", dispatcher: Optional[Dispatcher] = None,
                 shared_prefix: Optional[str] = None, quant: Optional[QuantSpec] = None,
                 shared_quant: Optional[QuantSpec] = None) -> None:
        """`dispatcher`: pass one dispatcher to every MoE layer of a model so that they share
        the all-to-all workspace (the plan counts it once per rank); default: a new one.
        `quant` / `shared_quant`: fp8 weights of the routed / shared experts."""
        super().__init__()
        lay = state.layout
        self.spec, self.state, self.layer_id = spec, state, layer_id
        self.scattered = layer_scatters(lay, moe=True)
        self.gate = Router(spec, dtype)
        self.experts = create_experts(experts, spec, state, dtype, quant)
        self.experts.deterministic = plan.config.enable_deterministic_inference
        self.dispatcher = dispatcher or create_dispatcher(spec, state, plan, dtype)
        self.shared_prefix = shared_prefix or spec.shared_expert_prefix
        self.shared_expert: Optional[DenseMLP] = None
        self.shared_expert_gate: Optional[_Proj] = None
        self.shared_on_dispatched = False
        if spec.num_shared_experts:
            tp = lay.shared_expert_tp
            self.shared_on_dispatched = tp > 1
            if tp > 1 and not self.dispatcher.reduces_partial_sums:
                raise ValueError(f"shared experts split over {tp} ranks need a dispatcher that "
                                 f"reduces partial sums; {self.dispatcher.name} does not")
            self.shared_expert = DenseMLP(spec, state, dtype, tp_size=tp,
                                          intermediate_size=spec.shared_expert_intermediate_size,
                                          quant=shared_quant)
            if spec.shared_expert_gate:
                self.shared_expert_gate = _Proj(1, spec.hidden_size, dtype)

    def bind_buffers(self, buffers: ModelBuffers) -> None:
        """The plan's buffers of the router, the dispatcher and the experts (the binder's;
        shared with every other MoE layer). The shared experts exchange nothing themselves."""
        self.gate.bind(buffers.router)
        self.dispatcher.bind(buffers)
        self.experts.bind_workspace(buffers.experts)

    def forward(self, x_MH: torch.Tensor, step: StepContext, pending_ok: bool = False):
        """The layer's output rows; pending_ok: the caller also takes a Pending sum
        (layers/pending.py) that the norm after the block does: the experts' top-k sum where
        the combine hands their output back as it is, or the combine's all-reduce, where no
        shared expert is added after them."""
        if x_MH.shape[0] != step.num_rows(self.scattered):
            raise ValueError(f"MoE layer {self.layer_id} got {x_MH.shape[0]} rows, the step gives "
                             f"this rank {step.num_rows(self.scattered)}")
        quant = self._input_quant(x_MH.shape[0])
        topk_ids_MK, topk_weights_MK, quantized = self.gate.route(
            x_MH, step.valid_rows(self.scattered), quant)
        tokens, handle = self.dispatcher.dispatch(x_MH, topk_ids_MK, topk_weights_MK, step)
        x_NH, x_scale = tokens.x_NH, tokens.x_scale_NG
        if quantized and x_NH is x_MH:  # the router's launch quantized these very rows
            _, x_NH, x_scale = quant
        if x_scale is not None and self.experts.quant is None:  # kept unquantized
            x_NH = fp8.dequantize_groups(x_NH, x_scale, self.dispatcher.scale_group, x_MH.dtype)
            x_scale = None
        # the experts may leave their top-k sum to the norm after the block (through a
        # combine that passes their output back) or to a combine that does it itself
        topk_rows_ok = self.shared_expert is None and (
            (pending_ok and self.dispatcher.combine_passes) or self.dispatcher.sums_topk_rows)
        y_NH = self.experts(x_NH, tokens.topk_ids_NK, tokens.topk_weights_NK, x_scale,
                            pending_ok=topk_rows_ok)
        if self.shared_on_dispatched:
            y_NH = self._add_shared(y_NH, tokens.x_NH)
        late_shared = self.shared_expert is not None and not self.shared_on_dispatched
        y_MH = self.dispatcher.combine(y_NH, handle, pending_ok and not late_shared)
        if late_shared:
            y_MH = self._add_shared(y_MH, x_MH)
        return y_MH

    def _input_quant(self, rows: int) -> Optional[tuple[int, torch.Tensor, torch.Tensor]]:
        """(G, fp8 rows, their scales): the first `rows` rows of the plan's buffers of the fp8
        experts' quantized input (moe.runner.input / input_scale), which the router's top-k
        launch fills where the dispatcher hands the experts the layer's own rows; None
        elsewhere."""
        ws = getattr(self.experts, "workspace", None)
        if self.experts.quant is None or ws is None or ws.input is None \
                or not self.dispatcher.passes_rows:
            return None
        return self.experts.quant.block_k, ws.input[:rows], ws.input_scale[:rows]

    def _add_shared(self, y_NH: torch.Tensor, x_NH: torch.Tensor) -> torch.Tensor:
        """y + the shared experts' output (partial sums when split) on rows x."""
        assert self.shared_expert is not None
        if self.shared_expert_gate is None:  # the sum in the down projection's launch
            return self.shared_expert.partial(x_NH, add_to=y_NH)
        shared_NH = self.shared_expert.partial(x_NH)
        # Qwen2-MoE: y + sigmoid(x . gate) * shared, one launch on a GPU
        ops = K.elementwise(x_NH.device)
        out = ops and ops.shared_gate_add(y_NH, x_NH, self.shared_expert_gate.weight[0], shared_NH)
        if out is not None:
            return out
        return y_NH + torch.sigmoid(F.linear(x_NH, self.shared_expert_gate.weight)) * shared_NH

    # --- weights (names relative to the MLP module, e.g. "mlp.") --------------------------
    def checkpoint_names(self) -> list[str]:
        """Every checkpoint tensor of this layer, on any rank."""
        names = [f"gate.{n}" for n in self.gate.checkpoint_names()]
        names += [f"experts.{e}.{p}.weight" for e in range(self.spec.num_experts)
                  for p in PROJECTIONS]
        if self.shared_expert is not None:
            names += [f"{self.shared_prefix}.{n}" for n in self.shared_expert.checkpoint_names()]
        if self.shared_expert_gate is not None:
            names.append("shared_expert_gate.weight")
        return names

    def needs(self, name: str) -> bool:
        """Whether this rank reads `name` (False for experts of other EP ranks)."""
        match = _EXPERT_NAME.fullmatch(name)
        if match:
            return int(match.group(1)) < self.spec.num_experts and \
                self.experts.owns(int(match.group(1)))
        return name in self.checkpoint_names()

    def load_weight(self, name: str, src: Any) -> None:
        """Read this rank's part of checkpoint tensor `name` from a tensor or safetensors
        slice."""
        match = _EXPERT_NAME.fullmatch(name)
        if match and int(match.group(1)) < self.spec.num_experts:
            self.experts.load_expert(int(match.group(1)), match.group(2), src)
        elif name.startswith("gate.") and name in self.checkpoint_names():
            self.gate.load_weight(name.removeprefix("gate."), src)
        elif self.shared_expert is not None and name.startswith(self.shared_prefix + "."):
            self.shared_expert.load_weight(name.removeprefix(self.shared_prefix + "."), src)
        elif name == "shared_expert_gate.weight" and self.shared_expert_gate is not None:
            expect_shape(name, src, (1, self.spec.hidden_size))
            copy_into(self.shared_expert_gate.weight, read(src), name)
        else:
            raise WeightError(f"MoE layer {self.layer_id} has no checkpoint tensor {name!r}; "
                              "see checkpoint_names()")
