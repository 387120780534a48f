r"""The all-to-all of one MoE layer (dispatch + combine) on the GPUs of one host: the nvlink
dispatcher (one-sided stores into symmetric memory) beside the NCCL all_to_all dispatcher and
NCCL's all_to_all_single moving the same padded bytes, all in one run.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        PYTHONPATH=src python -m benchmarks a2a --gpus 2 --out $OUT [--results ...]

Qwen3-30B-A3B's shape (tp = dp = ep = --gpus, DP attention), bf16, uniform random routing, the
experts left out (combine sends back what dispatch delivered). Each rank times every exchange
as CUDA-graph replays (as decode steps run them; eagerly where capture fails, and the row says
so), ten calls back to back per replay, after a barrier, between CUDA events: the median
of 30 replays, per call.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import RunInfo, table

HELP = "the MoE all-to-all against NCCL all_to_all_single (several GPUs)"
MODEL = "preset:qwen3-30b-a3b"
SIZES = (1, 8, 32, 128, 512, 2048, 8192)
RANKS_TIMEOUT_S = 600  # a hung collective fails the run instead of holding the machine
METHOD = """\
Per MoE layer, dispatch + combine on rank 0. Floor = the bytes rank 0 must send to other
ranks (each token once to each other rank that owns one of its experts, counted from the
routing: its payload of hidden state, ids and weights out, its hidden state back) over the
rank's peer-store bandwidth measured in the same run (a graph of row stores of 64 MiB into
the next rank's symmetric window, and a barrier); the synchronisations are not in it. The
baselines: the all_to_all dispatcher, and NCCL's all_to_all_single of [ranks x tokens] rows,
both ways (the padded bytes the all_to_all dispatcher's blocks carry)."""


def add_arguments(p: Any) -> None:
    harness.add_output_arguments(p)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=list(SIZES),
                   help="tokens per rank")


CALLS = 10  # exchanges back to back in one timed graph, as the layers of a step run them


def timed(fn: Any, label: str) -> tuple[float, bool]:
    """(µs per call: the median over 30 replays, each after a barrier, of a graph of CALLS
    calls; whether as a graph replay). The calls in a row amortise the skew with which the
    ranks leave the barrier, which a single call's time would include."""
    import torch.distributed as dist

    def calls() -> None:
        for _ in range(CALLS):
            fn()

    try:
        run, graph = harness.capture(calls), True
    except RuntimeError as err:
        print(f"{label}: no CUDA graph ({err}); timed eagerly", flush=True)
        run, graph = calls, False
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(30):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(samples), graph


def rank_main(rank: int, world: int, port: int, sizes: list[int], out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=world, device_id=torch.device("cuda", rank))
    try:
        rows = exchange_rows(rank, world, sizes)
        Path(out, f"a2a_rank{rank}.json").write_text(json.dumps(rows, indent=1))
    finally:
        dist.destroy_process_group()


BACKENDS = ("nvlink", "all_to_all")


def _dispatchers(world: int, rank: int, sizes: list[int]) -> dict[str, Any]:
    """One MoE dispatcher per backend, each on the buffers of its own plan (bound as the
    engine binds them: the nvlink windows in symmetric memory, rendezvoused here)."""
    from moeserve.config import EngineConfig
    from moeserve.moe.dispatch import create_dispatcher
    from moeserve.parallel.groups import init_parallel_state
    from moeserve.plan.capacity import build_plan
    from moeserve.runtime.buffers import bind_model_buffers

    out, state = {}, None
    for backend in BACKENDS:
        cfg = EngineConfig(model=MODEL, tp_size=world, ep_size=world, dp_size=world,
                           enable_dp_attention=True, moe_a2a_backend=backend,
                           chunked_prefill_size=max(sizes) * world,
                           max_running_requests=256 * world,
                           gpu_memory_gb=torch.cuda.get_device_properties(rank).total_memory
                           / 1e9)
        plan = build_plan(cfg)
        assert plan.ok, plan.errors
        state = state or init_parallel_state(plan.layout, torch.device("cuda", rank))
        disp = create_dispatcher(plan.spec, state, plan, torch.bfloat16)
        disp.bind(bind_model_buffers(plan, torch.device("cuda", rank)))
        out[backend] = (disp, plan)
    return out


def peer_store_GBps(rank: int, world: int) -> float:
    """This rank's one-sided store bandwidth: a graph of stores of 64 MiB into the next
    rank's symmetric window (row copies, as the dispatch kernel makes them) and a barrier."""
    import torch.distributed as dist

    from moeserve.kernels.moe.exchange import push_back
    from moeserve.parallel.groups import Axis
    from moeserve.parallel.symmetric import PeerWindow, symmetric_empty

    rows, h = 8192, 4096  # 64 MiB of bf16 rows
    dev = torch.device("cuda", rank)
    buf = symmetric_empty((world * rows * h,), torch.bfloat16, dev)
    axis = Axis(dist.group.WORLD, rank, world, tuple(range(world)))
    win = PeerWindow.open(buf, axis)
    y = torch.randn(world * rows, h, device=dev, dtype=torch.bfloat16)
    ids = torch.full((world * rows, 1), -1, dtype=torch.int32, device=dev)
    peer = (rank + 1) % world
    ids[peer * rows:(peer + 1) * rows] = 0  # only the next rank's rows are filled

    def store() -> None:
        push_back(y, ids, win.peer_ptrs, rank, world)
        win.barrier()

    us, _ = timed(store, f"rank {rank} peer store")
    return rows * h * 2 / us / 1e3


def exchange_rows(rank: int, world: int, sizes: list[int]) -> list[dict]:
    import torch.distributed as dist

    from moeserve.batch.step import step_from_counts

    torch.cuda.set_device(rank)
    dispatchers = _dispatchers(world, rank, sizes)
    store_GBps = peer_store_GBps(rank, world)
    rows = []
    for m in sizes:
        disp, plan = dispatchers["nvlink"]
        spec, h = plan.spec, plan.spec.hidden_size
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(m, spec.num_experts, device="cuda").topk(spec.top_k, dim=1).indices
        ids = ids.to(torch.int32)
        w = torch.rand(m, spec.top_k, device="cuda", dtype=torch.float32)
        step = step_from_counts([m] * world, plan.layout, rank, plan)
        owner = ids.long() // (spec.num_experts // world)
        goes = torch.zeros(m, world, dtype=torch.bool, device="cuda").scatter_(1, owner, True)
        goes[:, rank] = False
        sent = int(goes.sum())  # (token, other rank) pairs: what must cross a link
        row: dict[str, Any] = {"tokens_per_rank": m, "sent_rows": sent,
                               "link_bytes": sent * (disp.payload + 2 * h),
                               "moved_bytes": world * m * (disp.payload + 2 * h),
                               "peer_store_GBps": store_GBps}
        for backend, (d, _) in dispatchers.items():
            def exchange(d=d) -> torch.Tensor:
                toks, handle = d.dispatch(x, ids, w, step)
                return d.combine(toks.x_NH, handle)

            row[f"{backend}_us"], row[f"{backend}_graph"] = timed(
                exchange, f"rank {rank} m={m} {backend}")
        # the nvlink exchange's two halves (combine replays one dispatch's handle)
        toks, handle = disp.dispatch(x, ids, w, step)
        row["dispatch_us"], _ = timed(lambda: disp.dispatch(x, ids, w, step),
                                      f"rank {rank} m={m} dispatch")
        row["combine_us"], _ = timed(lambda: disp.combine(toks.x_NH, handle),
                                     f"rank {rank} m={m} combine")

        send = torch.randint(0, 255, (world * m * disp.payload,), dtype=torch.uint8,
                             device="cuda")
        back = torch.randint(0, 255, (world * m * h * 2,), dtype=torch.uint8, device="cuda")
        recv, back_r = torch.empty_like(send), torch.empty_like(back)

        def nccl() -> None:
            dist.all_to_all_single(recv, send)
            dist.all_to_all_single(back_r, back)

        row["nccl_us"], row["nccl_graph"] = timed(nccl, f"rank {rank} m={m} nccl")
        rows.append(row)
    return rows


def render(ranks: dict[int, list[dict]]) -> list[str]:
    out = []
    for i, r in enumerate(ranks[0]):
        floor = r["link_bytes"] / r["peer_store_GBps"] / 1e3
        spread = max(abs(ranks[k][i]["nvlink_us"] / r["nvlink_us"] - 1) for k in ranks)
        cells = [r["tokens_per_rank"], r["sent_rows"], f"{floor:.1f}"]
        for key in ("nvlink", "all_to_all", "nccl"):
            eager = "" if r[f"{key}_graph"] else " (eager)"
            cells.append(f"{r[f'{key}_us']:.1f}{eager}")
        cells += [f"{r['dispatch_us']:.1f} + {r['combine_us']:.1f}",
                  f"{r['nvlink_us'] / floor:.2f}" if floor else "-",
                  f"{r['nccl_us'] / r['nvlink_us']:.1f}", f"{100 * spread:.0f}%"]
        out.append(cells)
    return table(["tokens per rank", "rows sent to other ranks", "floor µs", "nvlink µs",
                  "all_to_all (NCCL) µs", "NCCL all_to_all_single, same bytes µs",
                  "nvlink dispatch + combine µs, timed apart", "nvlink x floor", "NCCL same bytes ÷ nvlink",
                  "other ranks' nvlink µs within"], out)


def run(args: Any, argv: list[str]) -> int:
    import torch.multiprocessing as mp

    from moeserve.parallel.net import free_port

    harness.require_gpu(args.gpus)
    info = RunInfo.collect("a2a", argv, gpus=args.gpus)
    ceil = harness.measure_ceilings(peer=True)
    print(ceil.line(), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ranks_ctx = mp.start_processes(rank_main, nprocs=args.gpus, start_method="spawn",
                                   args=(args.gpus, free_port(), args.tokens, str(out)),
                                   join=False)
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    while not ranks_ctx.join(timeout=5):  # raises when a rank failed
        if time.monotonic() > deadline:
            for proc in ranks_ctx.processes:
                proc.kill()
            raise SystemExit(f"the ranks did not finish in {RANKS_TIMEOUT_S} s")
    ranks = {r: json.loads((out / f"a2a_rank{r}.json").read_text()) for r in range(args.gpus)}
    store = ", ".join(f"rank {r} {ranks[r][0]['peer_store_GBps']:.0f}" for r in ranks)
    text = harness.section(f"All-to-all, ep {args.gpus}", METHOD + f"\nPeer-store GB/s: {store}.",
                           info, ceil, render(ranks))
    harness.save(out, "a2a", {"info": info, "ceilings": ceil, "ranks": ranks}, text,
                 args.results)
    for r in range(args.gpus):
        os.remove(out / f"a2a_rank{r}.json")
    return 0
