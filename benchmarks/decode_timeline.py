"""Where a decode step's time goes: the kernels of one CUDA-graph decode step (--model, by
default the Qwen3-30B-A3B shape; dummy bf16 weights, one GPU) in the order they ran, under
torch.profiler, grouped by kernel name: launches per step, mean duration, and the mean gap
between the end of the kernel before and its start (the time no kernel of the step ran).

    PYTHONPATH=src python benchmarks/decode_timeline.py --out DIR [--batch 1] [--ctx 512] \
        [--more-batches 8 64 256]

Each PDL setting runs in its own process (the decode graphs are captured at startup): with
MOESERVE_PDL=0 every kernel starts after the one before has finished, so durations and gaps
add up to the step; with PDL on, a kernel's duration includes the time its programs wait at
their gate for the kernel before, and gaps can be negative (the overlap PDL buys).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def timeline(model: str, batch: int, ctx: int, more: list[int]) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from bench_e2e import decode_timing, randomize_kv
    from moeserve.runtime.engine import Engine

    engine = Engine(model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                    context_length=ctx + 64, max_running_requests=max(batch, 8, *more))
    runner = engine._thread._args[0].runner
    randomize_kv(runner.kv_pool)
    step_ms = decode_timing(runner, batch, ctx, True, 30)
    replay_ms = replay_only_ms(runner, batch, ctx)
    host = host_us(runner, batch, ctx)
    others = {b: {"step_ms": decode_timing(runner, b, ctx, True, 30),
                  "replay_ms": replay_only_ms(runner, b, ctx)} for b in more}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_timing(runner, batch, ctx, True, 1)  # 5 warm-up steps + 1, all profiled
    engine.shutdown()

    kernels = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                     if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0)
    # 6 steps, each the same graph replay, and a few one-off kernels: the last step is the
    # latest run of about len // 6 kernels whose names repeat the run just before it (searched
    # from 1.3x that down to half: below a second step, above a layer's run of kernels)
    names = [k[2] for k in kernels]
    guess = len(kernels) // 6
    end, per = next((e, p) for e in range(len(names), 0, -1)
                    for p in range(guess * 13 // 10, max(0, guess // 2), -1)
                    if e >= 2 * p and names[e - p:e] == names[e - 2 * p:e - p])
    last = kernels[end - per:end]
    by_name: dict[str, dict[str, float]] = {}
    prev_end = last[0][0]
    for start, end, name in last:
        row = by_name.setdefault(name[:70], {"calls": 0, "us": 0.0, "gap_us": 0.0})
        row["calls"] += 1
        row["us"] += end - start
        row["gap_us"] += start - prev_end
        prev_end = max(prev_end, end)
    t0 = last[0][0]
    order = [(name[:50], round(s - t0, 2), round(e - s, 2)) for s, e, name in last]
    return {"batch": batch, "ctx": ctx, "step_ms": step_ms, "replay_ms": replay_ms, **host,
            "kernels": len(last), "span_us": last[-1][1] - t0, "other_batches": others,
            "head": order[:14], "tail": order[-6:],
            "by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1]["us"]))}


def host_us(runner: Any, batch: int, ctx: int, reps: int = 30) -> dict[str, float]:
    """Host time (µs, median) of one decode graph launch alone, and of the runner's whole
    decode forward (input staging + launch), each followed by a synchronize outside the timed
    region: the time the GPU waits for the host before a step can start."""
    import time
    from types import SimpleNamespace

    from moeserve.parallel.step import step_from_counts
    from moeserve.runtime.forward_batch import ForwardMode
    from moeserve.runtime.scheduler import ScheduledBatch

    graph = runner.graphs.graphs[runner.graphs.bucket_for([batch], True)]
    rows = [runner.req_pool.alloc() for _ in range(batch)]
    slots = [runner.kv_pool.alloc(ctx + 1) for _ in rows]
    for r, sl in zip(rows, slots):
        runner.req_pool.write(r, 0, sl)
    sched = ScheduledBatch(ForwardMode.DECODE, [SimpleNamespace(row=r) for r in rows],
                           [[1]] * batch, [ctx] * batch, torch.stack([sl[-1] for sl in slots]),
                           [True] * batch)
    lay = runner.plan.layout
    step = step_from_counts([batch] * lay.tp, lay, 0, runner.plan)
    launch, forward = [], []
    for _ in range(reps):
        t = time.perf_counter()
        graph.replay()
        launch.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner.forward(sched, step, all_decode=True)
        forward.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    for r, sl in zip(rows, slots):
        runner.kv_pool.free(sl)
        runner.req_pool.free(r)
    return {"launch_us": sorted(launch)[reps // 2] * 1e6,
            "forward_us": sorted(forward)[reps // 2] * 1e6}


def replay_only_ms(runner: Any, batch: int, ctx: int, reps: int = 30) -> float:
    """The decode graph of `batch` replayed back to back, its inputs as the last step left
    them: the device's time for a step when the host is ahead of it."""
    graph = runner.graphs.graphs[runner.graphs.bucket_for([batch], True)]
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def table(res: dict[str, Any]) -> str:
    lines = [f"PDL {res['pdl']}, decode attention {res['decode_attention']}: step "
             f"{res['step_ms']:.3f} ms (events around the runner's forward), graph replays "
             f"back to back {res['replay_ms']:.3f} ms; "
             f"{res['kernels']} kernels, first start to last end {res['span_us'] / 1e3:.3f} ms",
             f"host: graph launch {res['launch_us']:.0f} us, whole decode forward "
             f"{res['forward_us']:.0f} us (no synchronisation inside)",
             f"first kernels (name, start us, us): {res['head']}",
             f"last kernels: {res['tail']}",
             *(f"batch {b}: step {r['step_ms']:.3f} ms, graph replays back to back "
               f"{r['replay_ms']:.3f} ms" for b, r in res["other_batches"].items()),
             "| kernel | calls | mean us | sum us | mean gap before us | sum gap us |",
             "|---|---|---|---|---|---|"]
    for name, r in res["by_name"].items():
        c = r["calls"]
        lines.append(f"| `{name}` | {c} | {r['us'] / c:.2f} | {r['us']:.0f} | "
                     f"{r['gap_us'] / c:.2f} | {r['gap_us']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="timeline_out")
    p.add_argument("--model", default="preset:qwen3-30b-a3b")
    p.add_argument("--batch", type=int, default=1, help="the batch profiled")
    p.add_argument("--more-batches", type=int, nargs="*", default=[],
                   help="batches timed too (step and replays), not profiled")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--pdl", nargs="+", default=["0", "1"])
    p.add_argument("--decode-attention", type=int, nargs=4,
                   metavar=("BLOCK_N", "WARPS", "STAGES", "MAX_SPLITS"),
                   help="the decode attention kernel's config (default: the shipped one)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        from moeserve.layers import attention_tiles as TL

        if args.decode_attention:
            TL.DECODE_TILES = ((1 << 62, tuple(args.decode_attention[:3])),)
            TL.MAX_SPLITS = args.decode_attention[3]
        res = timeline(args.model, args.batch, args.ctx, args.more_batches)
        res["decode_attention"] = ([*args.decode_attention] if args.decode_attention
                                   else "shipped")
        res["pdl"] = os.environ.get("MOESERVE_PDL", "1")
        tag = ("-".join(map(str, args.decode_attention)) if args.decode_attention
               else "shipped")
        (out / f"timeline_pdl{res['pdl']}_attn{tag}.json").write_text(json.dumps(res, indent=1))
        print(table(res), flush=True)
        return 0
    for pdl in args.pdl:
        env = dict(os.environ, MOESERVE_PDL=pdl)
        subprocess.check_call([sys.executable, __file__, *sys.argv[1:], "--child"], env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
