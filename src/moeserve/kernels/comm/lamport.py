"""The all-reduce + residual add + RMSNorm of 16-bit rows on the window's Lamport region: the
data is its own flag, so a call needs no signal and no fence.

Every element of the region holds the sentinel (int16 bits 0x8000, -0.0 in float16 and
bfloat16) except while a call's data is in flight there. A rank stores its rows into its slot
of every rank's region (a -0.0 of its own goes out as +0.0: the sum is the same), and each
rank waits on its own region alone: it loads each slot until no element is the sentinel
(volatile loads, past the SM's L1), adds the slots in fp32 in rank order, and writes the
sentinel back over what it read. The one-shot kernel's (kernels/comm/one_shot.py) release of
the pushes before a flag, and the acquire of the peers' flags, are gone: an element that
arrived is an element that can be added.

Calls alternate between the region's two halves by their epoch (this rank's count of these
calls, its own pad slot, advanced by the last program of the grid to finish, as the one-shot
collectives do theirs). A peer can store call e + 2 into the half that call e used only after
this rank's call e + 1 stored into it, that is after this rank's call e ended, sentinels
written back included; call e + 1's stores go to the other half. So a half holds one call's
data at a time, and a rank that finds no sentinel has found this call's.

Row b, b + G, ... belong to program b on every rank (G = min(rows, MAX_PROGRAMS) programs),
the same rows it sums, so no program waits for another of its grid. PUSH / SUM split the
phases for Triton's interpreter (tests: every rank pushes, then every rank sums); on a GPU
both run in one launch, with PDL where the device has it (the gate first: the kernel before
may be a collective).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.comm.layout import LAMPORT_SENTINEL, region_bytes
from moeserve.kernels.comm.one_shot import _epoch, _keep_epoch, _window, norm_launch
from moeserve.kernels.elementwise.fused import store_sum_and_norm
from moeserve.kernels.launch.pdl import pdl_gate

# own pad slots [(MAX_PROGRAMS + 2) P + rank]: the epoch, and the one after it the programs
# that finished (one_shot._epoch / _keep_epoch's AT; the pushing collectives use AT 0)
_EPOCH = tl.constexpr(2)
_SENTINEL = tl.constexpr(LAMPORT_SENTINEL)


@triton.jit(do_not_specialize=["rows", "rank", "base", "half"])
def _lamport_norm_kernel(Y, X, W, OUT, S, PEERS, PADS, rows, D, stride_x, rank, base, half,
                         eps, P: tl.constexpr, BLOCK_D: tl.constexpr, PUSH: tl.constexpr,
                         SUM: tl.constexpr, PDL: tl.constexpr):
    pdl_gate(PDL)  # before the epoch too: the kernel before may be a collective
    T = Y.dtype.element_ty
    epoch = _epoch(PADS, rank, P, _EPOCH)
    at = base + (epoch & 1) * half  # this call's half of the region (int16 elements)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    g = tl.num_programs(0)
    if PUSH:  # rows into slot [rank] of every rank's half
        for row in range(tl.program_id(0), rows, g):
            bits = tl.load(Y + row * D + offs, mask=mask).to(tl.int16, bitcast=True)
            bits = tl.where(bits == _SENTINEL, tl.zeros_like(bits), bits)
            for p in tl.static_range(P):
                tl.store(_window(PEERS, p, tl.int16) + at + (rank * rows + row) * D + offs,
                         bits, mask=mask)
    if SUM:
        mine = _window(PEERS, rank, tl.int16) + at
        sentinel = tl.full((BLOCK_D,), _SENTINEL, tl.int16)
        for row in range(tl.program_id(0), rows, g):
            acc = tl.zeros((BLOCK_D,), tl.float32)
            for q in tl.static_range(P):  # rank order
                slot = mine + (q * rows + row) * D + offs
                bits = tl.load(slot, mask=mask, other=0, volatile=True)
                while tl.max(((bits == _SENTINEL) & mask).to(tl.int32), 0) > 0:
                    bits = tl.load(slot, mask=mask, other=0, volatile=True)
                acc += bits.to(T, bitcast=True).to(tl.float32)
                tl.store(slot, sentinel, mask=mask)
            a = acc.to(T).to(tl.float32)  # rounded as the all-reduce stores it
            x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
            store_sum_and_norm(x + a, S, OUT, W, row, D, offs, mask, eps)
        _keep_epoch(PADS, rank, epoch, P, _EPOCH)


LAMPORT_DTYPES = (torch.bfloat16, torch.float16)


def fill_region(window: torch.Tensor) -> None:
    """The window's Lamport region, all sentinel (before the window's rendezvous: no peer
    stores into it until then)."""
    start = region_bytes(window.numel() * window.element_size())
    window.view(torch.uint8)[start:].view(torch.int16).fill_(LAMPORT_SENTINEL)


def all_reduce_add_norm(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        peer_ptrs: torch.Tensor, signal_ptrs: torch.Tensor, rank: int,
                        window_nbytes: int, *, push: bool = True, add: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """one_shot.all_reduce_add_norm's result, bit for bit, for 16-bit rows y [R, D]
    (LAMPORT_DTYPES, contiguous), through the Lamport region of windows of window_nbytes
    (window_bytes(y's bytes, P) or more)."""
    rows, d = y.shape
    assert y.dtype in LAMPORT_DTYPES and y.is_contiguous() and x.shape == y.shape
    assert x.dtype == y.dtype and x.stride(-1) == 1 and weight.shape == (d,)
    p = peer_ptrs.numel()
    region = region_bytes(window_nbytes)
    half = region // 4  # int16 elements in half the region
    assert region % 4 == 0 and p * y.numel() <= half and rows * x.stride(0) < 2**31, \
        (window_nbytes, p, y.shape)
    out, total, grid, launch = norm_launch(y, weight)
    if rows:
        _lamport_norm_kernel[grid](
            y, x, weight, out, total, peer_ptrs, signal_ptrs, rows, d, x.stride(0), rank,
            region // 2, half, eps, P=p, PUSH=push, SUM=add, **launch)
    return out, total
