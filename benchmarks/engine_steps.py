"""Steps of a running Engine's model runner, timed on the device: the decode step (graph replay
with its input copies, or eager), the decode graph replayed back to back, one prefill, and the
bytes a decode step must read (its floor). Shared by e2e.py and mla.py."""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace
from typing import Any, Optional

import torch

from moeserve.parallel.layout import ParallelLayout

ONE_GPU = ParallelLayout(tp=1, dp=1, ep=1, dense_tp=1, a2a=False)


def engine_runner(engine: Any) -> Any:
    """The model runner of an in-process (tp = 1) Engine. Its loop idles between requests,
    so a benchmark may drive the runner directly while no request is in flight."""
    thread = engine._thread
    if thread is None:
        raise RuntimeError("the runner is reachable only in an in-process engine (tp_size 1)")
    return thread._args[0].runner


def randomize_kv(pool: Any) -> None:
    """Random cached K/V (or latent rows): the timings never read zeros."""
    storage = pool.kv_LSW if hasattr(pool, "kv_LSW") else pool.kv_LSKD
    storage.normal_(0, 0.5)


def decode_bytes(spec: Any, batch: int, ctx: int, dtype: str = "bfloat16",
                 quant: Optional[Any] = None) -> dict[str, float]:
    """Bytes one decode step of `batch` requests with `ctx` cached tokens each must read: the
    dense weights (every weight but the routed experts and the embedding table, of which the
    batch's rows), the experts touched under uniform routing, E (1 - (1 - k/E)^B) per MoE
    layer, and the KV cache. The weights count as the planner stores them on one GPU
    (plan.memory.weight_bytes_per_rank): in `dtype`, or with `quant` (a QuantSpec) the
    matrices it converts in fp8, a byte a value and a float32 scale a block; KV in `dtype`."""
    from moeserve.plan.memory import (DTYPE_BYTES, kv_elems_per_token_per_layer,
                                      weight_bytes_per_rank)

    elem, h, e = DTYPE_BYTES[dtype], spec.hidden_size, spec.num_experts
    touched = e * (1 - (1 - spec.top_k / e) ** batch)
    one_expert = expert_bytes(spec, dtype, quant)
    table = 0 if spec.tie_word_embeddings else spec.vocab_size * h * elem  # the LM head's else
    dense = (weight_bytes_per_rank(spec, ONE_GPU, dtype, quant) - e * one_expert - table
             + batch * h * elem)
    experts = touched * one_expert
    kv = (batch * ctx * spec.num_layers * kv_elems_per_token_per_layer(spec, ONE_GPU) * elem)
    return {"dense": dense, "experts": experts, "kv": kv, "total": dense + experts + kv,
            "touched_experts_per_layer": touched}


def expert_bytes(spec: Any, dtype: str, quant: Optional[Any] = None) -> int:
    """Bytes of one routed expert's weights over all MoE layers, as the planner stores them:
    3 H I values in `dtype` a layer, or in the layers where `quant` converts the experts (the
    planner's fp8 matrices with one matrix per expert, plan.memory._fp8_matrices) a byte a
    value and a float32 scale per block_n x block_k block."""
    from moeserve.plan.memory import DTYPE_BYTES, _fp8_matrices

    elem = DTYPE_BYTES[dtype]
    total = 3 * spec.hidden_size * spec.moe_intermediate_size * len(spec.moe_layers) * elem
    for count, n, k in _fp8_matrices(spec, ONE_GPU, quant) if quant is not None else ():
        if count == spec.num_experts:  # the others are one matrix each
            scales = -(-n // quant.block_n) * -(-k // quant.block_k) * 4
            total -= n * k * elem - (n * k + scales)
    return total


class DecodeBatch:
    """`batch` requests of `ctx` cached tokens each, held in the runner's pools for as long as
    the context is open (their rows and slots are given back on exit)."""

    def __init__(self, runner: Any, batch: int, ctx: int) -> None:
        self.runner, self.batch, self.ctx = runner, batch, ctx

    def __enter__(self) -> "DecodeBatch":
        from moeserve.batch.forward_batch import ForwardMode
        from moeserve.batch.step import step_from_counts
        from moeserve.runtime.scheduler import ScheduledBatch

        r, b = self.runner, self.batch
        self.rows = [r.req_pool.alloc() for _ in range(b)]
        self.slots = [r.kv_pool.alloc(self.ctx + 1) for _ in self.rows]
        if None in self.rows or any(s is None for s in self.slots):
            raise RuntimeError(f"the KV cache cannot hold {b} x {self.ctx + 1} tokens")
        for row, s in zip(self.rows, self.slots):
            r.req_pool.write(row, 0, s)
        gen = torch.Generator().manual_seed(b)
        ids = torch.randint(0, r.spec.vocab_size, (b,), generator=gen).tolist()
        loc = torch.stack([s[-1] for s in self.slots])
        self.sched = ScheduledBatch(ForwardMode.DECODE, [SimpleNamespace(row=x) for x in self.rows],
                                    [[i] for i in ids], [self.ctx] * b, loc, [True] * b,
                                    list(self.rows))
        lay = r.plan.layout
        self.step = step_from_counts([b] * lay.tp, lay, 0, r.plan)
        return self

    def __exit__(self, *exc: Any) -> None:
        for row, s in zip(self.rows, self.slots):
            self.runner.kv_pool.free(s)
            self.runner.req_pool.free(row)


def decode_ms(runner: Any, batch: int, ctx: int, graphs: bool, steps: int,
              touched: Optional[list[int]] = None, warmup: int = 5) -> float:
    """Median ms of one decode step (CUDA events around the runner's forward: the graph replay
    with its input copies, or with graphs=False an eager step that takes neither the decode
    nor the prefill graphs). `touched` (eager) gets each MoE layer's distinct experts of the
    first step: the dummy weights' routing, which uniform routing may not match."""
    from moeserve.moe.router import Router

    times, hooks, pieces = [], [], runner.prefill_graphs
    with DecodeBatch(runner, batch, ctx) as db:
        if not graphs:
            runner.prefill_graphs = None  # their pieces would take an eager decode step
            if touched is not None:
                hooks = [m.register_forward_hook(lambda _m, _i, out: touched.append(
                    int(out[0].unique().numel()))) for m in runner.model.modules()
                    if isinstance(m, Router)]
        try:
            for i in range(steps + warmup):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                runner.forward(db.sched, db.step, all_decode=graphs)
                b.record()
                b.synchronize()
                for h in hooks:  # the first step's routing only
                    h.remove()
                hooks = []
                if i >= warmup:
                    times.append(a.elapsed_time(b))
        finally:
            runner.prefill_graphs = pieces
            for h in hooks:
                h.remove()
    return statistics.median(times)


def replay_ms(runner: Any, batch: int, ctx: int, reps: int = 30) -> Optional[float]:
    """The decode graph of `batch` replayed back to back, inputs as the last step left them:
    the device's time for a step when the host is ahead of it (None without decode graphs)."""
    if runner.graphs is None:
        return None
    with DecodeBatch(runner, batch, ctx) as db:
        runner.forward(db.sched, db.step, all_decode=True)
        graph = runner.graphs.graphs[runner.graphs.bucket_for([batch], True)]
        graph.replay()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        b.synchronize()
    return a.elapsed_time(b) / reps


def kernel_profile(runner: Any, ctx: int, batch: int = 1, top: int = 12) -> dict[str, Any]:
    """Kernels of one graph decode step of `batch` rows under torch.profiler: launches, the
    device's busy time and the kernels' spans summed per step (under PDL the spans overlap:
    step_profile.exclusive_times), the largest by exclusive time."""
    from torch.profiler import ProfilerActivity, profile

    from moeserve.runtime.step_profile import exclusive_times, kernel_spans

    decode_ms(runner, batch, ctx, True, 2)  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_ms(runner, batch, ctx, True, 1)
    times = exclusive_times(kernel_spans(prof.events()))
    steps = 6  # decode_ms ran 5 warm-up steps and 1 timed
    largest = sorted(times.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernels_per_step": sum(t[2] for t in times.values()) / steps,
            "busy_ms_per_step": sum(t[0] for t in times.values()) / steps / 1e3,
            "kernel_ms_per_step": sum(t[1] for t in times.values()) / steps / 1e3,
            "top": [{"name": n[:90], "ms": t[0] / steps / 1e3, "span_ms": t[1] / steps / 1e3,
                     "calls": int(t[2]) // steps} for n, t in largest]}


@torch.inference_mode()
def prefill_ms(runner: Any, n: int, reps: int = 5) -> dict[str, Any]:
    """One request of n new tokens in the dummy request's row (its K/V in slots 1..n; the
    engine serves nothing meanwhile): host ms of the model call and device ms (CUDA events),
    medians after 2 warm-up calls, eagerly and through the prefill graphs where a captured
    size holds it."""
    from moeserve.batch.forward_batch import ForwardBatch, ForwardMode
    from moeserve.batch.kv_cache import DUMMY_REQ_ROW, DUMMY_SLOT
    from moeserve.batch.step import step_from_counts

    table = runner.req_pool.table
    loc = torch.arange(DUMMY_SLOT + 1, DUMMY_SLOT + 1 + n, dtype=torch.int64,
                       device=runner.device)
    table[DUMMY_REQ_ROW, :n] = loc.to(table.dtype)
    ids = torch.randint(0, runner.spec.vocab_size, (n,)).tolist()
    fb = ForwardBatch.from_requests(ForwardMode.EXTEND, [ids], [0], [DUMMY_REQ_ROW], loc, table,
                                    runner.kv_pool)
    step = step_from_counts([n] * runner.plan.layout.tp, runner.plan.layout, 0, runner.plan)

    def timed(forward: Any) -> tuple[float, float]:
        host, device = [], []
        for i in range(reps + 2):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            forward()
            b.record()
            t1 = time.perf_counter()
            b.synchronize()
            if i >= 2:
                host.append((t1 - t0) * 1e3)
                device.append(a.elapsed_time(b))
        return statistics.median(host), statistics.median(device)

    out: dict[str, Any] = {"tokens": n}
    out["eager_host_ms"], out["eager_ms"] = timed(
        lambda: runner.model(fb.input_ids, fb.positions, fb, step))
    graphs = runner.prefill_graphs
    size = None if graphs is None else graphs.size_for([n])
    if size is not None:
        out["graph_size"] = size
        out["graph_host_ms"], out["graph_ms"] = timed(lambda: graphs.replay(fb, size))
    return out
