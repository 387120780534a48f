"""Where an eager prefill's time goes: the host's launch against the device's work, for one
request of N new tokens (--model, by default the Qwen3-30B-A3B shape; dummy bf16 weights, one
GPU).

    PYTHONPATH=src python benchmarks/prefill_host.py --out DIR [--tokens 256 4096]

For each size: the host time of the model's forward call (its launches, and every wait for
the device inside it), the device time of the same forward (CUDA events; also its first call)
and its kernels by device time, the same two for a replay of the prefill graphs
(runtime/prefill_graph.py) where a captured size holds it, and the eager forward
under torch.profiler: the CUDA runtime calls that make the host wait for the device
(synchronisations, copies to the host) with their counts per forward, the host ops that
take the most time, and the Python functions that do (cProfile).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

FIRST: list[float] = []  # device ms of each timed() series' first call
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cudaMemcpy", "cudaMemcpyAsync")


def prefill(runner: Any, n: int) -> Any:
    """One prefill of a request of n tokens in the dummy request's row, its K/V in slots
    [1, n] (the engine serves nothing meanwhile; distinct slots, so that the attention reads
    each token's own K/V and two forwards of it give the same logits)."""
    from moeserve.parallel.step import step_from_counts
    from moeserve.runtime.forward_batch import ForwardBatch, ForwardMode
    from moeserve.runtime.kv_cache import DUMMY_REQ_ROW, DUMMY_SLOT

    table = runner.req_pool.table
    loc = torch.arange(DUMMY_SLOT + 1, DUMMY_SLOT + 1 + n, dtype=torch.int64,
                       device=runner.device)
    table[DUMMY_REQ_ROW, :n] = loc.to(table.dtype)
    ids = torch.randint(0, runner.spec.vocab_size, (n,)).tolist()
    fb = ForwardBatch.from_requests(ForwardMode.EXTEND, [ids], [0], [DUMMY_REQ_ROW], loc, table,
                                    runner.kv_pool)
    step = step_from_counts([n] * runner.plan.layout.tp, runner.plan.layout, 0, runner.plan)
    return fb, step


def timed(forward: Any, reps: int) -> tuple[float, float, torch.Tensor]:
    """(host ms, device ms, output): medians over `reps` calls after 2 warm-up calls; host =
    the call, device = CUDA events around it. The first call's device ms goes to FIRST."""
    host, device = [], []
    for i in range(reps + 2):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        out = forward()
        b.record()
        t1 = time.perf_counter()
        b.synchronize()
        if i == 0:
            FIRST.append(a.elapsed_time(b))
        if i >= 2:
            host.append((t1 - t0) * 1e3)
            device.append(a.elapsed_time(b))
    return statistics.median(host), statistics.median(device), out


def replay_times(runner: Any, fb: Any, n: int, reps: int, eager: torch.Tensor
                 ) -> dict[str, Any]:
    """The same forward through the prefill graphs (runtime/prefill_graph.py): host and
    device ms of a replay of the smallest captured size >= n, when there is one, and how far
    its logits are from the eager forward's (`eager`)."""
    graphs = runner.prefill_graphs
    size = None if graphs is None else graphs.size_for([n])
    if size is None:
        return {}
    host, device, logits = timed(lambda: graphs.replay(fb, size), reps)
    return {"graph_size": size, "graph_host_ms": host, "graph_device_ms": device,
            "graph_pool_MiB": graphs.pool_bytes / 2 ** 20,
            "graph_vs_eager_max_abs_logit_diff": float((logits - eager).abs().max()),
            "eager_max_abs_logit": float(eager.abs().max()),
            "graph_same_argmax": bool(torch.equal(logits.argmax(-1), eager.argmax(-1)))}


def experts_touched(runner: Any, fb: Any, step: Any) -> float:
    """Distinct experts the forward's tokens are routed to, mean over the MoE layers (the
    dummy weights' routing; the device time follows the expert bytes read)."""
    from moeserve.moe.router import Router

    counts: list[int] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: counts.append(
        int(out[0].unique().numel()))) for m in runner.model.modules() if isinstance(m, Router)]
    try:
        runner.model(fb.input_ids, fb.positions, fb, step)
    finally:
        for h in hooks:
            h.remove()
    return statistics.mean(counts) if counts else 0.0


@torch.inference_mode()
def measure(runner: Any, n: int, reps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    fb, step = prefill(runner, n)
    host, device, eager = timed(lambda: runner.model(fb.input_ids, fb.positions, fb, step), reps)
    first = FIRST[-1]  # a length this process has not run before (the startup aside)
    graph = replay_times(runner, fb, n, reps, eager)
    touched = experts_touched(runner, fb, step)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.model(fb.input_ids, fb.positions, fb, step)
        torch.cuda.synchronize()
    import cProfile
    import pstats

    cpu = cProfile.Profile()
    cpu.enable()
    runner.model(fb.input_ids, fb.positions, fb, step)
    cpu.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(cpu).sort_stats("tottime")
    python_top = [{"function": f"{Path(f).name}:{line}:{name}", "calls": nc,
                   "tottime_ms": tt * 1e3, "cumtime_ms": ct * 1e3}
                  for (f, line, name), (_, nc, tt, ct, _) in
                  sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]]
    events = prof.key_averages()
    waits = {e.key: {"calls": e.count, "ms": e.cpu_time_total / 1e3}
             for e in events if e.key in WAITS}
    ops = sorted((e for e in events if e.key.startswith(("aten::", "moeserve", "triton"))
                  or "Kernel" in e.key), key=lambda e: -e.self_cpu_time_total)[:15]
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: -e.self_device_time_total)[:12]
    return {"tokens": n, "host_ms": host, "first_call_device_ms": first,
            "top_kernels": [{"kernel": e.key[:80], "calls": e.count,
                             "device_ms": e.self_device_time_total / 1e3} for e in kernels],
            "device_ms": device, **graph,
            "experts_touched_per_layer": touched, "waits": waits,
            "top_host_ops": [{"op": e.key[:80], "calls": e.count,
                              "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in ops],
            "python_top": python_top}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="prefill_out")
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--model", default="preset:qwen3-30b-a3b")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--extend-tiles", type=int, nargs=4, metavar=("BM", "BN", "WARPS", "STAGES"),
                   help="the extend attention kernel's tiles (default: the shipped ones)")
    p.add_argument("--no-extend-split", action="store_true",
                   help="mask every key block of the extend kernel (the kernel before session 8)")
    p.add_argument("--sdpa-min-extend", type=int,
                   help="fresh prompts of at least this many tokens go through SDPA "
                        "(default: the shipped threshold; a huge value: never)")
    p.add_argument("--mla-sdpa-min-extend", type=int,
                   help="the same for latent attention (DeepSeek)")
    args = p.parse_args()
    from moeserve.layers import attention_tiles

    if args.extend_tiles:
        attention_tiles.EXTEND_TILES = ((1 << 62, tuple(args.extend_tiles)),)
    if args.no_extend_split:
        attention_tiles.EXTEND_SPLIT = False
    if args.sdpa_min_extend is not None:
        attention_tiles.SDPA_MIN_EXTEND = args.sdpa_min_extend
    if args.mla_sdpa_min_extend is not None:
        attention_tiles.MLA_SDPA_MIN_EXTEND = args.mla_sdpa_min_extend
    print(f"extend attention: tiles {attention_tiles.EXTEND_TILES}, "
          f"split {attention_tiles.EXTEND_SPLIT}, SDPA from "
          f"{attention_tiles.SDPA_MIN_EXTEND} tokens (latent attention: "
          f"{attention_tiles.MLA_SDPA_MIN_EXTEND})", flush=True)
    from moeserve.runtime.engine import Engine

    engine = Engine(args.model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                    context_length=max(args.tokens) + 64, max_running_requests=8,
                    chunked_prefill_size=max(args.tokens))
    runner = engine._thread._args[0].runner
    results = [measure(runner, n, args.reps) for n in args.tokens]
    engine.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_host.json").write_text(json.dumps(results, indent=1))
    for r in results:
        if "graph_size" in r:
            print(f"prefill of {r['tokens']} tokens through the prefill graphs of "
                  f"{r['graph_size']}: host {r['graph_host_ms']:.2f} ms, device "
                  f"{r['graph_device_ms']:.2f} ms (graph pool {r['graph_pool_MiB']:.0f} MiB); "
                  f"logits against eager: max |diff| "
                  f"{r['graph_vs_eager_max_abs_logit_diff']:.3g} of max |logit| "
                  f"{r['eager_max_abs_logit']:.3g}, same argmax: {r['graph_same_argmax']}")
        print(f"prefill of {r['tokens']} tokens, eager: host {r['host_ms']:.2f} ms, device "
              f"{r['device_ms']:.2f} ms (first call {r['first_call_device_ms']:.2f}); experts "
              f"touched per layer {r['experts_touched_per_layer']:.1f}; waits: " + ", ".join(
                  f"{k} x{v['calls']} ({v['ms']:.2f} ms)" for k, v in r["waits"].items()))
        print("  kernels by device time (one eager forward, under the profiler):")
        for o in r["top_kernels"]:
            print(f"  {o['kernel']}: {o['calls']} calls, {o['device_ms']:.2f} ms")
        for o in r["top_host_ops"]:
            print(f"  {o['op']}: {o['calls']} calls, {o['self_cpu_ms']:.2f} ms self")
        print("  Python functions by own time under cProfile (which slows each call):")
        for o in r["python_top"]:
            print(f"  {o['function']}: {o['calls']} calls, {o['tottime_ms']:.2f} ms own, "
                  f"{o['cumtime_ms']:.2f} ms with callees")
    return 0


if __name__ == "__main__":
    sys.exit(main())
