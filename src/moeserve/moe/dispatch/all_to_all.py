"""The all-to-all dispatcher: each token travels once to each rank that owns one of its experts.

Needs whole experts per rank (ep == tp, moe_tp == 1). The workspace is the plan's `a2a.send` and
`a2a.recv` records, [ep, cap, payload] bytes each, which the binder allocates once and hands to
the dispatcher (bind), shared by every MoE layer. A step uses the first ep x R x payload
bytes of each as a contiguous [ep, R, payload] block, where R is the step's runtime max per
rank: the same value on every rank (from the gathered counts, after the SP scatter) and at most
cap (the runtime guard raised before the step otherwise). So the exchange's shapes depend only
on the plan and R, never on one rank's own count. A dispatcher built on its own, without a
binder (tests, tools), allocates each step's blocks instead.

Dispatch: slot s of block p on rank r carries the s-th of r's tokens that has an expert on rank
p: its hidden state, all K ids and all K weights (the payload the plan sizes). With fp8
weights (plan.a2a_scale_group) a row is quantized once, before the exchange, and travels as
fp8 with its float32 group scales; the results come back in the model's dtype. Unused slots get
ids -1. The receiving experts compute the weighted sum over the ids they own, so a token with
two experts (or a duplicate id) on one rank is sent once and computed for both. Combine sends
each slot's [H] result back through the same workspace and sums a token's results over the
ranks it visited, in the caller's row order: one index_add_ (atomic adds on CUDA), or with
--enable-deterministic-inference one per peer block, in peer order (sum_by_source).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moeserve.moe.dispatch.base import (DISPATCHERS, DispatchedTokens, ExchangeDispatcher,
                                        hidden_bytes, pack_tokens, unpack_tokens)
from moeserve.plan.buffers import a2a_row_bytes
from moeserve.parallel.collectives import all_to_all_fixed, region
from moeserve.batch.buffers import A2AWorkspace, ModelBuffers
from moeserve.batch.step import StepContext


@dataclass(frozen=True, kw_only=True)
class AllToAllHandle:
    num_tokens: int  # M: this rank's rows
    capacity: int  # R: slots per peer in this step
    source_S: torch.Tensor  # [ep * R] int64: the row each slot carries, M for an empty slot


@DISPATCHERS.register("all_to_all")
class AllToAllDispatcher(ExchangeDispatcher):
    marker = "a2a.send"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # a workspace row carries a token out and its result back
        self.row_bytes = a2a_row_bytes(self.hidden, self.top_k, self.dtype.itemsize,
                                       self.scale_group)
        self.workspace: Optional[A2AWorkspace] = None

    def bind(self, buffers: ModelBuffers) -> None:
        """The plan's a2a.send / a2a.recv, which every step's exchange then goes through."""
        ws = buffers.a2a
        want = (self.state.layout.ep, self.cap, self.row_bytes)
        if ws is None:
            raise ValueError("the all_to_all dispatcher needs the plan's a2a.* records")
        for name, buf in (("a2a.send", ws.send), ("a2a.recv", ws.recv)):
            if tuple(buf.shape) != want or buf.dtype != torch.uint8:
                raise ValueError(f"the plan's {name} is {tuple(buf.shape)} {buf.dtype}, but "
                                 f"{self.dtype} tokens need {want} uint8: build the plan with "
                                 f"--dtype {str(self.dtype).removeprefix('torch.')}")
        self.workspace = ws

    def _block(self, half: Optional[torch.Tensor], capacity: int, width: int,
               device: torch.device) -> torch.Tensor:
        """The step's contiguous [ep, R, width] block at the start of a workspace half (a new
        one without a workspace)."""
        shape = (self.axis.size, capacity, width)
        if half is None:
            return torch.empty(shape, dtype=torch.uint8, device=device)
        return region(half, shape, torch.uint8)

    def dispatch(self, x_MH: torch.Tensor, topk_ids_MK: torch.Tensor,
                 topk_weights_MK: torch.Tensor, step: StepContext
                 ) -> tuple[DispatchedTokens, AllToAllHandle]:
        """No host synchronisation: the slot of every (row, peer) comes from a prefix sum, and
        the send block is one gather from the packed rows (plus an empty row for unused
        slots), so the shapes depend only on the plan and R."""
        p, m, r = self._step_rows(x_MH, step, "the all-to-all workspace was")
        dev = x_MH.device
        valid = topk_ids_MK >= 0
        dest_MK = torch.where(valid, topk_ids_MK.long() // self.experts_per_rank, p)
        goes_MP = torch.zeros(m, p + 1, dtype=torch.bool, device=dev)
        goes_MP = goes_MP.scatter_(1, dest_MK, True)[:, :p]  # column p collects the -1 ids
        slot_MP = goes_MP.long().cumsum(dim=0) - 1
        peers = torch.arange(p, device=dev)
        flat_MP = torch.where(goes_MP, peers[None, :] * r + slot_MP, p * r)  # p*r: discarded
        source = torch.full((p * r + 1,), m, dtype=torch.long, device=dev)
        rows = torch.arange(m, device=dev)[:, None].expand(m, p)
        source.scatter_(0, flat_MP.reshape(-1), rows.reshape(-1))
        source_S = source[: p * r]

        if self.scale_group:  # quantized once here, for every peer the row goes to
            xq_MH, xs_MG = self._quantized(x_MH, self.workspace)
            packed = pack_tokens(xq_MH, topk_ids_MK, topk_weights_MK, xs_MG)
        else:
            packed = pack_tokens(x_MH, topk_ids_MK, topk_weights_MK)
        empty = torch.zeros(1, self.payload, dtype=torch.uint8, device=dev)
        hb = hidden_bytes(self.hidden, self.dtype, self.scale_group)
        empty[:, hb: hb + 4 * self.top_k] = 0xFF  # ids -1: the receiving experts skip it
        ws = self.workspace
        send = self._block(ws and ws.send, r, self.payload, dev)
        torch.index_select(torch.cat([packed, empty]), 0, source_S,
                           out=send.view(p * r, self.payload))
        recv = self._block(ws and ws.recv, r, self.payload, dev)
        all_to_all_fixed(recv, send, self.axis)
        tokens = unpack_tokens(recv.view(p * r, self.payload), self.hidden, self.top_k,
                               self.dtype, self.scale_group)
        return tokens, AllToAllHandle(num_tokens=m, capacity=r, source_S=source_S)

    def combine(self, y_NH: torch.Tensor, handle: AllToAllHandle,
                pending_ok: bool = False) -> torch.Tensor:
        p, r, m = self.axis.size, handle.capacity, handle.num_tokens
        assert y_NH.shape == (p * r, self.hidden) and y_NH.dtype == self.dtype
        hb = self.hidden * self.dtype.itemsize
        ws = self.workspace
        send = self._block(ws and ws.send, r, hb, y_NH.device)
        send.copy_(y_NH.contiguous().view(torch.uint8).view(p, r, hb))
        recv = self._block(ws and ws.recv, r, hb, y_NH.device)
        all_to_all_fixed(recv, send, self.axis)
        back_SH = recv.view(self.dtype).view(p * r, self.hidden)
        in_order = self.plan.config.enable_deterministic_inference
        return sum_by_source(back_SH, handle.source_S, m, p, in_order).to(self.dtype)


def sum_by_source(back_SH: torch.Tensor, source_S: torch.Tensor, m: int, peers: int,
                  in_order: bool) -> torch.Tensor:
    """[m, H] fp32: each row the sum of the slots whose source is that row (empty slots
    name row m and are dropped). A token has at most one slot in each of the `peers` equal
    blocks, so in_order adds block by block: each add meets rows no other add of its launch
    touches, and the launches come in peer order, so the sum's order is fixed."""
    out_MH = torch.zeros(m + 1, back_SH.shape[1], dtype=torch.float32, device=back_SH.device)
    if not in_order:
        return out_MH.index_add_(0, source_S, back_SH.float())[:m]
    r = back_SH.shape[0] // peers
    for q in range(peers):
        out_MH.index_add_(0, source_S[q * r: (q + 1) * r], back_SH[q * r: (q + 1) * r].float())
    return out_MH[:m]
