"""Symmetric memory: buffers that every peer of a group can store into, over NVLink.

    buf = symmetric_empty(shape, dtype, device)   # the binder, for a record marked symmetric
    win = PeerWindow.open(buf, axis)              # every rank of the axis, before any capture
    win.peer_ptrs                                 # [P] int64 on the device: each peer's buf
    win.signal_ptrs                               # [P] int64: each peer's signal pad (int32s)
    win.barrier()                                 # all peers' earlier stores are visible

Built on torch's symmetric memory (torch.distributed._symmetric_memory) with its CUDA
backend: peer-to-peer mappings, no NVLink multicast (these machines run with
TORCH_SYMM_MEM_DISABLE_MULTICAST=1), no NVSHMEM. Allocation and rendezvous happen at startup:
neither may happen inside a CUDA-graph capture. The barrier is the handle's: a kernel that
signals every peer with release semantics and waits for every peer's signal with acquire
semantics, so stores issued on this stream before it are visible to every peer after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from moeserve.parallel.groups import Axis

BACKEND = "CUDA"  # peer-to-peer mappings; NVSHMEM is not needed


def _symm_mem() -> Any:
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def signal_pad_bytes() -> int:
    """Bytes of each peer's signal pad (torch's, the same for every buffer)."""
    return int(_symm_mem().get_signal_pad_size())


def symmetric_empty(shape: Sequence[int], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A tensor in symmetric memory on `device` (a CUDA device)."""
    symm_mem = _symm_mem()
    if symm_mem.get_backend(device) != BACKEND:
        symm_mem.set_backend(BACKEND)
    return symm_mem.empty(*shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class PeerWindow:
    """One symmetric buffer of this rank and where each peer of the axis has its own."""

    local: torch.Tensor
    peer_ptrs: torch.Tensor  # [P] int64 on the device: the base address of each peer's buffer
    handle: Any  # torch's _SymmetricMemory
    # [P] int64 on the device: each peer's signal pad, the slots of the barriers that kernels
    # run themselves (kernels/comm/one_shot.py)
    signal_ptrs: torch.Tensor
    group_name: str  # the axis's group, which torch's symmetric-memory ops are given

    @classmethod
    def open(cls, buf: torch.Tensor, axis: Axis) -> "PeerWindow":
        """Rendezvous `buf` (from symmetric_empty, the same shape on every rank) over the
        axis. Collective: every rank of the axis calls it, in the same order."""
        if buf.device.type != "cuda":
            raise ValueError(f"peer windows need a CUDA symmetric buffer, got {buf.device}")
        symm_mem = _symm_mem()
        handle = symm_mem.rendezvous(buf, axis.group.group_name)
        if handle.world_size != axis.size:
            raise RuntimeError(f"symmetric memory rendezvous found {handle.world_size} peers on "
                               f"an axis of {axis.size} ranks")
        bases = [int(p) for p in handle.buffer_ptrs]
        into = buf.data_ptr() - bases[axis.rank]  # where buf starts in its allocation
        ptrs = [b + into for b in bases]
        pads = [int(p) for p in handle.signal_pad_ptrs]
        return cls(buf, torch.tensor(ptrs, dtype=torch.int64, device=buf.device), handle,
                   torch.tensor(pads, dtype=torch.int64, device=buf.device),
                   axis.group.group_name)

    def barrier(self) -> None:
        """Every peer has reached this point of its stream, and the stores it issued before
        are visible here (and this rank's to it)."""
        self.handle.barrier(channel=0)


def unreachable_peers(device: torch.device, peers: Sequence[int]) -> list[int]:
    """The peers of `peers` (device indices of this node) that `device` cannot reach with
    loads and stores: they need a direct (NVLink or PCIe P2P) mapping."""
    return [p for p in peers
            if p != device.index and not torch.cuda.can_device_access_peer(device.index, p)]
