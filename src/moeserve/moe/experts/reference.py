"""The reference expert runner: plain torch, CPU or GPU, one GEMM pair per local expert.

It allocates its intermediates per call (sized by the step, which the runtime guard bounded
by the plan); the fast GPU runners work in the plan's `moe.runner.*` buffers instead.
Accumulation is in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.moe.experts.base import Experts, register_experts


@register_experts("reference")
class ReferenceExperts(Experts):
    def forward(self, x_NH: torch.Tensor, topk_ids_NK: torch.Tensor,
                topk_weights_NK: torch.Tensor) -> torch.Tensor:
        row, k, expert = self.local_pairs(topk_ids_NK)
        out_NH = torch.zeros(x_NH.shape[0], self.hidden, dtype=torch.float32,
                             device=x_NH.device)
        if row.numel() == 0:
            return out_NH.to(x_NH.dtype)
        weight = topk_weights_NK[row, k].float()
        order = torch.argsort(expert, stable=True)
        row, expert, weight = row[order], expert[order], weight[order]
        counts = torch.bincount(expert, minlength=self.num_local).tolist()
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows = row[start: start + count]
            gate_up = F.linear(x_NH[rows], self.w13[e])
            h = self.act(gate_up[:, : self.i_local]) * gate_up[:, self.i_local:]
            y = F.linear(h, self.w2[e])
            out_NH.index_add_(0, rows, y.float() * weight[start: start + count, None])
            start += count
        return out_NH.to(x_NH.dtype)
