"""The one-shot collectives' window and signal-pad layout (kernels/comm/one_shot.py says why),
without Triton: the plan sizes the windows by it (plan/buffers.comm_records), the collectives
read their largest tensor back from a window's bytes (parallel/symm_comm.py)."""

from __future__ import annotations

MAX_PROGRAMS = 32  # below the SM count of every GPU this runs on: all programs resident at once


def window_bytes(max_bytes: int, peers: int) -> int:
    """A window's bytes for collectives of up to max_bytes over `peers` ranks: two halves of
    `peers` slots (the all-reduce pushes its whole tensor into a slot of every rank)."""
    return 2 * peers * max_bytes


def max_collective_bytes(window_nbytes: int, peers: int) -> int:
    """The largest collective (its full tensor) a window of window_nbytes takes."""
    return window_nbytes // window_bytes(1, peers)


def pad_slots(peers: int) -> int:
    """int32 slots of a signal pad that the collectives use: the barriers', then the flags."""
    return 2 * MAX_PROGRAMS * peers
