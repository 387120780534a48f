"""Block-scaled FP8 in torch: what every FP8 path computes, written plainly.

Weights W [..., N, K] are float8_e4m3fn with one float32 scale per bn x bk block:
    W ~= q[n, k] * scale[n // bn, k // bk]       (scale = block amax / 448, "weight_scale_inv")
Activations x [T, K] are quantized per token per bk columns (the same groups as the weights'
K blocks), so a block of the product is an fp8 x fp8 dot times two scales:
    y[t, n] = sum over K blocks b of  xs[t, b] * ws[n // bn, b] * sum_{k in b} xq[t, k] wq[n, k]
The reference dequantizes both operands to float32 and multiplies them: the same products
and scales, with float32 accumulation.

Shape legend: T tokens, N output features, K input features, G = ceil(K / bk) groups.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# scales are amax times this (not amax / 448): torch divides by a scalar that way on a GPU and
# exactly on a CPU, and the Triton kernels multiply too, so every path gives the same scales
INV_FP8_MAX = 1.0 / FP8_MAX
# a block of zeros gets this amax: a finite scale, and its quantized values stay zero
AMAX_FLOOR = 1e-10


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return torch.nn.functional.pad(x, pad)


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Round to float8_e4m3fn (nearest, ties to even), saturating at +-448."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (any float dtype) -> (q [..., N, K] fp8, scale [..., ceil(N/bn),
    ceil(K/bk)] float32), scale = block amax / 448."""
    bn, bk = block
    n, k = w.shape[-2:]
    wp = _pad_to(_pad_to(w.float(), -2, bn), -1, bk)
    nb, kb = wp.shape[-2] // bn, wp.shape[-1] // bk
    blocks = wp.reshape(*w.shape[:-2], nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(AMAX_FLOOR)
    scale = amax * INV_FP8_MAX
    q = to_fp8(blocks / scale[..., :, None, :, None]).reshape(wp.shape)[..., :n, :k]
    return q.contiguous(), scale.contiguous()


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]
                 ) -> torch.Tensor:
    """The block scale [..., nb, kb] as one value per element of [..., N, K]."""
    n, k = shape
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :n, :k]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * its block scale, in `dtype`."""
    return (q.float() * expand_scale(scale.float(), tuple(q.shape[-2:]), block)).to(dtype)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] fp8, scale [T, ceil(K/group)] float32): one scale per token per
    `group` columns, group amax / 448."""
    t, k = x.shape
    xp = _pad_to(x.float(), -1, group).view(t, groups(k, group), group)  # (t may be 0)
    scale = xp.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) * INV_FP8_MAX
    q = to_fp8(xp / scale[..., None]).view(t, xp.shape[1] * group)[:, :k]
    # (row-major strides even for zero rows, whose reductions come out with others)
    return (q.clone(memory_format=torch.contiguous_format),
            scale.clone(memory_format=torch.contiguous_format))


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    k = q.shape[-1]
    return (q.float() * scale.float().repeat_interleave(group, dim=-1)[..., :k]).to(dtype)


def groups(k: int, group: int) -> int:
    return math.ceil(k / group)


def empty_groups(rows: int, k: int, group: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for [rows, k] quantized per `group` columns: fp8 codes [rows, k] and float32
    scales [rows, groups(k, group)], what quantize_groups writes."""
    return (torch.empty(rows, k, dtype=FP8, device=device),
            torch.empty(rows, groups(k, group), dtype=torch.float32, device=device))


def fp8_linear(x_TK: torch.Tensor, w_NK: torch.Tensor, w_scale: torch.Tensor,
               block: tuple[int, int], bias: Optional[torch.Tensor] = None,
               x_scale: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """W8A8 x @ W.T (+ bias): x quantized per token per bk columns (unless it comes quantized,
    with `x_scale`), both operands dequantized, float32 products, out in out_dtype (x's)."""
    out_dtype = out_dtype or (x_TK.dtype if x_scale is None else torch.float32)
    if x_scale is None:
        xq, x_scale = quantize_groups(x_TK.reshape(-1, x_TK.shape[-1]), block[1])
    else:
        xq = x_TK.reshape(-1, x_TK.shape[-1])
    y = dequantize_groups(xq, x_scale, block[1]) @ dequantize_blocks(w_NK, w_scale, block).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).view(*x_TK.shape[:-1], w_NK.shape[0])
