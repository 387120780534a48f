"""Tensor-parallel linear layers over one axis of the ParallelState (attn_tp, moe_tp, ...).

  ColumnParallelLinear      W [out/tp, in]: each rank computes a slice of the outputs
  MergedColumnParallelLinear several outputs of one input in one GEMM (gate_up; MLA's q and
                            kv_a), each split across the axis or whole on every rank
  QKVParallelLinear         q heads split; KV heads split, or replicated when tp > kv heads
  RowParallelLinear         W [out, in/tp]: each rank returns a partial sum; the reduction
                            (all-reduce or reduce-scatter) belongs to the layer communicator

Weights load from a full checkpoint tensor or a safetensors slice: each rank reads only its
rows/columns (layers/weights.py), so a rank never materialises another rank's shard.

`linear` is F.linear, except for the few rows of a decode step on a GPU: those go through the
skinny-GEMM kernel (kernels/skinny/gemm.py), which streams the weight at the memory's rate.

With `quant` (config/quant.py) a layer holds its weight in float8_e4m3fn with block scales
(`weight_scale_inv`) and computes W8A8: the activation quantized per token per block_k
columns, by the device's FP8 kernels (kernels/fp8, chosen once with the KernelSet) or their
torch formulation. A shard or a stacked part that splits a scale block fails at construction.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from moeserve.kernels import ops as K
from moeserve.kernels.skinny.tiles import MOST_ROWS, beats_cublas
from moeserve.config.quant import QuantSpec
from moeserve.kernels.fp8 import reference as fp8_ref
from moeserve.layers.weights import (as_float, check_segments, check_shard_blocks, copy_into, empty_param,
                                     expect_shape, quant_param, read, scale_param, shard_range)
from moeserve.parallel.groups import Axis

SKINNY_MAX_ROWS = MOST_ROWS  # up to this many rows a GPU projection is a GEMV (skinny_tiles)


# ------------------------------------------------------------------------------------------
# The product itself.

def skinny(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           out_dtype: Optional[torch.dtype] = None, max_rows: int = SKINNY_MAX_ROWS,
           residual: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """x @ weight.T (+ bias) in out_dtype (x's by default) by the skinny-GEMM kernel, with fp32
    accumulation, for a CUDA x of 1..max_rows rows with a contiguous last dim, plus `residual`
    in the same launch when given; None where it does not apply (the caller computes it in
    torch)."""
    if (x.device.type != "cuda" or x.dim() == 0 or x.stride(-1) != 1
            or weight.stride(-1) != 1 or (bias is not None and bias.stride(-1) != 1)
            or (residual is not None and (residual.stride(-1) != 1
                                          or residual.dtype != (out_dtype or x.dtype)))
            or not 0 < x.numel() <= max_rows * x.shape[-1]):
        return None
    ops = K.skinny(x.device)
    return None if ops is None else ops.skinny_linear(x, weight, bias, out_dtype, residual=residual)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           residual: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None,
           block: Optional[tuple[int, int]] = None,
           x_quant: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) (+ residual); a decode step's few rows on a GPU by the skinny
    kernels where their measurements beat cuBLAS's (skinny_tiles.TILES), the residual added in
    its epilogue. An fp8 weight comes with its block `scale`: W8A8 by the FP8 kernels, which
    take x's rows as x_quant gives them quantized where the kernel that made x did so."""
    if scale is not None:
        assert block is not None
        ops = K.fp8(x.device)
        if ops is not None:
            return ops.fp8_linear(x, weight, scale, block, bias, residual, x_quant)
        y = fp8_ref.fp8_linear(x, weight, scale, block, bias)
        return y if residual is None else y + residual
    y = None
    if x.is_cuda and x.dim() and beats_cublas(x.numel() // max(1, x.shape[-1]), *weight.shape):
        y = skinny(x, weight, bias, residual=residual)
        if y is not None:
            return y
    y = nn.functional.linear(x, weight, bias)
    return y if residual is None else y + residual


def quantize_rows(x_TK: torch.Tensor, group: int,
                  out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 rows, float32 scales [T, ceil(K/group)]): each row quantized per `group` columns,
    by the device's FP8 kernel or its torch formulation; into `out` (row-major tensors of
    those shapes) when given."""
    ops = K.fp8(x_TK.device)
    if ops is not None:
        return ops.quantize_groups(x_TK, group, out)
    q, scale = fp8_ref.quantize_groups(x_TK, group)
    if out is None:
        return q, scale
    out[0].copy_(q)
    out[1].copy_(scale)
    return out


# ------------------------------------------------------------------------------------------
# The LM head's gather along the vocab dim (row collectives live in parallel/collectives).

def axis_all_gather(x: torch.Tensor, axis: Axis, dim: int = -1) -> torch.Tensor:
    """Concatenate equal-shaped tensors of every rank of `axis` along `dim`."""
    if axis.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(axis.size)]
    dist.all_gather(parts, x.contiguous(), group=axis.group)
    return torch.cat(parts, dim=dim)


def _split(total: int, axis: Axis, what: str) -> int:
    if total % axis.size:
        raise ValueError(f"{what} {total} does not split across {axis.size} ranks")
    return total // axis.size


def input_group(module: nn.Module) -> Optional[int]:
    """The columns by which a linear layer's input is quantized (fp8 weights), else None."""
    return None if getattr(module, "weight_scale_inv", None) is None else module.block[1]


def init_weight(module: nn.Module, out_features: int, in_features: int, dtype: torch.dtype,
             quant: Optional[QuantSpec]) -> None:
    """module.weight [out, in] in `dtype`, or in fp8 beside its weight_scale_inv."""
    module.quant = quant
    module.block = None if quant is None else quant.block
    if quant is None:
        module.weight = empty_param(out_features, in_features, dtype=dtype)
        module.weight_scale_inv = None
    else:
        module.weight = empty_param(out_features, in_features, dtype=fp8_ref.FP8)
        module.weight_scale_inv = scale_param(out_features, in_features, block=quant.block)


def weight_source(module: nn.Module, src: Any) -> Any:
    """The checkpoint tensor as this layer reads it: an fp8 one dequantized when the layer
    keeps its weight in a float dtype (latent attention's kv_b_proj)."""
    return src if module.weight_scale_inv is not None else as_float(src)


def weight_dest(module: nn.Module, param_name: str) -> Any:
    """Where checkpoint tensor `param_name` goes: the (quantized) weight or the bias."""
    if param_name == "weight":
        return quant_param(module.weight, module.weight_scale_inv, module.block)
    return getattr(module, param_name)


# ------------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """y_TO = x_TI @ W_OI.T + b_O with O = out_features / tp on each rank."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, axis: Axis,
                 dtype: torch.dtype, quant: Optional[QuantSpec] = None):
        super().__init__()
        self.in_features, self.out_features, self.axis = in_features, out_features, axis
        self.out_local = _split(out_features, axis, "output features")
        if quant is not None:
            check_shard_blocks("output features", out_features, self.out_local, axis.size,
                               quant.block_n)
        init_weight(self, self.out_local, in_features, dtype, quant)
        self.bias = empty_param(self.out_local, dtype=dtype) if bias else None

    def forward(self, x_TI: torch.Tensor) -> torch.Tensor:
        return linear(x_TI, self.weight, self.bias, scale=self.weight_scale_inv,
                      block=self.block)

    def load_weight(self, param_name: str, src: Any) -> None:
        """param_name: "weight" [out, in] or "bias" [out], the full checkpoint tensor."""
        src = weight_source(self, src)
        full = (self.out_features, self.in_features) if param_name == "weight" \
            else (self.out_features,)
        expect_shape(param_name, src, full)
        rows = shard_range(self.axis.rank, self.out_local)
        copy_into(weight_dest(self, param_name), read(src, rows=rows), param_name)


class MergedColumnParallelLinear(nn.Module):
    """Several projections of the same input in one weight, e.g. gate_up:
    W = [gate_local; up_local], each output split across the axis, or whole on every rank
    where `replicated` says so (latent attention's q_proj beside kv_a_proj_with_mqa). The
    bias starts at zero, so a shard whose checkpoint has none adds nothing."""

    def __init__(self, in_features: int, out_features: Sequence[int], *, bias: bool,
                 axis: Axis, dtype: torch.dtype, replicated: Sequence[bool] = (),
                 quant: Optional[QuantSpec] = None):
        super().__init__()
        self.in_features, self.axis = in_features, axis
        self.out_features = tuple(out_features)
        self.replicated = tuple(replicated) or (False,) * len(self.out_features)
        self.out_locals = tuple(o if whole else _split(o, axis, "output features")
                                for o, whole in zip(out_features, self.replicated))
        self.offsets = tuple(sum(self.out_locals[:i]) for i in range(len(out_features)))
        if quant is not None:
            for o, local, whole in zip(self.out_features, self.out_locals, self.replicated):
                check_shard_blocks("output features", o, local, 1 if whole else axis.size,
                                   quant.block_n)
            check_segments("stacked projections", self.out_locals, quant.block_n)
        init_weight(self, sum(self.out_locals), in_features, dtype, quant)
        self.bias = nn.Parameter(torch.zeros(sum(self.out_locals), dtype=dtype),
                                 requires_grad=False) if bias else None

    def forward(self, x_TI: torch.Tensor) -> torch.Tensor:
        return linear(x_TI, self.weight, self.bias, scale=self.weight_scale_inv,
                      block=self.block)

    def split(self, y_TO: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """forward's output as one view per shard."""
        return y_TO.split(self.out_locals, dim=-1)

    def load_weight(self, param_name: str, src: Any, shard: int) -> None:
        """Load output `shard` (0 = gate, 1 = up, ...) from its full checkpoint tensor."""
        src = weight_source(self, src)
        param = weight_dest(self, param_name)
        out, local = self.out_features[shard], self.out_locals[shard]
        expect_shape(param_name, src, (out, self.in_features) if param_name == "weight"
                     else (out,))
        dst = param[self.offsets[shard]:self.offsets[shard] + local]
        rank = 0 if self.replicated[shard] else self.axis.rank
        copy_into(dst, read(src, rows=shard_range(rank, local)), param_name)


class QKVParallelLinear(nn.Module):
    """q, k, v projections in one GEMM. Each rank holds heads/tp query heads and
    max(1, kv_heads/tp) KV heads: split when kv_heads >= tp, else rank r holds KV head
    r // (tp / kv_heads), so every rank's query heads see the KV head they share."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, *,
                 bias: bool, axis: Axis, dtype: torch.dtype, quant: Optional[QuantSpec] = None):
        super().__init__()
        tp = axis.size
        if num_heads % tp:
            raise ValueError(f"{num_heads} attention heads do not split across {tp} ranks")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads can be neither split nor replicated "
                             f"across {tp} ranks")
        self.hidden, self.head_dim, self.axis = hidden, head_dim, axis
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.heads_local = num_heads // tp
        self.kv_heads_local = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)  # ranks holding the same KV head
        self.kv_head_start = (axis.rank // self.kv_replicas) * self.kv_heads_local
        self.q_size = self.heads_local * head_dim
        self.kv_size = self.kv_heads_local * head_dim
        out = self.q_size + 2 * self.kv_size
        if quant is not None:
            check_segments("q, k, v projections", (self.q_size, self.kv_size, self.kv_size),
                           quant.block_n)
            check_shard_blocks("v projection", num_kv_heads * head_dim, self.kv_size,
                               axis.size // self.kv_replicas, quant.block_n)
        init_weight(self, out, hidden, dtype, quant)
        self.bias = empty_param(out, dtype=dtype) if bias else None

    def forward(self, x_TH: torch.Tensor,
                x_quant: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x_quant: x's rows already quantized per block_k columns (fp8 weights only)."""
        qkv = linear(x_TH, self.weight, self.bias, scale=self.weight_scale_inv,
                     block=self.block, x_quant=x_quant)
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def load_weight(self, param_name: str, src: Any, shard: str) -> None:
        """shard "q", "k" or "v": the full q_proj / k_proj / v_proj tensor."""
        src = weight_source(self, src)
        param = weight_dest(self, param_name)
        d = self.head_dim
        if shard == "q":
            full, start, local, offset = self.num_heads * d, self.axis.rank * self.q_size, \
                self.q_size, 0
        else:
            full, start, local = self.num_kv_heads * d, self.kv_head_start * d, self.kv_size
            offset = self.q_size + (0 if shard == "k" else self.kv_size)
        name = f"{shard}_proj.{param_name}"
        expect_shape(name, src, (full, self.hidden) if param_name == "weight" else (full,))
        copy_into(param[offset:offset + local], read(src, rows=(start, start + local)), name)


class RowParallelLinear(nn.Module):
    """Partial y_TO = x_TI_local @ W_O,I_local.T on each rank (I = in_features / tp); the sum
    over ranks is left to the caller's communicator. The bias is added on rank 0 only, so the
    reduced sum carries it once."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, axis: Axis,
                 dtype: torch.dtype, quant: Optional[QuantSpec] = None):
        super().__init__()
        self.in_features, self.out_features, self.axis = in_features, out_features, axis
        self.in_local = _split(in_features, axis, "input features")
        if quant is not None:
            check_shard_blocks("input features", in_features, self.in_local, axis.size,
                               quant.block_k)
        init_weight(self, out_features, self.in_local, dtype, quant)
        self.bias: Optional[nn.Parameter] = empty_param(out_features, dtype=dtype) if bias else None

    def forward(self, x_TI: torch.Tensor,
                x_quant: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """x_quant: x's rows already quantized per block_k columns (fp8 weights only)."""
        bias = self.bias if self.axis.rank == 0 else None
        return linear(x_TI, self.weight, bias, scale=self.weight_scale_inv, block=self.block,
                      x_quant=x_quant)

    def load_weight(self, param_name: str, src: Any) -> None:
        src = weight_source(self, src)
        if param_name == "bias":
            expect_shape(param_name, src, (self.out_features,))
            copy_into(self.bias, read(src), param_name)
            return
        expect_shape(param_name, src, (self.out_features, self.in_features))
        cols = shard_range(self.axis.rank, self.in_local)
        copy_into(weight_dest(self, "weight"), read(src, cols=cols), param_name)
