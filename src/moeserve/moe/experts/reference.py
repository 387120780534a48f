"""The reference expert runner: plain torch, CPU or GPU.

On the CPU: one GEMM pair per local expert that some row uses (the rows of each expert are
found on the host). On a GPU, where a CUDA graph must capture it, it never synchronises with
the host: every local expert runs on every row and a [N, E] weight matrix (zero where a row does
not use the expert) combines the results. That reads every expert's weights: a reference, not
a fast path (the grouped_mm and triton runners are). Forwards whose intermediates would be too
large (big prefills) take the host-driven loop, outside any graph.

With fp8 weights it runs W8A8 as the kernels do: the rows quantized per token per bk columns
(or taken quantized from the dispatcher), each used expert's weights dequantized, gate_up in
float32, the activation's output quantized per row per bk columns, down in float32: the
torch formulation the Triton FP8 kernels are tested against. It finds each expert's rows on
the host, so a CUDA graph does not capture it.

It allocates its intermediates per call, sized by the step (which the runtime guard bounds by
the plan), as every activation is; so does the grouped_mm runner. The plan's `moe.runner.*`
records are the triton runner's workspace, and a plan for this runner has none.
Accumulation is in float32.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

from moeserve.kernels.fp8 import reference as fp8
from moeserve.moe.experts.base import EXPERT_RUNNERS, Experts


# above this many elements of [E_local, N, 2I + H] intermediates an eager GPU forward takes the
# host-driven loop instead of the dense path (a captured forward is always dense)
DENSE_MAX_ELEMENTS = 1 << 28


@EXPERT_RUNNERS.register("reference")
class ReferenceExperts(Experts):
    graph_safe = True  # a captured forward takes the dense path: no host synchronisation
    supports_fp8 = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.quant is not None:
            self.graph_safe = False  # the fp8 path finds each expert's rows on the host

    def forward(self, x_NH: torch.Tensor, topk_ids_NK: torch.Tensor,
                topk_weights_NK: torch.Tensor, x_scale: Optional[torch.Tensor] = None,
                pending_ok: bool = False) -> torch.Tensor:
        if self.quant is not None:
            return self.forward_fp8(x_NH, topk_ids_NK, topk_weights_NK, x_scale)
        assert x_scale is None, "unquantized experts take rows in the model's dtype"
        if x_NH.is_cuda:
            size = self.num_local * x_NH.shape[0] * (2 * self.i_local + self.hidden)
            if size <= DENSE_MAX_ELEMENTS or torch.cuda.is_current_stream_capturing():
                return self.forward_dense(x_NH, topk_ids_NK, topk_weights_NK)
        return self.forward_loop(x_NH, topk_ids_NK, topk_weights_NK)

    def _local_ids(self, topk_ids_NK: torch.Tensor) -> torch.Tensor:
        """Local expert of each entry; num_local (one past the last) for -1 and other ranks'."""
        local_NK = topk_ids_NK.long() - self.first_expert
        own = (topk_ids_NK >= 0) & (local_NK >= 0) & (local_NK < self.num_local)
        return torch.where(own, local_NK, self.num_local)

    def forward_dense(self, x_NH: torch.Tensor, topk_ids_NK: torch.Tensor,
                      topk_weights_NK: torch.Tensor) -> torch.Tensor:
        """Every local expert on every row, combined with a [N, E] weight matrix that is zero
        where a row does not use the expert."""
        n, e = x_NH.shape[0], self.num_local
        comb_NE = torch.zeros(n, e + 1, dtype=torch.float32, device=x_NH.device)
        comb_NE.scatter_add_(1, self._local_ids(topk_ids_NK), topk_weights_NK.float())
        gate_up_ENI = torch.matmul(x_NH.unsqueeze(0), self.w13.transpose(1, 2))
        h_ENI = self.act(gate_up_ENI[..., : self.i_local]) * gate_up_ENI[..., self.i_local:]
        y_ENH = torch.matmul(h_ENI, self.w2.transpose(1, 2))
        return torch.einsum("ne,enh->nh", comb_NE[:, :e], y_ENH.float()).to(x_NH.dtype)

    def forward_loop(self, x_NH: torch.Tensor, topk_ids_NK: torch.Tensor,
                     topk_weights_NK: torch.Tensor) -> torch.Tensor:
        out_NH = torch.zeros(x_NH.shape[0], self.hidden, dtype=torch.float32,
                             device=x_NH.device)
        for e, rows, weight in self._segments(topk_ids_NK, topk_weights_NK):
            gate_up = F.linear(x_NH[rows], self.w13[e])
            h = self.act(gate_up[:, : self.i_local]) * gate_up[:, self.i_local:]
            y = F.linear(h, self.w2[e])
            out_NH.index_add_(0, rows, y.float() * weight[:, None])
        return out_NH.to(x_NH.dtype)

    def _segments(self, topk_ids_NK: torch.Tensor, topk_weights_NK: torch.Tensor
                  ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(local expert, its rows, their float32 weights) for each expert with rows, in expert
        order (the rows in their order: a stable sort); reads the counts on the host."""
        row, k, expert = self.local_pairs(topk_ids_NK)
        if row.numel() == 0:
            return
        weight = topk_weights_NK[row, k].float()
        order = torch.argsort(expert, stable=True)
        row, expert, weight = row[order], expert[order], weight[order]
        start = 0
        for e, count in enumerate(torch.bincount(expert, minlength=self.num_local).tolist()):
            if count:
                yield e, row[start: start + count], weight[start: start + count]
            start += count

    def forward_fp8(self, x_NH: torch.Tensor, topk_ids_NK: torch.Tensor,
                    topk_weights_NK: torch.Tensor, x_scale: Optional[torch.Tensor]
                    ) -> torch.Tensor:
        """W8A8 with block scales (see the module's docstring), in the model's dtype."""
        block, bk = self.quant.block, self.quant.block_k
        xq, xs = self.input_rows(x_NH, x_scale)
        x32_NH = fp8.dequantize_groups(xq, xs, bk)
        out_NH = torch.zeros(x_NH.shape[0], self.hidden, dtype=torch.float32,
                             device=x_NH.device)
        for e, rows, weight in self._segments(topk_ids_NK, topk_weights_NK):
            w13 = fp8.dequantize_blocks(self.w13[e], self.w13_scale_inv[e], block)
            gate_up = x32_NH[rows] @ w13.T
            h = self.act(gate_up[:, : self.i_local]) * gate_up[:, self.i_local:]
            hd = fp8.dequantize_groups(*fp8.quantize_groups(h, bk), bk)
            y = hd @ fp8.dequantize_blocks(self.w2[e], self.w2_scale_inv[e], block).T
            out_NH.index_add_(0, rows, y * weight[:, None])
        return out_NH.to(self.dtype)
