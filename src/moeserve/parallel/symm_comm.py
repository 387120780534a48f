"""A step's collectives on symmetric memory, one axis each (parallel/collectives.py chooses,
call by call, between these and NCCL).

    symm = SymmetricCollectives.open(window, axis)  # at startup, before any capture; collective
    symm.takes(nbytes, dtype)                       # whether a collective of nbytes runs here
    symm.takes_rows(y)                              # whether the all-reduce of rows y does
    symm.all_reduce(x)                              # in place
    symm.all_reduce_add_rms_norm(y, x, w, eps)      # (RMSNorm(x + sum y), x + sum y)
    symm.all_gather(x_R, sizes, out_N)              # every rank's rows, in rank order
    symm.reduce_scatter(y_N, sizes, out_R)          # this rank's rows, summed over the ranks

The window is the plan's comm.symm.<axis> record, 4 P x --symm-comm-max-bytes bytes in
symmetric memory (parallel/symmetric.py: peer-to-peer mappings, no NVLink multicast; a
pushing region and a Lamport region of two halves of P slots each, kernels/comm/layout.py).
A collective runs here when its full tensor (an all-reduce's input, an all-gather's output, a
reduce-scatter's input: the same count on every rank) is at most --symm-comm-max-bytes: below
that size one launch that loads and stores the peers' memory directly beats NCCL's protocol,
above it NCCL's bandwidth wins (`python -m benchmarks collectives` measures where). Every
rank decides from the same numbers (the step's sizes, the rows' width and dtype), so all
ranks take the same path.

    all-reduce      kernels/comm/one_shot.all_reduce: each rank stores x into its slot of
                    every window, signals, waits for every peer's signal, sums the slots of
                    its own window in fp32 in rank order into x (the same bits on every rank)
    all-reduce + add + RMSNorm  the all-reduce whose sum also adds the residual and
                    normalises (a decoder layer's reduction of partial sums and the norm after
                    it, one launch): 16-bit rows by kernels/comm/lamport.py (each rank stores
                    into its slot of every Lamport region and waits for the data itself, no
                    signal), float32 ones by kernels/comm/one_shot.all_reduce_add_norm
    all-gather      kernels/comm/one_shot.gather: each rank stores its rows into every window
                    at their offset in the concatenation (no padding), signals, waits, copies
                    its window out
    reduce-scatter  kernels/comm/one_shot.reduce: each rank stages its input in its window,
                    barrier, sums its own rows from every window in fp32 in rank order, barrier

The pushing ones (all-reduce, all-gather) synchronise one way and alternate between the
window's halves; the reduce-scatter closes with a barrier (kernels/comm/one_shot.py says why
consecutive collectives on one window need nothing more). No step allocates or waits for the host:
the addresses are the window's, the sizes the step's, and CUDA graphs capture the launches.

Why not torch's one_shot_all_reduce: its kernel adds in the tensor's dtype (bf16 sums in
bf16, no fp16), its copy variant signals the peers without first syncing its block's threads
(the staged elements of other threads are not ordered before the signal), and its other form
needs a copy launch first and an output as aligned as the window: ranks that disagreed on
that would run different kernels and deadlock. `python -m benchmarks collectives` times it
beside ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from moeserve.kernels.comm.layout import max_collective_bytes, pad_slots
from moeserve.parallel.groups import Axis
from moeserve.parallel.symmetric import PeerWindow, unreachable_peers

REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def one_shot_fits(nbytes: int, window_bytes: int, dtype: Optional[torch.dtype] = None) -> bool:
    """The rule: a collective of `nbytes` (its full tensor) runs one-shot when it fits the
    window; a reduction only in a float dtype the kernels sum (None: a gather, any dtype)."""
    return 0 < nbytes <= window_bytes and (dtype is None or dtype in REDUCE_DTYPES)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous `t`, flat."""
    return t.reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class SymmetricCollectives:
    window: Any  # PeerWindow: this axis's comm.symm.<axis> window and its peers
    axis: Axis

    @classmethod
    def open(cls, buf: torch.Tensor, axis: Axis) -> "SymmetricCollectives":
        """Rendezvous the window (collective: every rank of the axis, at startup, in the same
        order). Its peers must be GPUs of this node that it can load from and store into."""
        count = torch.cuda.device_count()
        far = unreachable_peers(buf.device, [g % count for g in axis.ranks])
        if far:
            raise RuntimeError(f"GPU {buf.device.index} cannot reach GPUs {far} directly (no "
                               "NVLink or P2P mapping) for the one-shot collectives: use "
                               "--symm-comm-max-bytes 0 (NCCL for every collective)")
        from moeserve.parallel.symmetric import signal_pad_bytes

        if pad_slots(axis.size) * 4 > signal_pad_bytes():
            raise RuntimeError(f"the one-shot collectives over {axis.size} ranks need signal "
                               f"pads of {pad_slots(axis.size) * 4} bytes, torch's symmetric "
                               f"memory has {signal_pad_bytes()}: use --symm-comm-max-bytes 0")
        from moeserve.kernels.comm import lamport

        lamport.fill_region(buf)
        torch.cuda.synchronize(buf.device)  # filled before any peer can store into it
        return cls(PeerWindow.open(buf, axis), axis)

    @property
    def window_nbytes(self) -> int:
        return self.window.local.numel() * self.window.local.element_size()

    @property
    def max_bytes(self) -> int:
        """The largest collective (its full tensor) that runs here: the window holds two
        halves of P of them (kernels/comm/layout.py)."""
        return max_collective_bytes(self.window_nbytes, self.axis.size)

    def takes(self, nbytes: int, dtype: Optional[torch.dtype] = None) -> bool:
        """Whether a collective of `nbytes` (a reduction of `dtype`) runs here."""
        return one_shot_fits(nbytes, self.max_bytes, dtype)

    def takes_rows(self, y: torch.Tensor) -> bool:
        """Whether the all-reduce of rows y [R, D] (R > 0), and so all_reduce_add_rms_norm's,
        runs here."""
        return y.dim() == 2 and y.numel() > 0 and self.takes(y.numel() * y.element_size(),
                                                             y.dtype)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x (contiguous, the same shape on every rank) summed over the axis, in place."""
        from moeserve.kernels.comm import one_shot

        assert x.is_contiguous() and self.takes(x.numel() * x.element_size(), x.dtype)
        flat = x.view(-1)
        one_shot.all_reduce(flat, flat, self.window.peer_ptrs, self.window.signal_ptrs,
                            self.axis.rank, self.window_nbytes)
        return x

    def all_reduce_add_rms_norm(self, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + a), x + a), a = y [R, D] summed over the axis: all_reduce, then
        layers/norm.RMSNorm.add_forward's kernel, in one launch (the same bits); 16-bit rows
        through the window's Lamport region (no signals), float32 ones one-shot."""
        from moeserve.kernels.comm import lamport, one_shot

        assert self.takes_rows(y)
        kernel = (lamport.all_reduce_add_norm if y.dtype in lamport.LAMPORT_DTYPES
                  else one_shot.all_reduce_add_norm)
        return kernel(y, x, weight, eps, self.window.peer_ptrs, self.window.signal_ptrs,
                      self.axis.rank, self.window_nbytes)

    def all_gather(self, x_R: torch.Tensor, sizes: Sequence[int], out_N: torch.Tensor) -> None:
        """out_N = every rank's rows in rank order (x_R: this rank's sizes[rank] rows)."""
        from moeserve.kernels.comm import one_shot

        row = math.prod(out_N.shape[1:]) * out_N.element_size()
        assert out_N.shape[0] == sum(sizes) and self.takes(out_N.shape[0] * row)
        assert x_R.is_contiguous() and out_N.is_contiguous() and x_R.dtype == out_N.dtype
        one_shot.gather(_bytes(x_R), _bytes(out_N), self.window.peer_ptrs,
                        self.window.signal_ptrs, self.axis.rank,
                        sum(sizes[: self.axis.rank]) * row, self.window_nbytes)

    def reduce_scatter(self, y_N: torch.Tensor, sizes: Sequence[int],
                       out_R: torch.Tensor) -> None:
        """out_R = this rank's rows of y_N (every rank's blocks in rank order) summed over the
        ranks, in fp32 in rank order."""
        from moeserve.kernels.comm import one_shot

        assert y_N.is_contiguous() and out_R.is_contiguous() and y_N.dtype == out_R.dtype
        assert self.takes(y_N.numel() * y_N.element_size(), y_N.dtype)
        row = math.prod(y_N.shape[1:])
        one_shot.reduce(y_N.view(-1), out_R.view(-1), self.window.peer_ptrs,
                        self.window.signal_ptrs, self.axis.rank,
                        sum(sizes[: self.axis.rank]) * row)
