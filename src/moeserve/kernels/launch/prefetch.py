"""L2 prefetch of a kernel's weights before its PDL gate (sm90+ decode steps).

Under PDL (kernels/launch/pdl.py) a kernel's programs are placed while the kernel before it
still runs, and hold at their gate until it has finished. A weight-streaming kernel of a decode
step (a GEMV, a split-K GEMM of a few rows) may read its weights before the gate, since no
kernel writes them; loading them into registers there holds only a tile or two. An L2
prefetch (`prefetch.global.L2`, a hint that returns nothing and holds no register) of the
program's whole weight slice instead starts all of its bytes on their way: while the kernel
before finishes, the memory that it leaves idle fetches this kernel's weights, and past the
gate the program's loads find them in L2.

`prefetch_args(device)` gives the kernels' PREFETCH constexpr: on a CUDA device whose kernel set
has PDL on (without PDL no program is placed early), and while PREFETCH_L2 is True (benchmarks
compare the two). Under Triton's interpreter there is no inline PTX: PREFETCH is False there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.launch.choice import kernels_for

PREFETCH_L2 = True  # False: no kernel prefetches (benchmarks measure what it gains)
L2_LINE = 128  # bytes a prefetch brings in
_LINE = tl.constexpr(L2_LINE)  # (a global a kernel reads must be a constexpr)


def prefetch_args(device: torch.device) -> dict:
    """The PREFETCH constexpr of a launch on `device`."""
    return {"PREFETCH": bool(PREFETCH_L2 and device.type == "cuda" and kernels_for(device).pdl)}


def prefetch_lines(elements: int, element_size: int) -> int:
    """The LINES constexpr of prefetch_rows for rows of `elements` values: the L2 lines a row
    spans, rounded up to a power of two."""
    return triton.next_power_of_2(max(1, triton.cdiv(elements * element_size, L2_LINE)))


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the line of each pointer where mask holds (no data comes back)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(row_ptrs, row_ok, elements, LINES: tl.constexpr):
    """The first `elements` values of each row at row_ptrs [R] (where row_ok), into L2: LINES
    lines a row (prefetch_lines)."""
    STEP: tl.constexpr = 8 * _LINE // row_ptrs.dtype.element_ty.primitive_bitwidth
    offs = tl.arange(0, LINES) * STEP
    prefetch_l2(row_ptrs[:, None] + offs[None, :], row_ok[:, None] & (offs < elements)[None, :])
