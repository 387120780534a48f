"""Helpers shared by bench_moe.py and tune_moe.py: model shapes, timing, the device ceilings."""

from __future__ import annotations

import statistics
from typing import Callable

import torch

from moeserve.models.presets import PRESETS
from moeserve.models.spec import ModelSpec, spec_from_hf_config

MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite")
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def model_spec(name: str) -> ModelSpec:
    return spec_from_hf_config(dict(PRESETS[name]), name=name)


def time_us(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median of `reps` timings of fn() with CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def capture(fn: Callable[[], object]) -> Callable[[], None]:
    """A CUDA graph of fn() (warmed up on a side stream first); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def ceilings() -> dict[str, float]:
    """Copy bandwidth (1 GiB device-to-device, read + write counted) and bf16 matmul rate
    (8192^3), on random data."""
    def copy_us() -> float:  # its 2 GiB are freed on return, before the matmul's operands
        src = torch.randn(2 ** 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
        dst = torch.empty_like(src)
        return time_us(lambda: dst.copy_(src), reps=30)

    def mm_us() -> float:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        return time_us(lambda: a @ b, reps=30)

    return {"copy_GBps": 2 * 2 ** 30 / copy_us() / 1e3,
            "bf16_TFLOPs": 2 * 8192 ** 3 / mm_us() / 1e6}


def kernel_us(fn: Callable[[], object], calls: int = 3) -> list[tuple[str, float]]:
    """Device µs per call of each kernel that fn() launches (eagerly), under torch.profiler,
    largest first: where a layer's time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            name = ev.name[:60]
            totals[name] = totals.get(name, 0.0) + ev.device_time / calls
    return sorted(totals.items(), key=lambda t: -t[1])
