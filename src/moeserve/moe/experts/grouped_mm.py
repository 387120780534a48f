"""The torch._grouped_mm expert runner: baseline of the Triton runner and its fallback.

Pairs are sorted by local expert (pairs of other ranks and ids of -1 go last, outside every
group); offsets are the int32 cumulative counts per expert. torch._grouped_mm (torch >= 2.8:
2-D A [rows, H] x 3-D B [E, H, n] with `offs`) wants 16-byte aligned data pointers and strides
that are multiples of 16 bytes: w13 and w2 are passed as transposed views ([E, H, 2I] with
stride 1 along H), which holds when H and I_local are multiples of 8 in bf16. Rows past the
last offset are left unwritten by the GEMM, so they are masked before the top-k sum. The sum
is index_add_ (atomic adds on CUDA), or with `deterministic` k gathers of each row's j-th
pair, added in j order (no second [P, H] buffer).
On CUDA it runs bf16 on sm_90+; on a CPU it runs any float dtype (used by the CPU tests).
No host synchronisation: it can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch

from moeserve.moe.experts.base import EXPERT_RUNNERS, Experts
from moeserve.kernels.moe.align_torch import local_keys


@EXPERT_RUNNERS.register("grouped_mm")
class GroupedMMExperts(Experts):
    graph_safe = True  # no host synchronisation: CUDA graphs capture it

    def forward(self, x_NH: torch.Tensor, topk_ids_NK: torch.Tensor,
                topk_weights_NK: torch.Tensor, x_scale: Optional[torch.Tensor] = None,
                pending_ok: bool = False) -> torch.Tensor:
        assert x_scale is None, "this runner takes rows in the model's dtype"
        n, k = topk_ids_NK.shape
        if n == 0:
            return x_NH.new_zeros(0, self.hidden)
        key, own = local_keys(topk_ids_NK, self.first_expert, self.num_local)
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(self.num_local + 1, dtype=torch.int32, device=x_NH.device)
        counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
        offs = torch.cumsum(counts[: self.num_local], 0, dtype=torch.int32)
        token = order // k
        gate_up = torch._grouped_mm(x_NH[token], self.w13.transpose(1, 2), offs=offs)
        h = self.act(gate_up[:, : self.i_local]) * gate_up[:, self.i_local:]
        y = torch._grouped_mm(h, self.w2.transpose(1, 2), offs=offs)
        weight = torch.where(own, topk_weights_NK.reshape(-1).float(), 0.0)[order]
        y = torch.where(own[order, None], y.float() * weight[:, None], 0.0)
        out_NH = torch.zeros(n, self.hidden, dtype=torch.float32, device=x_NH.device)
        if self.deterministic:  # k gathers of the rows' j-th pairs, added in j order
            slot = torch.empty_like(order).scatter_(
                0, order, torch.arange(n * k, device=order.device)).view(n, k)
            for j in range(k):
                out_NH += y[slot[:, j]]
        else:
            out_NH.index_add_(0, token, y)
        return out_NH.to(x_NH.dtype)
