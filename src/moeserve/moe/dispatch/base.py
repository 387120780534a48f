"""The dispatcher contract, and the registry of its implementations (moe/dispatch/__init__.py
imports them all and creates them).

    tokens, handle = dispatcher.dispatch(x_MH, topk_ids_MK, topk_weights_MK, step)
    y_NH = experts(tokens.x_NH, tokens.topk_ids_NK, tokens.topk_weights_NK)   # weighted
    y_MH = dispatcher.combine(y_NH, handle)

M: this rank's rows; N: the rows this rank's experts must see (all ranks' rows on the gather
path, the received slots on the all-to-all path). The experts apply the top-k weights of the
ids they own and sum over them; ids they do not own, and ids of -1, contribute nothing. combine
sums the contributions of every rank and returns [M, H] in the caller's row order. The handle
is a frozen, keyword-only dataclass: all a combine needs, fixed at dispatch time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from moeserve.config.registry import Registry

from moeserve.batch.buffers import ModelBuffers
from moeserve.config.spec import ModelSpec
from moeserve.layers.linear import quantize_rows
from moeserve.parallel.collectives import region
from moeserve.parallel.groups import ParallelState
from moeserve.batch.step import StepContext
from moeserve.plan.buffers import TOPK_ID_BYTES, TOPK_WEIGHT_BYTES, token_payload_bytes
from moeserve.plan.capacity import CapacityPlan


@dataclass(frozen=True, kw_only=True)
class DispatchedTokens:
    x_NH: torch.Tensor  # the model's dtype, or float8_e4m3fn with x_scale_NG
    topk_ids_NK: torch.Tensor  # int32, global expert ids; -1: none
    topk_weights_NK: torch.Tensor  # float32
    # float32 scales of fp8 rows, one per G columns (plan.a2a_scale_group); None: not fp8
    x_scale_NG: Optional[torch.Tensor] = None


class Dispatcher(ABC):
    # True when combine sums partial outputs over the tp world for rows that include every row
    # the caller gave: a block sharded over the world (a shared expert) may then add its partial
    # sums to the expert output before combine and ride the same reduction.
    reduces_partial_sums: ClassVar[bool]
    # True when dispatch and combine never wait for the host (no data-dependent shapes): a
    # CUDA graph can capture them (runtime/cuda_graph.py runs decode eagerly otherwise)
    graph_safe: ClassVar[bool] = False
    # True when dispatch hands the experts the caller's rows themselves (x_NH is x_MH)
    passes_rows: ClassVar[bool] = False
    combine_passes: ClassVar[bool] = False  # combine hands the experts' output back as it is
    # True when combine also takes the experts' unsummed pair rows (a TopkRows, whatever the
    # caller's pending_ok) and does their top-k sum in a launch of its own
    sums_topk_rows: ClassVar[bool] = False

    def __init__(self, spec: ModelSpec, state: ParallelState, plan: CapacityPlan,
                 dtype: torch.dtype) -> None:
        self.spec = spec
        self.state = state
        self.plan = plan
        self.dtype = dtype

    @property
    def name(self) -> str:
        return DISPATCHERS.name_of(type(self))

    def bind(self, buffers: ModelBuffers) -> None:
        """Take the plan's buffers this dispatcher exchanges through (none by default)."""

    @abstractmethod
    def dispatch(self, x_MH: torch.Tensor, topk_ids_MK: torch.Tensor,
                 topk_weights_MK: torch.Tensor, step: StepContext
                 ) -> tuple[DispatchedTokens, Any]:
        """The tokens this rank's experts must see, and the handle for combine."""

    @abstractmethod
    def combine(self, y_NH: torch.Tensor, handle: Any, pending_ok: bool = False):
        """The experts' weighted outputs back in the caller's layout: [M, H].
        pending_ok: the caller also takes a Pending sum (layers/pending.py) for the norm
        after the block: a dispatcher whose combine ends in an all-reduce may return an
        Unreduced, one that passes y_NH back as it is (combine_passes) passes a TopkRows;
        the others return the rows. y_NH may be a TopkRows where sums_topk_rows."""


DISPATCHERS: Registry[type[Dispatcher]] = Registry("MoE dispatcher")


class ExchangeDispatcher(Dispatcher):
    """The dispatchers that move each token to whole experts (all_to_all, nvlink: ep == tp),
    through the plan's all-to-all records (`marker`: one only this transport's plan has)."""

    reduces_partial_sums = False
    graph_safe = True  # no host synchronisation: shapes from the plan and R only
    marker: ClassVar[str]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        lay, spec, plan = self.state.layout, self.spec, self.plan
        if not lay.a2a or plan.a2a_cap is None or not plan.has_buffer(self.marker):
            raise ValueError(f"the {self.name} dispatcher needs a plan made with "
                             f"--moe-a2a-backend {self.name}")
        if lay.moe_tp != 1:
            raise ValueError(f"the all-to-all moves tokens to whole experts: set --ep-size "
                             f"{lay.tp} (= --tp-size)")
        self.axis = self.state.ep
        self.cap = plan.a2a_cap
        self.hidden, self.top_k = spec.hidden_size, spec.top_k
        self.experts_per_rank = spec.num_experts // lay.ep
        self.scale_group = plan.a2a_scale_group  # fp8 rows: quantized once, before they travel
        # float32 scales a fp8 row carries (0: rows in the model's dtype)
        self.scale_groups = -(-self.hidden // self.scale_group) if self.scale_group else 0
        self.payload = payload_bytes(self.hidden, self.top_k, self.dtype, self.scale_group)

    def _quantized(self, x_MH: torch.Tensor, ws: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows in fp8 and their group scales, in the plan's a2a.quant /
        a2a.quant_scale when `ws` (the bound workspace) holds them."""
        m = x_MH.shape[0]
        out = None
        if ws is not None and ws.quant is not None:
            out = (region(ws.quant, (m, self.hidden), ws.quant.dtype),
                   region(ws.quant_scale, (m, self.scale_groups), torch.float32))
        return quantize_rows(x_MH, self.scale_group, out)

    def _step_rows(self, x_MH: torch.Tensor, step: StepContext, where: str
                   ) -> tuple[int, int, int]:
        """(ranks, this rank's rows, the step's runtime max per rank), after checking the rows
        against what `where` (the plan's exchange buffers) was planned for."""
        p, m, r = self.axis.size, x_MH.shape[0], step.runtime_max_per_rank
        if x_MH.dtype != self.dtype:
            raise ValueError(f"{where} planned for {self.dtype} tokens, got {x_MH.dtype}")
        if not m <= r <= self.cap:
            raise ValueError(f"rank holds {m} MoE rows but the step's runtime max per rank is "
                             f"{r} (cap {self.cap}): pass the rows the step describes")
        return p, m, r


# --- the token payload: one byte row per token (plan/buffers.token_payload_bytes) ----------

def payload_bytes(hidden: int, top_k: int, dtype: torch.dtype,
                  scale_group: Optional[int] = None) -> int:
    """Hidden states in `dtype` (fp8 with scale_group: then a float32 scale per scale_group
    columns), then K int32 ids, then K float32 weights."""
    elem = 1 if scale_group else dtype.itemsize
    return token_payload_bytes(hidden, top_k, elem, scale_group)


def hidden_bytes(hidden: int, dtype: torch.dtype, scale_group: Optional[int] = None) -> int:
    """Where a payload's ids start: after the hidden states (and their fp8 scales)."""
    return payload_bytes(hidden, 0, dtype, scale_group)


def pack_tokens(x_MH: torch.Tensor, topk_ids_MK: torch.Tensor,
                topk_weights_MK: torch.Tensor, x_scale_MG: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
    """[M, payload] uint8 rows (fp8 rows with their float32 scales when x_scale_MG is
    given)."""
    parts = [x_MH.contiguous().view(torch.uint8)]
    if x_scale_MG is not None:
        parts.append(x_scale_MG.to(torch.float32).contiguous().view(torch.uint8))
    parts += [topk_ids_MK.to(torch.int32).contiguous().view(torch.uint8),
              topk_weights_MK.to(torch.float32).contiguous().view(torch.uint8)]
    return torch.cat(parts, dim=1)


def unpack_tokens(rows_NP: torch.Tensor, hidden: int, top_k: int,
                  dtype: torch.dtype, scale_group: Optional[int] = None) -> DispatchedTokens:
    """Inverse of pack_tokens, on [N, payload] uint8 rows (copies: the rows may be a shared
    workspace that the next exchange overwrites); with scale_group, fp8 rows and scales."""
    hb = hidden_bytes(hidden, dtype, scale_group)
    wb = hb + TOPK_ID_BYTES * top_k  # where the weights start
    x_scale = None
    if scale_group:
        x_NH = rows_NP[:, :hidden].contiguous().view(torch.float8_e4m3fn)
        x_scale = rows_NP[:, hidden:hb].contiguous().view(torch.float32)
    else:
        x_NH = rows_NP[:, :hb].contiguous().view(dtype)
    return DispatchedTokens(
        x_NH=x_NH, x_scale_NG=x_scale,
        topk_ids_NK=rows_NP[:, hb: wb].contiguous().view(torch.int32),
        topk_weights_NK=rows_NP[:, wb: wb + TOPK_WEIGHT_BYTES * top_k].contiguous()
        .view(torch.float32))
