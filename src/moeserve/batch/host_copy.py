"""Host integers to the device without waiting for it.

A copy from pageable host memory that the driver cannot stage inline (past 64 KiB) waits for
every kernel queued before it on the stream; under the overlap schedule that is the step in
flight, so a prefill's token ids, positions and slots (tens of KiB to MiB) would hold the host
until the device is idle. They go through pinned memory instead: torch's caching host allocator
keeps a pinned block until the copy that reads it has run, so every call may take a fresh one.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """`values` on `device`, queued without waiting for the device (pinned on a GPU)."""
    device = torch.device(device)
    host = torch.from_numpy(np.ascontiguousarray(values))
    if device.type == "cuda":
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        pinned.copy_(host)
        host = pinned
    return host.to(device, non_blocking=True)
