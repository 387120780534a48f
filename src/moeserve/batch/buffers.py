"""The typed handles of the plan's static buffers that the model's layers use.

runtime/buffers.py (the binder) allocates every record of the capacity plan once and hands the
model these handles (MoECausalLM.bind_buffers); each layer keeps the handle it uses. A field is
None where the plan has no such record: then nothing of this rank uses it (the plan records
what its ranks run and no more), or a layer built on its own, without a binder (tests, tools),
allocates per step instead.

Every MoE layer (and every dense layer) of a model shares one set: they run one after another
on one stream, and each consumes what it wrote before the next layer writes it, as it would
consume memory that the caching allocator hands from one layer to the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from moeserve.kernels.fp8.tiles import SplitWorkspace
from moeserve.kernels.moe.align_torch import Workspace
from moeserve.parallel.groups import Axis
from moeserve.parallel.symm_comm import SymmetricCollectives


@dataclass(frozen=True, kw_only=True)
class RouterBuffers:
    """moe.router.*: the top-k of a MoE layer's rows; a step uses the first M rows."""

    topk_ids_MK: torch.Tensor  # [M_max, K] int32
    topk_weights_MK: torch.Tensor  # [M_max, K] float32

    def rows(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        if m > self.topk_ids_MK.shape[0]:
            raise RuntimeError(
                f"this MoE step routes {m} rows, above the {self.topk_ids_MK.shape[0]} of the "
                "plan's moe.router.topk_* buffers: the step exceeds the token budget the plan "
                "was made for (`moeserve plan` shows it)")
        return self.topk_ids_MK[:m], self.topk_weights_MK[:m]


@dataclass(frozen=True, kw_only=True)
class GatherBuffers:
    """The receive buffers of the padded uneven all-gathers (parallel/collectives.py takes a
    view of their first bytes: region)."""

    attn_tp: Optional[torch.Tensor] = None  # attn_tp_gather.hidden [attn_tp x chunk, H]
    world: Optional[torch.Tensor] = None  # dp_gather.rows [tp x chunk, bytes a row] uint8


@dataclass(frozen=True, kw_only=True)
class CommWindows:
    """comm.symm.<axis>: the windows of the one-shot collectives, [--symm-comm-max-bytes]
    uint8 each, symmetric on a GPU. `collectives(name, axis)` hands every layer of an axis the
    same SymmetricCollectives: the first call rendezvouses the window with the axis's peers
    (collective: every rank binds its layers in the same order, at startup, before any graph
    capture); None where the plan has no window for the axis or the window is not on a GPU
    (a CPU runs every collective on gloo)."""

    attn_tp: Optional[torch.Tensor] = None
    world: Optional[torch.Tensor] = None
    _opened: dict[str, SymmetricCollectives] = field(default_factory=dict, compare=False,
                                                     repr=False)

    def collectives(self, name: str, axis: Axis) -> Optional[SymmetricCollectives]:
        buf = getattr(self, name)
        if buf is None or axis.size == 1 or not buf.is_cuda:
            return None
        if name not in self._opened:
            self._opened[name] = SymmetricCollectives.open(buf, axis)
        symm = self._opened[name]
        assert symm.axis.ranks == axis.ranks, (name, symm.axis, axis)
        return symm


@dataclass(frozen=True, kw_only=True)
class A2AWorkspace:
    """a2a.send / a2a.recv: [ep, cap, payload] uint8 each (moe/dispatch/all_to_all.py); with
    fp8 rows a2a.quant [cap, H] fp8 and a2a.quant_scale [cap, G] float32, this rank's rows
    quantized before they travel."""

    send: torch.Tensor
    recv: torch.Tensor
    quant: Optional[torch.Tensor] = None
    quant_scale: Optional[torch.Tensor] = None


@dataclass(frozen=True, kw_only=True)
class PeerExchangeBuffers:
    """The nvlink transport's records (moe/dispatch/nvlink.py): a2a.recv [ep, cap, payload]
    and a2a.combine [ep, cap, H x dtype bytes] uint8, symmetric on a GPU; a2a.slots [cap, ep],
    a2a.sources [ep, cap] and a2a.route_counts [ep, ceil(cap / ROUTE_BLOCK)] int32, local;
    with fp8 rows a2a.quant and a2a.quant_scale, as A2AWorkspace's."""

    recv: torch.Tensor
    combine: torch.Tensor
    slots: torch.Tensor
    sources: torch.Tensor
    route_counts: torch.Tensor
    quant: Optional[torch.Tensor] = None
    quant_scale: Optional[torch.Tensor] = None


@dataclass(frozen=True, kw_only=True)
class AttentionPartials:
    """attn.decode.*: the decode attention's split partials (layers/attention_triton.py)."""

    part_o: torch.Tensor  # [S, heads, width] float32
    part_lse: torch.Tensor  # [S, heads] float32


@dataclass(frozen=True, kw_only=True)
class ModelBuffers:
    router: Optional[RouterBuffers] = None
    gather: GatherBuffers = GatherBuffers()
    comm: CommWindows = field(default_factory=CommWindows)
    a2a: Optional[A2AWorkspace | PeerExchangeBuffers] = None
    experts: Optional[Workspace] = None  # moe.runner.* (the triton expert runner)
    attention: Optional[AttentionPartials] = None
    fp8_gemm: Optional[SplitWorkspace] = None  # fp8.gemm.* (fp8 projections on a GPU)
