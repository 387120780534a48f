"""Rows quantized by the kernel that produced them, for an fp8 projection to take as they are.

A norm whose output feeds an fp8 projection (the attention's qkv, after the input norm) can
store its rows already quantized per token per `group` columns, the codes and scales that
gemm.quantize_groups would give the rows it would have stored: the projection then runs
without its quantizer launch (kernels/elementwise/fused.py's norms, gemm.fp8_linear).

    Fp8Rows   q [R, K] float8_e4m3fn and scale [R, K / group] float32, views of storage of
              R4 = R rounded up to 4 rows: codes [R4, K] row-major, scales [K / group, R4]
              (outer-dim-major): the layout cuBLAS's block-scaled GEMM reads; the Triton GEMM
              reads any strides

Pure Python (no Triton), so that the layers import it on any install.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GEMV_MAX_ROWS = 2  # up to this many rows fp8_linear takes the GEMV (bf16 rows: it quantizes)


@dataclass(frozen=True)
class Fp8Rows:
    q4: torch.Tensor  # [R4, K] float8_e4m3fn
    s4: torch.Tensor  # [K / group, R4] float32
    rows: int
    group: int
    dtype: torch.dtype  # the rows' dtype before quantization: the projection's output dtype

    @property
    def q(self) -> torch.Tensor:
        return self.q4[:self.rows]

    @property
    def scale(self) -> torch.Tensor:
        return self.s4.t()[:self.rows]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.q4.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.q4.device

    @property
    def is_cuda(self) -> bool:
        return self.q4.is_cuda

    def dequantize(self) -> torch.Tensor:
        """The rows as the quantizer's codes x scales, in float32."""
        q = self.q.float().view(self.rows, -1, self.group)
        return (q * self.scale[:, :, None]).view(self.rows, -1)


def empty_fp8_rows(rows: int, width: int, group: int, dtype: torch.dtype,
                   device: torch.device) -> Fp8Rows:
    r4 = -(-rows // 4) * 4
    return Fp8Rows(torch.empty(r4, width, dtype=torch.float8_e4m3fn, device=device),
                   torch.empty(width // group, r4, dtype=torch.float32, device=device),
                   rows, group, dtype)


def norm_quantizes(rows: int, width: int, group: int) -> bool:
    """Whether a norm of `rows` rows of `width` (a power of two: the norm kernels hold a row
    in one block) stores them quantized for a projection of scale groups `group`: past the
    GEMV's rows (the GEMV quantizes its one or two rows itself, from 16-bit rows)."""
    return (group > 0 and rows > GEMV_MAX_ROWS and width % group == 0
            and width & (width - 1) == 0)
