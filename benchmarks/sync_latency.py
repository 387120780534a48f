"""What one dependency costs on this GPU, by each way a decode step could wait on the work
before it, and how fast HBM streams when it is only read: the numbers behind the batch-1 step's
floor (a layer is a chain of dependent steps, each waiting on the one before).

    PYTHONPATH=src python benchmarks/sync_latency.py [--out DIR]

- read: a Triton kernel that only reads (and sums) 2 GiB, against torch's 1 GiB copy (read +
  write), the ceiling bench_e2e.py divides by.
- l2 round trip: one program chasing a chain of dependent loads through L2 (`.cg`).
- kernel boundary: a CUDA graph of C kernels of G programs, each reading what the kernel before
  wrote, with programmatic dependent launch (layers/pdl.py) and without; per kernel.
- grid barrier: one persistent kernel of one program per SM, B steps: one program writes a
  value, every program arrives on a counter (a release atomic), polls it until all have, and
  reads the value; per step.
- flag handoff: the same kernel where the step's program writes and raises a flag (no
  counter), and the next step's program waits for it: one producer to every program, the
  cheapest dependency a persistent step could have; per step.

Times are medians of repeated CUDA-graph replays (or launches of the persistent kernel), with
the zero-step variant subtracted, so launch costs drop out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.language as tl

from moeserve.layers.pdl import pdl_args, pdl_gate


@triton.jit
def _read_kernel(X, Out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = pid * BLOCK + i * step + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(Out + pid, tl.sum(acc, 0))


@triton.jit
def _chase_kernel(Next, Out, steps):
    i = tl.full([], 0, tl.int32)
    for _ in range(steps):
        i = tl.load(Next + i, cache_modifier=".cg")
    tl.store(Out, i)


@triton.jit
def _link_kernel(X, i, PDL: tl.constexpr):
    pdl_gate(PDL)
    v = tl.load(X + i - 1, cache_modifier=".cg")
    if tl.program_id(0) == 0:
        tl.store(X + i, v + 1)


@triton.jit
def _barrier_kernel(Counter, Data, Out, steps, FLAG: tl.constexpr):
    """Step b: program b % G writes Data[b]; then every program waits (FLAG: for that
    program's flag; else: for all G programs' arrivals on the counter) and reads it. Each
    step's producer has waited on the step before, so the steps form one dependent chain."""
    pid = tl.program_id(0)
    g = tl.num_programs(0)
    acc = tl.full([], 0, tl.int32)
    for b in range(steps):
        if FLAG:
            if pid == b % g:
                tl.store(Data + b, b + 1)
                tl.debug_barrier()
                tl.atomic_xchg(Counter, b + 1, sem="release", scope="gpu")
            target = b + 1
        else:
            if pid == b % g:
                tl.store(Data + b, b + 1)
            tl.debug_barrier()
            tl.atomic_add(Counter, 1, sem="release", scope="gpu")
            target = g * (b + 1)
        c = tl.load(Counter, volatile=True)
        while c < target:
            c = tl.load(Counter, volatile=True)
        tl.atomic_add(Counter, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        acc += tl.load(Data + b, cache_modifier=".cg")
    tl.store(Out + pid, acc)


def median_ms(fn: Callable[[], None], reps: int = 20, inner: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def read_rates(dev: torch.device) -> dict[str, float]:
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device=dev)  # 2 GiB
    best = 0.0
    for per_sm, block in ((4, 4096), (8, 2048), (8, 4096), (16, 2048)):
        grid = per_sm * sms
        iters = triton.cdiv(x.numel(), grid * block)
        out = torch.empty(grid, device=dev)
        ms = median_ms(lambda: _read_kernel[(grid,)](x, out, x.numel(), BLOCK=block,
                                                     ITERS=iters, num_warps=8), 5, 3)
        best = max(best, x.numel() * 2 / ms / 1e6)
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), 5, 3)
    return {"read_GBps": best, "copy_GBps": 2 * src.numel() * 2 / copy_ms / 1e6}


def l2_round_trip_us(dev: torch.device, steps: int = 2000) -> float:
    n = 1 << 16  # 256 KB of int32: stays in L2
    perm = torch.randperm(n, device=dev).to(torch.int32)
    nxt = torch.empty_like(perm)
    nxt[perm] = torch.roll(perm, -1)  # one cycle through every entry, in random order
    out = torch.empty(1, dtype=torch.int32, device=dev)
    full = median_ms(lambda: _chase_kernel[(1,)](nxt, out, steps, num_warps=1))
    none = median_ms(lambda: _chase_kernel[(1,)](nxt, out, 0, num_warps=1))
    return (full - none) * 1e3 / steps


def boundary_us(dev: torch.device, grid: int, pdl: bool, chain: int = 64) -> float:
    x = torch.zeros(chain + 1, dtype=torch.int32, device=dev)
    args = pdl_args(dev) if pdl else {"PDL": False}

    def graph_of(n: int) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream):
            for i in range(1, n + 1):  # compile outside the capture
                _link_kernel[(grid,)](x, i, num_warps=4, **args)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for i in range(1, n + 1):
                _link_kernel[(grid,)](x, i, num_warps=4, **args)
        return g

    long, short = graph_of(chain), graph_of(1)
    return (median_ms(long.replay) - median_ms(short.replay)) * 1e3 / (chain - 1)


def barrier_us(dev: torch.device, flag: bool, steps: int = 200) -> float:
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    data = torch.zeros(steps, dtype=torch.int32, device=dev)
    out = torch.empty(sms, dtype=torch.int32, device=dev)

    def run(n: int) -> Callable[[], None]:
        def go() -> None:
            counter.zero_()
            _barrier_kernel[(sms,)](counter, data, out, n, FLAG=flag, num_warps=4)
        return go

    run(steps)()
    want = steps * (steps + 1) // 2
    assert out.eq(want).all(), f"a program read early: {out.tolist()[:8]}, expected {want}"
    full, none = median_ms(run(steps)), median_ms(run(0))
    return (full - none) * 1e3 / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    res: dict = {"device": torch.cuda.get_device_name(dev), "sms": sms, **read_rates(dev),
                 "l2_round_trip_us": l2_round_trip_us(dev)}
    for grid in (1, sms, 4 * sms):
        for pdl in (False, True):
            res[f"boundary_us_grid{grid}_pdl{int(pdl)}"] = boundary_us(dev, grid, pdl)
    res["grid_barrier_us"] = barrier_us(dev, flag=False)
    res["flag_handoff_us"] = barrier_us(dev, flag=True)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sync_latency.json").write_text(text)


if __name__ == "__main__":
    main()
