"""Programmatic dependent launch (PDL) for the small kernels of a decode step (sm90+).

A batch-1 decode step is some 540 kernels of a few microseconds each. Launched the plain way,
each one starts only after the one before it has finished and flushed its memory, so every
boundary costs a launch latency plus the new grid's ramp-up. With PDL (`launch_pdl=True`)
the next kernel may start while this one runs: its programs are placed as soon as every
program of this kernel has passed `gdc_launch_dependents`, and they hold at `gdc_wait` until
this kernel has finished and its writes are visible. The launch and the ramp-up of the next
kernel then hide behind the tail of this one. Inside a CUDA graph the launch attribute becomes
a programmatic edge, so graphs keep the overlap.

The contract every kernel launched with `pdl_args` keeps: `pdl_gate(PDL)` comes before any
store and before any load of what the kernel just before it may have written, on every path
through the kernel. Then no kernel can finish before the one before it has, so a kernel that
waits on its predecessor also waits, transitively, on everything launched before.

Before the gate a kernel may read what no kernel of the chain writes (weights), and what was
written two kernels back or earlier: the kernel before it passed its own gate, so that writer
had finished, before this kernel could be placed. Such reads go through L2
(`cache_modifier=".cg"`), never a stale L1 line. The weight GEMVs load their first weight
tiles there, so that the weight stream starts while the kernel before them finishes.

`pdl_gate(PDL, EARLY=True)` lets the next kernel be placed before this one waits: that next
kernel may then run ahead of this one's predecessor too, so it must read nothing but weights
before its gate, and this kernel nothing at all before its own. Only the decode attention's kernels
take it, at batch 1 (attention_tiles.EARLY_PLACE_MAX_BATCH): their next kernels are the
combine (which reads nothing before its gate) and the output projection (its weights).

`--disable-pdl` turns it off (kernels/launch/choice.py records the choice per device); it is also
off on CPUs, under Triton's interpreter and on GPUs below compute capability 9.0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.launch.choice import kernels_for


_ON = {"PDL": True, "launch_pdl": True}
_OFF = {"PDL": False}


def pdl_args(device: torch.device) -> dict:
    """Launch keyword arguments (spread them, do not change them): the kernel's PDL
    constexpr, and Triton's launch flag when this device's kernel set has PDL on."""
    return _ON if device.type == "cuda" and kernels_for(device).pdl else _OFF


@triton.jit
def pdl_gate(PDL: tl.constexpr, EARLY: tl.constexpr = False):
    """Wait for the kernel before this one, then let the next one be placed. EARLY: the two
    steps the other way round (the contract above says which kernels may)."""
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        else:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
