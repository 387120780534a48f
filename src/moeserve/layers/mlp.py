"""The dense gated MLP block: dense (non-MoE) layers and the shared experts of MoE layers.

    y = down(act(gate(x)) * up(x))        weights: gate_up [2 I/tp, H] (gate rows, then up),
                                                    down [H, I/tp]

Sharding (`tp_size`): 1 (replicated, every rank holds the whole MLP) or the tp world size
(the intermediate dim split across all tp ranks, each rank returning partial sums).
A dense layer uses --moe-dense-tp-size (dense_tp): replicated, it runs on this rank's rows
with no communication (rows are scattered across attn_tp by the layer communicator when
attn_tp > 1); sharded over the world, it gathers the rows of every rank, computes its partial
sums and reduce-scatters them back (with one DP rank and replicated rows: an all-reduce).
Shared experts inside a MoE layer call `partial()` and leave the reduction to the MoE layer.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels import ops as K
from moeserve.config.quant import QuantSpec
from moeserve.layers.linear import init_weight, linear, weight_dest
from moeserve.config.spec import ModelSpec
from moeserve.layers.weights import (WeightError, check_segments, check_shard_blocks,
                                     load_gated_mlp)
from moeserve.layers.communicator import (gather_world_rows, layer_scatters, reduce_world_rows,
                                          world_buffer, world_collectives)
from moeserve.batch.buffers import ModelBuffers
from moeserve.parallel.groups import ParallelState
from moeserve.parallel.symm_comm import SymmetricCollectives
from moeserve.batch.step import StepContext

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}

# hidden_act -> the activation code of the Triton kernels (kernels/elementwise/act.py)
KERNEL_ACTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh"}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported; moeserve supports "
                         f"{', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class _Proj(nn.Module):
    """A bias-free weight [out, in], so that parameter names read `<proj>.weight` (in fp8
    beside `<proj>.weight_scale_inv` with `quant`)."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype,
                 quant: Optional[QuantSpec] = None) -> None:
        super().__init__()
        init_weight(self, out_features, in_features, dtype, quant)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                 ) -> torch.Tensor:
        return linear(x, self.weight, residual=residual, scale=self.weight_scale_inv,
                      block=self.block)

    @property
    def dest(self) -> Any:
        """Where the checkpoint's weight goes (layers/weights.copy_into)."""
        return weight_dest(self, "weight")


class DenseMLP(nn.Module):
    CHECKPOINT_NAMES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")

    def __init__(self, spec: ModelSpec, state: ParallelState, dtype: torch.dtype = torch.float32,
                 *, intermediate_size: Optional[int] = None, tp_size: Optional[int] = None,
                 quant: Optional[QuantSpec] = None) -> None:
        super().__init__()
        lay = state.layout
        self.state = state
        self.hidden = spec.hidden_size
        self.intermediate = intermediate_size or spec.dense_intermediate_size
        self.tp_size = lay.dense_tp if tp_size is None else tp_size
        if self.tp_size not in (1, state.world.size):
            raise ValueError(f"a dense MLP is replicated (1) or split over all {lay.tp} ranks, "
                             f"not over {self.tp_size}: set --moe-dense-tp-size 1 or leave it "
                             "unset")
        if self.intermediate % self.tp_size:
            raise ValueError(f"MLP intermediate size {self.intermediate} does not split across "
                             f"{self.tp_size} ranks: set --moe-dense-tp-size 1")
        self.tp_rank = state.world.rank if self.tp_size > 1 else 0
        self.i_local = self.intermediate // self.tp_size
        self.act = activation(spec.hidden_act)
        self.kernel_act = KERNEL_ACTS.get(spec.hidden_act)  # None: the torch formulation
        self.scattered = layer_scatters(lay, moe=False)
        if quant is not None:  # gate and up stacked in one weight; down split along its input
            check_segments("MLP gate/up", (self.i_local, self.i_local), quant.block_n)
            check_shard_blocks("MLP down input", self.intermediate, self.i_local,
                               self.tp_size, quant.block_k)
        self.gate_up = _Proj(2 * self.i_local, self.hidden, dtype, quant)
        self.down = _Proj(self.hidden, self.i_local, dtype, quant)
        self.gather_buffer: Optional[torch.Tensor] = None  # None: each gather allocates
        self.symm: Optional[SymmetricCollectives] = None  # None: NCCL (gloo) alone

    def bind_buffers(self, buffers: ModelBuffers) -> None:
        """A dense layer split over the world gathers into the plan's dp_gather.rows, and
        exchanges rows on the world's one-shot collectives where the plan has a window."""
        if self.tp_size > 1:
            self.gather_buffer = world_buffer(buffers.gather, self.state, self.scattered,
                                              "a dense MLP split over the tp world")
            self.symm = world_collectives(buffers.comm, self.state)

    def partial(self, x_NH: torch.Tensor, add_to: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """This rank's share of the MLP output (the whole output when replicated), plus
        `add_to` when given (in the down projection's launch on a decode step's rows)."""
        gate_up = self.gate_up(x_NH)
        ops = K.elementwise(gate_up.device) if self.kernel_act else None
        h = ops.act_and_mul(gate_up, self.kernel_act) if ops is not None else None
        if h is None:
            h = self.act(gate_up[:, : self.i_local]) * gate_up[:, self.i_local:]
        return self.down(h, residual=add_to)

    def forward(self, x_MH: torch.Tensor, step: StepContext, pending_ok: bool = False):
        """A dense layer's block on this rank's rows (see the module doc for the layouts);
        pending_ok: the caller takes the partial sums as an Unreduced where
        reduce_world_rows may leave them so."""
        if self.tp_size == 1:
            return self.partial(x_MH)
        x_NH = gather_world_rows(x_MH, step, self.state, self.scattered, self.gather_buffer,
                                 self.symm)
        return reduce_world_rows(self.partial(x_NH), step, self.state, self.scattered,
                                 self.symm, pending_ok)

    # --- weights (names relative to the module, e.g. "mlp.") ------------------------------
    def checkpoint_names(self) -> list[str]:
        return list(self.CHECKPOINT_NAMES)

    def needs(self, name: str) -> bool:
        return name in self.CHECKPOINT_NAMES

    def load_weight(self, name: str, src: Any) -> None:
        proj, _, param = name.partition(".")
        if param != "weight" or not load_gated_mlp(
                proj, name, src, self.gate_up.dest, self.down.dest,
                intermediate=self.intermediate, rank=self.tp_rank):
            raise WeightError(f"a dense MLP has no checkpoint tensor {name!r}; it reads "
                              f"{', '.join(self.CHECKPOINT_NAMES)}")
