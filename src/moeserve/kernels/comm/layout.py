"""The one-shot collectives' window and signal-pad layout (kernels/comm/one_shot.py and
kernels/comm/lamport.py say why), without Triton: the plan sizes the windows by it
(plan/buffers.comm_records), the collectives read their largest tensor back from a window's
bytes (parallel/symm_comm.py).

A window of a collective size `max` over P ranks holds two regions of 2 P max bytes each:
the pushing region (bytes [0, 2 P max): two halves of P slots, which the pushing collectives
alternate between and the reduce-scatter stages in), then the Lamport region (two halves of P
slots that hold the 16-bit sentinel wherever no call's data is in flight: the all-reduce +
RMSNorm of 16-bit rows, whose data is its own flag)."""

from __future__ import annotations

MAX_PROGRAMS = 32  # below the SM count of every GPU this runs on: all programs resident at once
LAMPORT_SENTINEL = -32768  # int16 bits 0x8000: -0.0 in float16 and bfloat16


def window_bytes(max_bytes: int, peers: int) -> int:
    """A window's bytes for collectives of up to max_bytes over `peers` ranks: the pushing
    region and the Lamport region, each two halves of `peers` slots (the all-reduce pushes its
    whole tensor into a slot of every rank)."""
    return 4 * peers * max_bytes


def max_collective_bytes(window_nbytes: int, peers: int) -> int:
    """The largest collective (its full tensor) a window of window_nbytes takes."""
    return window_nbytes // window_bytes(1, peers)


def region_bytes(window_nbytes: int) -> int:
    """The bytes of each region: the pushing one starts the window, the Lamport one follows."""
    assert window_nbytes % 2 == 0, window_nbytes
    return window_nbytes // 2


def pad_slots(peers: int) -> int:
    """int32 slots of a signal pad that the collectives use: the barriers', then the flags."""
    return 2 * MAX_PROGRAMS * peers
