"""Collectives with explicit sizes, on one Axis of the ParallelState.

Every function takes the sizes of every rank (the same list on every rank, from the step's
gathered counts), so all ranks issue the same collective with the same shapes: a rank with
zero rows still takes part. When every rank has zero rows, all ranks skip the collective
together (they decide from the same list).

Uneven all-gather / reduce-scatter pad each rank's block to the largest block and use the
equal-size collective: one call, shapes that depend only on max(sizes). The all-gather
receives into a view of the plan's buffer when given one (`region`), so that the step
allocates nothing for it and a CUDA graph reads the same address on every replay.

`symm` (the axis's SymmetricCollectives, parallel/symm_comm.py, bound from the plan's
comm.symm.<axis> window on the GPUs of one node): a collective whose full tensor fits its
window runs there, one-shot over symmetric memory, with no padding; a larger one, or any
without `symm` (across nodes, on a CPU), runs on NCCL (gloo). Every rank decides from the same
sizes, width and dtype, so all ranks take the same path.

Shape legend: R rows of this rank, N rows of all ranks, P ranks of the axis, C per-peer slots.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from moeserve.parallel.groups import Axis
from moeserve.parallel.symm_comm import SymmetricCollectives

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases have the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


def _block_rows(sizes: Sequence[int], axis: Axis, rows: int, want: int, what: str) -> int:
    """The rows of each padded block, max(sizes), once the sizes fit the axis and the
    tensor holds `want` rows."""
    if len(sizes) != axis.size or min(sizes, default=0) < 0:
        raise ValueError(f"need one non-negative size per rank of a {axis.size}-rank axis, "
                         f"got {list(sizes)}")
    if rows != want:
        raise ValueError(f"{what} holds {rows} rows where the step's blocks {list(sizes)} "
                         f"ask for {want}")
    return max(sizes)


def block_offsets(sizes: Sequence[int]) -> list[int]:
    """Start row of each rank's block in the concatenation of all blocks."""
    offsets, total = [], 0
    for s in sizes:
        offsets.append(total)
        total += s
    return offsets


def region(buffer: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The first bytes of a contiguous `buffer`, as a contiguous `dtype` tensor of `shape`
    (one buffer serves rows of any width and dtype that fit its bytes)."""
    need = math.prod(shape) * dtype.itemsize
    flat = buffer.view(-1).view(torch.uint8)
    if need > flat.numel():
        raise RuntimeError(f"a step needs {need} bytes ({list(shape)} {dtype}) of a planned "
                           f"buffer of {flat.numel()}: it exceeds the token budget the plan "
                           "was made for (`moeserve plan` shows it)")
    return flat[:need].view(dtype).view(*shape)


def all_gather_uneven(x_R: torch.Tensor, sizes: Sequence[int], axis: Axis,
                      buffer: Optional[torch.Tensor] = None,
                      symm: Optional[SymmetricCollectives] = None) -> torch.Tensor:
    """Concatenate every rank's rows in rank order: [sum(sizes), ...]. x_R has sizes[rank]
    rows; trailing dims must agree across ranks. `buffer` (the plan's) receives the padded
    blocks; the result may be a view of it, valid until the next gather into it."""
    pad = _block_rows(sizes, axis, x_R.shape[0], sizes[axis.rank], f"rank {axis.rank}")
    if axis.size == 1:
        return x_R
    if pad == 0:
        return x_R.new_empty((0, *x_R.shape[1:]))
    whole = (sum(sizes), *x_R.shape[1:])
    if symm is not None and symm.takes(math.prod(whole) * x_R.element_size()):
        out = x_R.new_empty(whole) if buffer is None else region(buffer, whole, x_R.dtype)
        symm.all_gather(x_R.contiguous(), sizes, out)
        return out
    send = x_R.contiguous()
    if x_R.shape[0] < pad:
        send = x_R.new_zeros((pad, *x_R.shape[1:]))
        send[: x_R.shape[0]] = x_R
    shape = (axis.size * pad, *x_R.shape[1:])
    out = x_R.new_empty(shape) if buffer is None else region(buffer, shape, x_R.dtype)
    _all_gather_single(out, send, group=axis.group)
    if all(s == pad for s in sizes):
        return out
    return torch.cat([out[r * pad: r * pad + s] for r, s in enumerate(sizes)])


def reduce_scatter_uneven(y_N: torch.Tensor, sizes: Sequence[int], axis: Axis,
                          symm: Optional[SymmetricCollectives] = None) -> torch.Tensor:
    """Sum y_N over the ranks and keep this rank's block. y_N holds every rank's block in rank
    order ([sum(sizes), ...], the layout all_gather_uneven returns); out: [sizes[rank], ...]."""
    pad = _block_rows(sizes, axis, y_N.shape[0], sum(sizes), "the reduce-scatter input")
    if axis.size == 1:
        return y_N
    if pad == 0:
        return y_N.new_empty((0, *y_N.shape[1:]))
    if symm is not None and symm.takes(y_N.numel() * y_N.element_size(), y_N.dtype):
        out = y_N.new_empty((sizes[axis.rank], *y_N.shape[1:]))
        symm.reduce_scatter(y_N.contiguous(), sizes, out)
        return out
    if all(s == pad for s in sizes):
        send = y_N.contiguous()
    else:
        send = y_N.new_zeros((axis.size * pad, *y_N.shape[1:]))
        for r, (off, s) in enumerate(zip(block_offsets(sizes), sizes)):
            send[r * pad: r * pad + s] = y_N[off: off + s]
    out = y_N.new_empty((pad, *y_N.shape[1:]))
    _reduce_scatter_single(out, send, group=axis.group)
    return out[: sizes[axis.rank]]


def all_reduce(x: torch.Tensor, axis: Axis,
               symm: Optional[SymmetricCollectives] = None) -> torch.Tensor:
    """Sum over the axis; in place when x is contiguous. Returns the sum."""
    if axis.size == 1 or x.numel() == 0:
        return x
    x = x.contiguous()
    if symm is not None and symm.takes(x.numel() * x.element_size(), x.dtype):
        return symm.all_reduce(x)
    dist.all_reduce(x, group=axis.group)
    return x


def all_to_all_fixed(recv_PC: torch.Tensor, send_PC: torch.Tensor, axis: Axis) -> None:
    """Exchange fixed-capacity blocks: send_PC[p] goes to rank p, recv_PC[p] comes from rank p.

    Both are contiguous [P, C, ...] with the same shape on every rank; C depends only on the
    plan and the step's runtime max, never on this rank's own count, so the call can be
    captured in a CUDA graph and no rank disagrees about the geometry.
    """
    if send_PC.shape != recv_PC.shape or send_PC.shape[0] != axis.size:
        raise ValueError(f"all-to-all blocks must be [{axis.size}, C, ...] on both sides, got "
                         f"send {tuple(send_PC.shape)} recv {tuple(recv_PC.shape)}")
    assert send_PC.is_contiguous() and recv_PC.is_contiguous()
    if axis.size == 1:
        recv_PC.copy_(send_PC)
        return
    if send_PC.numel() == 0:
        return
    dist.all_to_all_single(recv_PC, send_PC, group=axis.group)
