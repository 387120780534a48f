"""What the fp8 MoE kernels share (fused_moe_fp8.py, decode_moe_fp8.py): the epilogue's
per-group quantization of a float32 tile, the tile rules of block-scaled operands and the
quantizer launch of rows that arrive in 16 bits."""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8.gemm import e4m3_codes, group_scale, quantize_groups
from moeserve.kernels.moe.align_torch import Workspace, take
from moeserve.kernels.moe.configs import fp8_tile_problems

FP8 = torch.float8_e4m3fn


@triton.jit
def quantize_rows(h, M: tl.constexpr, N: tl.constexpr, GROUP_K: tl.constexpr):
    """h [M, N] float32 -> (values on the e4m3 grid [M, N] float32, scales [M, N / GROUP_K]):
    per row per GROUP_K columns, amax / 448, as gemm.quantize_groups."""
    h3 = tl.reshape(h, (M, N // GROUP_K, GROUP_K))
    scale = group_scale(tl.max(tl.abs(h3), axis=2))
    return tl.reshape(e4m3_codes(h3, scale[:, :, None]), (M, N)), scale


@triton.jit
def quantized_groups(x):
    """The activation's groups x [GROUPS, bk] (float32, zero outside K) as the quantizer codes
    them, dequantized: codes x scale."""
    scale = group_scale(tl.max(tl.abs(x), axis=1))
    return e4m3_codes(x, scale[:, None]) * scale[:, None]


def check_tiles(cfg: dict[str, Any], group: int, what: str, whole_groups: bool,
                decode: bool = False) -> None:
    """The fp8 tile rules (configs.fp8_tile_problems), at launch."""
    bad = fp8_tile_problems(cfg, group, whole_groups, decode)
    if bad:
        raise ValueError(f"fp8 MoE tile config for {what}: {'; '.join(bad)}; re-run "
                         "python -m benchmarks tune-moe --fp8")


def quantize_input(x_NH: torch.Tensor, group: int, ws: Optional[Workspace]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows quantized per token per `group` columns, into the workspace's input records
    when it has them."""
    return _quantize_into(x_NH, group, ws and ws.input, ws and ws.input_scale, "input")


def quantize_act(h_PI: torch.Tensor, group: int, ws: Optional[Workspace]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode gate_up's float32 product quantized per pair per `group` columns, into the
    workspace's act records (the grouped path's h) when it has them."""
    return _quantize_into(h_PI, group, ws and ws.act, ws and ws.act_scale, "act")


def _quantize_into(x: torch.Tensor, group: int, q_rec: Optional[torch.Tensor],
                   s_rec: Optional[torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = x.shape
    q = take(q_rec, n, name, k, dtype=FP8, device=x.device)
    s = take(s_rec, n, f"{name}_scale", triton.cdiv(k, group), dtype=torch.float32,
             device=x.device)
    return quantize_groups(x, group, out=(q, s))
