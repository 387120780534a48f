"""Block outputs whose last sum the norm after the block does, in its own launch.

A decoder layer whose rows need no gather returns its block's output y beside the residual r
unsummed (models/decoder.py): the next layer's input norm (or the final norm) computes
RMSNorm(r + y) and r + y in one launch. Where the caller allows, a block leaves one more sum
to that launch:

    Unreduced  its partial sums over an axis (a TP-split or EP-split block on rows that every
               rank holds): the norm's launch is the one-shot all-reduce's
               (parallel/symm_comm.SymmetricCollectives.all_reduce_add_rms_norm)
    TopkRows   each token's top-k expert rows, weighted, not yet summed (the experts on one
               rank): the norm's launch sums them (kernels/elementwise/fused.topk_add_rms_norm)

Either gives the bits of the sum, then add_rms_norm. `add_norm` takes a tensor or either of
them; `settle` turns either into the tensor (the last layer's output, whose rows the final
norm selects).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch

from moeserve.kernels import ops as K


@dataclass(frozen=True)
class Unreduced:
    """Partial sums [R, H] (contiguous) over the axis of `symm`; every rank decides alike (the
    same rows, width and dtype), so all of them leave the sum to the norm, or none."""
    partial: torch.Tensor
    symm: Any  # SymmetricCollectives

    def settle(self) -> torch.Tensor:
        return self.symm.all_reduce(self.partial)

    def add_norm(self, norm, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.symm.all_reduce_add_rms_norm(self.partial, residual, norm.weight, norm.eps)


@dataclass(frozen=True)
class TopkRows:
    """The experts' weighted rows y [N * k, H] of pairs (token, k), in pair order; a pair
    whose expert is outside [first_expert, first_expert + num_local) counts as zero (as
    kernels/moe/fused_moe.topk_sum sums them). The rows may be the plan's moe.runner.down
    buffer, which every MoE layer writes: the norm right after the block reads them before
    the next MoE layer runs."""
    rows: torch.Tensor
    topk_ids: torch.Tensor  # [N, k] int32
    first_expert: int
    num_local: int

    def settle(self) -> torch.Tensor:
        from moeserve.kernels.moe.fused_moe import topk_sum

        return topk_sum(self.rows, self.topk_ids, self.first_expert, self.num_local)

    def add_norm(self, norm, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops = K.elementwise(residual.device)
        if ops is None or residual.stride(-1) != 1:
            return norm.add_forward(self.settle(), residual)
        return ops.topk_add_rms_norm(self.rows, self.topk_ids, self.first_expert,
                                     self.num_local, residual, norm.weight, norm.eps)


Pending = Union[Unreduced, TopkRows]


def add_norm(norm, x: Union[torch.Tensor, Pending], residual: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) for RMSNorm `norm`, x a tensor or a Pending sum:
    one launch on a GPU."""
    if isinstance(x, (Unreduced, TopkRows)):
        return x.add_norm(norm, residual)
    return norm.add_forward(x, residual)


def add_norm_quantized(norm, x: Union[torch.Tensor, Pending], residual: torch.Tensor,
                       quant_out: tuple[torch.Tensor, torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """add_norm's (norm(x + residual), x + residual), plus whether its launch also quantized
    the norm's rows into quant_out (fp8 [R, D] and float32 [R, D / group]: quantize_groups'
    codes and scales, for an fp8 projection to take as they are): the GPU's add + norm
    launches do, of a tensor or a TopkRows sum, in 16-bit rows (fused.quant_args refuses
    others); elsewhere add_norm alone."""
    ops = K.elementwise(residual.device)
    if ops is not None and residual.dim() == 2 and residual.stride(-1) == 1:
        if isinstance(x, TopkRows):
            return (*ops.topk_add_rms_norm(x.rows, x.topk_ids, x.first_expert, x.num_local,
                                           residual, norm.weight, norm.eps, quant_out), True)
        if (isinstance(x, torch.Tensor) and x.shape == residual.shape
                and x.stride(-1) == 1):
            return (*ops.add_rms_norm(x, residual, norm.weight, norm.eps, quant_out), True)
    return (*add_norm(norm, x, residual), False)


def settle(x: Union[torch.Tensor, Pending]) -> torch.Tensor:
    """x as a tensor."""
    return x.settle() if isinstance(x, (Unreduced, TopkRows)) else x
