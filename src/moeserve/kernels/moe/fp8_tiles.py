"""What the fp8 MoE kernels share (fused_moe_fp8.py, decode_moe_fp8.py): the epilogue's
per-group quantization of a float32 tile and the tile rules of block-scaled operands."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8.gemm import e4m3_codes, group_scale
from moeserve.kernels.moe.configs import fp8_tile_problems

FP8 = torch.float8_e4m3fn


@triton.jit
def quantize_rows(h, M: tl.constexpr, N: tl.constexpr, GROUP_K: tl.constexpr):
    """h [M, N] float32 -> (values on the e4m3 grid [M, N] float32, scales [M, N / GROUP_K]):
    per row per GROUP_K columns, amax / 448, as gemm.quantize_groups."""
    h3 = tl.reshape(h, (M, N // GROUP_K, GROUP_K))
    scale = group_scale(tl.max(tl.abs(h3), axis=2))
    return tl.reshape(e4m3_codes(h3, scale[:, :, None]), (M, N)), scale


def check_tiles(cfg: dict[str, Any], group: int, what: str, whole_groups: bool,
                decode: bool = False) -> None:
    """The fp8 tile rules (configs.fp8_tile_problems), at launch."""
    bad = fp8_tile_problems(cfg, group, whole_groups, decode)
    if bad:
        raise ValueError(f"fp8 MoE tile config for {what}: {'; '.join(bad)}; re-run "
                         "python -m benchmarks tune-moe --fp8")
