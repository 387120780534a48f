"""The one-sided all-to-all: each rank stores its tokens straight into its peers' symmetric
windows over NVLink, and the peers store their results straight back (--moe-a2a-backend
nvlink). Same contract and same row semantics as the NCCL all_to_all dispatcher; no send
buffer, no padded exchange, no count exchange, no host synchronisation.

Needs whole experts per rank (ep == tp, moe_tp == 1) and the plan's records (the binder's):
a2a.recv and a2a.combine, symmetric windows that every MoE layer shares, and the slot tables
a2a.slots / a2a.sources. R, the step's runtime max per rank (the same on every rank, at most
the cap: the runtime guard raised otherwise), fixes the windows' layout for the step
(kernels/moe/exchange.py), so that every rank knows where to store without asking.

Dispatch: route_slots gives each (row, destination) its slot from a prefix sum per
destination, in row order (for a decode step's few rows, dispatch_small does it in the same
launch as the stores); push_rows stores each row once into each rank that owns one of its
experts, with its ids masked to that rank's experts, and -1 ids into the slots nobody fills;
a barrier. The expert runner reads the recv window in place. Combine: push_back stores each
filled slot's result into [this rank, slot] of its source's combine window (push_back_sums:
the slot's top-k sum, taken in the same launch from the experts' unsummed pair rows, where
the runner leaves them); a barrier;
sum_back adds a row's results in fp32 in rank order (the same bits on every run), its own
rank's read from the expert outputs, which never travel.

One barrier per phase is enough between layers: a rank stores into a peer's recv window for
layer L+1 only after the combine barrier of layer L, which the peer passes only after its
experts of layer L read the window; the same holds for the combine window one phase later.

On a CPU (gloo) the peers' stores are emulated: exchange_torch.rows_for builds what each
destination would receive and all_to_all_fixed delivers it into the same windows, so the CPU
tests run this dispatcher's layout, slots and sums against the reference dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from moeserve.batch.buffers import ModelBuffers, PeerExchangeBuffers
from moeserve.batch.step import StepContext
from moeserve.kernels.moe import exchange_torch
from moeserve.kernels.moe.configs import route_blocks
from moeserve.layers.pending import TopkRows
from moeserve.moe.dispatch.base import DISPATCHERS, DispatchedTokens, ExchangeDispatcher
from moeserve.parallel.collectives import all_to_all_fixed, region
from moeserve.parallel.symmetric import PeerWindow, unreachable_peers


@dataclass(frozen=True, kw_only=True)
class PeerHandle:
    num_tokens: int  # M: this rank's rows
    capacity: int  # R: slots per (source, destination) pair in this step
    slots_MP: torch.Tensor  # int32: row m's slot on rank p, -1 where it did not go
    ids_NK: torch.Tensor  # the recv window's ids: which slots were filled


@DISPATCHERS.register("nvlink")
class NVLinkDispatcher(ExchangeDispatcher):
    marker = "a2a.combine"
    sums_topk_rows = True  # push_back_sums: no top-k sum launch before the exchange

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.buffers: Optional[PeerExchangeBuffers] = None
        self.recv_window: Optional[PeerWindow] = None  # on a GPU: the peers' stores
        self.combine_window: Optional[PeerWindow] = None

    def bind(self, buffers: ModelBuffers) -> None:
        """The plan's windows and slot tables; on a GPU, the rendezvous with every peer
        (collective: every rank binds at startup, before any graph capture)."""
        ws = buffers.a2a
        if ws is not None and ws is self.buffers:  # every MoE layer binds the shared one
            return
        if not isinstance(ws, PeerExchangeBuffers):
            raise ValueError("the nvlink dispatcher needs the plan's a2a.recv / a2a.combine "
                             "windows: build the plan with --moe-a2a-backend nvlink")
        p, cap, hb = self.axis.size, self.cap, self.hidden * self.dtype.itemsize
        for name, buf, want in (("a2a.recv", ws.recv, (p, cap, self.payload)),
                                ("a2a.combine", ws.combine, (p, cap, hb))):
            if tuple(buf.shape) != want or buf.dtype != torch.uint8:
                raise ValueError(f"the plan's {name} is {tuple(buf.shape)} {buf.dtype}, but "
                                 f"{self.dtype} tokens need {want} uint8: build the plan with "
                                 f"--dtype {str(self.dtype).removeprefix('torch.')}")
        self.buffers = ws
        if ws.recv.is_cuda:
            self._open_windows(ws)

    def _open_windows(self, ws: PeerExchangeBuffers) -> None:
        dev = ws.recv.device
        count = torch.cuda.device_count()
        far = unreachable_peers(dev, [g % count for g in self.axis.ranks])
        if far:
            raise RuntimeError(f"GPU {dev.index} cannot store into GPUs {far} directly (no "
                               "NVLink or P2P mapping): use --moe-a2a-backend all_to_all")
        self.recv_window = PeerWindow.open(ws.recv, self.axis)
        self.combine_window = PeerWindow.open(ws.combine, self.axis)

    def _windows(self, r: int) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor,
                                        torch.Tensor]:
        """The step's views of the recv window: x [P R, H] (fp8 rows: float8_e4m3fn), their
        scales [P R, G] (None unless fp8), ids [P R, K], weights [P R, K]."""
        assert self.buffers is not None
        p, h, k = self.axis.size, self.hidden, self.top_k
        n, g = p * r, self.scale_groups
        dtype = torch.float8_e4m3fn if g else self.dtype
        scales_at, ids_at, weights_at = exchange_torch.window_offsets(p, r, h, k,
                                                                      dtype.itemsize, g)
        flat = self.buffers.recv.view(-1)
        scales = flat[scales_at: ids_at].view(torch.float32).view(n, g) if g else None
        return (flat[:scales_at].view(dtype).view(n, h), scales,
                flat[ids_at: weights_at].view(torch.int32).view(n, k),
                flat[weights_at: weights_at + n * k * 4].view(torch.float32).view(n, k))

    def dispatch(self, x_MH: torch.Tensor, topk_ids_MK: torch.Tensor,
                 topk_weights_MK: torch.Tensor, step: StepContext
                 ) -> tuple[DispatchedTokens, PeerHandle]:
        if self.buffers is None:
            raise RuntimeError("bind the plan's buffers (bind_model_buffers) before the nvlink "
                               "dispatcher exchanges tokens")
        p, m, r = self._step_rows(x_MH, step, "the all-to-all windows were")
        ids_MK = topk_ids_MK.to(torch.int32).contiguous()
        weights_MK = topk_weights_MK.to(torch.float32).contiguous()
        slots_MP = region(self.buffers.slots, (m, p), torch.int32)
        sources_PR = region(self.buffers.sources, (p, r), torch.int32)
        x_NH, x_scale_NG, recv_ids_NK, recv_weights_NK = self._windows(r)
        x_MH, x_scale_MG = x_MH.contiguous(), None
        if self.scale_group and r:  # quantized once here, for every peer the row goes to
            x_MH, x_scale_MG = self._quantized(x_MH, self.buffers)
        if r and self.recv_window is not None:
            from moeserve.kernels.moe import exchange

            peers, rank, per = self.recv_window.peer_ptrs, self.axis.rank, self.experts_per_rank
            if m <= exchange.SMALL_M:  # one launch; sources_PR is not needed
                exchange.dispatch_small(x_MH, ids_MK, weights_MK, slots_MP, peers, rank, r,
                                        per, x_scale_MG)
            else:
                counts = region(self.buffers.route_counts, (p, route_blocks(m)), torch.int32)
                exchange.route_slots(ids_MK, slots_MP, sources_PR, per, counts)
                exchange.push_rows(x_MH, ids_MK, weights_MK, sources_PR, peers, rank, per,
                                   x_scale_MG)
            self.recv_window.barrier()
        elif r:
            exchange_torch.route_slots(ids_MK, slots_MP, sources_PR, self.experts_per_rank)
            *sent, scales = exchange_torch.rows_for(x_MH, ids_MK, weights_MK, sources_PR,
                                                    self.experts_per_rank, x_scale_MG)
            # (fp8 rows travel as their bytes: gloo has no float8)
            into_x = x_NH.view(torch.uint8) if self.scale_group else x_NH
            parts = [(into_x, sent[0]), (recv_ids_NK, sent[1]), (recv_weights_NK, sent[2])]
            if x_scale_NG is not None:
                parts.append((x_scale_NG, scales))
            for into, rows in parts:
                all_to_all_fixed(into.view(p, r, -1), rows.contiguous(), self.axis)
        tokens = DispatchedTokens(x_NH=x_NH, topk_ids_NK=recv_ids_NK,
                                  topk_weights_NK=recv_weights_NK, x_scale_NG=x_scale_NG)
        return tokens, PeerHandle(num_tokens=m, capacity=r, slots_MP=slots_MP,
                                  ids_NK=recv_ids_NK)

    def combine(self, y_NH: Union[torch.Tensor, TopkRows], handle: PeerHandle,
                pending_ok: bool = False) -> torch.Tensor:
        """y_NH: the experts' slot rows [P R, H], or their unsummed pair rows (TopkRows),
        whose top-k sums the push's launch takes on a GPU (exchange.push_back_sums)."""
        assert self.buffers is not None
        p, r, m = self.axis.size, handle.capacity, handle.num_tokens
        rows = y_NH if isinstance(y_NH, TopkRows) else None
        if rows is not None and self.combine_window is None:
            y_NH, rows = rows.settle(), None  # the emulated peers take the summed rows
        if rows is None:
            assert y_NH.shape == (p * r, self.hidden) and y_NH.dtype == self.dtype
        dtype = self.dtype
        out_MH = torch.empty(m, self.hidden, dtype=dtype, device=self.buffers.combine.device)
        if r == 0:
            return out_MH
        back_NH = region(self.buffers.combine, (p * r, self.hidden), dtype)
        if self.combine_window is not None:
            from moeserve.kernels.moe import exchange

            peers, rank = self.combine_window.peer_ptrs, self.axis.rank
            if rows is not None:  # this rank's own sums land in y_NH for sum_back
                assert rows.rows.shape[0] == p * r * self.top_k and rows.rows.dtype == dtype
                y_NH = torch.empty(p * r, self.hidden, dtype=dtype, device=back_NH.device)
                exchange.push_back_sums(rows.rows, rows.topk_ids, rows.first_expert,
                                        rows.num_local, y_NH, peers, rank, p)
            else:
                exchange.push_back(y_NH, handle.ids_NK, peers, rank, p)
            self.combine_window.barrier()
            exchange.sum_back(back_NH, y_NH, handle.slots_MP, out_MH, rank)
        else:
            all_to_all_fixed(back_NH.view(p, r, self.hidden),
                             y_NH.contiguous().view(p, r, self.hidden), self.axis)
            exchange_torch.sum_back(back_NH, y_NH, handle.slots_MP, out_MH, self.axis.rank)
        return out_MH
