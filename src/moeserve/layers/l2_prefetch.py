"""Weights streamed into L2 ahead of the kernel that reads them (sm90+, decode steps).

A batch-1 decode step reads every weight once, and between the weight GEMVs run kernels that
read almost nothing from HBM (rope, attention over a short context, norms, the router's
top-k). While they run, HBM idles; then the next GEMV starts its stream cold. A bulk L2
prefetch (`cp.async.bulk.prefetch.L2`, one instruction per chunk, fire and forget: the
issuing program does not wait for the bytes) issued before such a gap fills it with the bytes
the next GEMV will read, so that GEMV reads L2 instead of HBM.

`prefetch_l2` is the device-side helper that kernels call on a slice of a tensor;
`prefetch(tensor)` launches a small kernel that prefetches a whole tensor. That kernel keeps
the PDL contract (layers/pdl.py): it issues its prefetches before its gate (they read only
weights) and finishes only after the kernel before it.

MOESERVE_L2_PREFETCH lists the prefetches that run (for A/B measurements): "o" the o_proj
weights during the attention, "down" each routed expert's down weights during its gate_up,
"qkv" the next layer's qkv weights after the router; "none" turns all off. Off on CPUs, under
Triton's interpreter and below compute capability 9.0 (no bulk prefetch there).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from moeserve.layers.pdl import pdl_args, pdl_gate

PARTS = ("o", "down", "qkv")
MAX_ROWS = 256  # steps of more rows do not prefetch (their GEMMs are not weight-bound)
_ASM = tl.constexpr("{ .reg .pred p; setp.ne.u32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")


def enabled(part: str, device: torch.device) -> bool:
    """Whether the prefetch `part` runs for tensors on `device`."""
    assert part in PARTS, part
    wanted = os.environ.get("MOESERVE_L2_PREFETCH", ",".join(PARTS))
    if part not in wanted.split(",") or device.type != "cuda" or os.environ.get(
            "TRITON_INTERPRET"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm90(index)


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def prefetch_l2(base, nbytes, part, parts, THREADS: tl.constexpr):
    """Prefetch bytes [part, part + 1) / parts of the nbytes at `base` (16-byte aligned, a
    multiple of 16 bytes) into L2: THREADS chunks, one bulk prefetch each."""
    per = tl.cdiv(tl.cdiv(nbytes, parts), 16 * THREADS) * 16
    start = (part * THREADS + tl.arange(0, THREADS)).to(tl.int64) * per
    size = tl.minimum(tl.maximum(nbytes - start, 0), per).to(tl.int32)
    tl.inline_asm_elementwise(_ASM, "=r,l,r", [base.to(tl.pointer_type(tl.int8)) + start, size],
                              dtype=tl.int32, is_pure=False, pack=1)


_LINE_ASM = tl.constexpr("{ .reg .pred p; setp.ne.u32 p, $2, 0; "
                         "@p prefetch.global.L2 [$1]; mov.u32 $0, 0; }")


@triton.jit
def prefetch_l2_lines(base, nbytes, part, parts, THREADS: tl.constexpr):
    """As prefetch_l2, one 128-byte line per instruction (THREADS lines at a time)."""
    lines = tl.cdiv(nbytes, 128)
    per = tl.cdiv(lines, parts)
    lo = part * per
    hi = tl.minimum(lo + per, lines)
    b = base.to(tl.pointer_type(tl.int8))
    for l0 in range(lo, hi, THREADS):
        line = l0 + tl.arange(0, THREADS)
        tl.inline_asm_elementwise(_LINE_ASM, "=r,l,r", [b + line.to(tl.int64) * 128,
                                                         (line < hi).to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_lines_kernel(W, nbytes, THREADS: tl.constexpr, PDL: tl.constexpr):
    prefetch_l2_lines(W, nbytes, tl.program_id(0), tl.num_programs(0), THREADS)
    pdl_gate(PDL)


@triton.jit
def _prefetch_kernel(W, nbytes, THREADS: tl.constexpr, PDL: tl.constexpr):
    prefetch_l2(W, nbytes, tl.program_id(0), tl.num_programs(0), THREADS)
    pdl_gate(PDL)


PROGRAMS = int(os.environ.get("MOESERVE_L2_PREFETCH_PROGRAMS", "264"))
KIND = os.environ.get("MOESERVE_L2_PREFETCH_KIND", "lines")


def prefetch(weight: torch.Tensor) -> None:
    """Start streaming `weight` (contiguous) into L2; returns at once, reads nothing back."""
    assert weight.is_contiguous() and weight.data_ptr() % 16 == 0, "prefetch: aligned tensors"
    nbytes = weight.numel() * weight.element_size() // 16 * 16
    kernel = _prefetch_kernel if KIND == "bulk" else _prefetch_lines_kernel
    if nbytes:
        kernel[(PROGRAMS,)](weight, nbytes, THREADS=128, num_warps=4, **pdl_args(weight.device))
