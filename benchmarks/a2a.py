r"""The all-to-all of one MoE layer (dispatch + combine) on the GPUs of one host: the nvlink
dispatcher (one-sided stores into symmetric memory) beside the NCCL all_to_all dispatcher and
NCCL's all_to_all_single moving the same padded bytes, all in one run.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        PYTHONPATH=src python -m benchmarks a2a --gpus 4 --out $OUT \
        [--models preset:qwen3-30b-a3b preset:deepseek-v3] [--results ...]

Each model's shape (tp = dp = ep = --gpus, DP attention), bf16, uniform random routing over
its experts, the experts left out (combine sends back what dispatch delivered); only the
dispatchers' buffers are bound, never the weights (a2a_plans.py). Each rank times every
exchange as CUDA-graph replays (as decode steps run them; eagerly where capture fails, and the
row says so), ten calls back to back per replay, after a barrier, between CUDA events: the
median of 30 replays, per call. Each model's table comes with each rank's symmetric workspace:
the plan's records beside what the bind allocated.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks import a2a_plans, harness
from benchmarks.harness import RunInfo, table
from moeserve.config.spec import load_model_spec

HELP = "the MoE all-to-all against NCCL all_to_all_single (several GPUs)"
MODEL = "preset:qwen3-30b-a3b"
SIZES = (1, 8, 32, 128, 512, 2048, 8192)
# per model: a hung collective fails the run instead of holding the machine
RANKS_TIMEOUT_S = 600
METHOD = """\
Per MoE layer, dispatch + combine on rank 0. Floor = the bytes rank 0 must send to other
ranks (each token once to each other rank that owns one of its experts, counted from the
routing: its payload of hidden state, ids and weights out, its hidden state back) over the
rank's peer-store bandwidth measured in the same run (a graph of row stores of 64 MiB into
the next rank's symmetric window, and a barrier); the synchronisations are not in it. The
baselines: the all_to_all dispatcher, and NCCL's all_to_all_single of [ranks x tokens] rows,
both ways (the padded bytes the all_to_all dispatcher's blocks carry). The workspace: the
nvlink plan's symmetric records (the windows peers store into) beside the tensors bound for
them, the bind's other tensors, and what the bind took from torch's allocator and from the
device (free memory before and after)."""


def add_arguments(p: Any) -> None:
    harness.add_output_arguments(p)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--models", nargs="+", default=[MODEL], metavar="MODEL",
                   help=f"preset:NAME or checkpoint folders, each its own table (default {MODEL})")
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


def rank_main(rank: int, world: int, port: int, models: list[str], sizes: list[int],
              out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=world, device_id=torch.device("cuda", rank))
    try:
        torch.cuda.set_device(rank)
        result: dict[str, Any] = {"peer_store_GBps": peer_store_GBps(rank, world), "models": {}}
        state = None
        for model in models:
            disps, workspace, state = a2a_plans.dispatchers(model, world, rank, sizes, state)
            result["models"][model] = {"workspace": workspace,
                                       "rows": exchange_rows(rank, world, sizes, disps)}
            del disps  # the next model's bind measures from here
        Path(out, f"a2a_rank{rank}.json").write_text(json.dumps(result, indent=1))
    finally:
        dist.destroy_process_group()


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


def exchange_rows(rank: int, world: int, sizes: list[int], dispatchers: dict[str, Any]
                  ) -> list[dict]:
    """One row per size: every exchange timed on the same routed rows of the model."""
    import torch.distributed as dist

    from moeserve.batch.step import step_from_counts

    rows = []
    disp, plan = dispatchers["nvlink"]
    spec, h = plan.spec, plan.spec.hidden_size
    for m in sizes:
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
                               "moved_bytes": world * m * (disp.payload + 2 * h)}
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


def render(ranks: dict[int, dict], model: str) -> list[str]:
    """The model's subsection: its exchange table, then each rank's symmetric workspace."""
    store = ranks[0]["peer_store_GBps"]
    rows = {k: ranks[k]["models"][model]["rows"] for k in ranks}
    out = []
    for i, r in enumerate(rows[0]):
        floor = r["link_bytes"] / store / 1e3
        spread = max(abs(rows[k][i]["nvlink_us"] / r["nvlink_us"] - 1) for k in rows)
        cells = [r["tokens_per_rank"], r["sent_rows"], f"{floor:.1f}"]
        for key in ("nvlink", "all_to_all", "nccl"):
            eager = "" if r[f"{key}_graph"] else " (eager)"
            cells.append(f"{r[f'{key}_us']:.1f}{eager}")
        cells += [f"{r['dispatch_us']:.1f} + {r['combine_us']:.1f}",
                  f"{r['nvlink_us'] / floor:.2f}" if floor else "-",
                  f"{r['nccl_us'] / r['nvlink_us']:.1f}", f"{100 * spread:.0f}%"]
        out.append(cells)
    spec = load_model_spec(model)
    title = (f"### {model}: {spec.num_experts} experts, top-{spec.top_k}, hidden "
             f"{spec.hidden_size}, {a2a_plans.DTYPE}")
    return [title, "", *table(
        ["tokens per rank", "rows sent to other ranks", "floor µs", "nvlink µs",
         "all_to_all (NCCL) µs", "NCCL all_to_all_single, same bytes µs",
         "nvlink dispatch + combine µs, timed apart", "nvlink x floor",
         "NCCL same bytes ÷ nvlink", "other ranks' nvlink µs within"], out),
        "", *render_workspace(ranks, model), ""]


def render_workspace(ranks: dict[int, dict], model: str) -> list[str]:
    """Per rank: the nvlink plan's symmetric records against what the bind allocated."""
    def mib(n: int) -> str:
        return f"{n / 2**20:.1f}"

    out = []
    for k in sorted(ranks):
        w = ranks[k]["models"][model]["workspace"]
        out.append([k, ", ".join(w["records"]), mib(w["plan_bytes"]), mib(w["bound_bytes"]),
                    mib(w["other_bound_bytes"]), mib(w["allocator_bytes"]),
                    mib(w["device_bytes"])])
    return table(["rank", "symmetric records", "plan, symmetric MiB",
                  "bound for them MiB", "the bind's other tensors MiB",
                  "torch allocator took MiB", "device memory taken MiB"], out)


def run(args: Any, argv: list[str]) -> int:
    harness.require_gpu(args.gpus)
    gpu = torch.cuda.get_device_properties(0).total_memory
    errors = [e for m in args.models
              for e in a2a_plans.plan_errors(m, args.gpus, args.tokens, gpu)]
    if errors:
        raise SystemExit("cannot plan the exchange:\n" + "\n".join(errors))
    info = RunInfo.collect("a2a", argv, gpus=args.gpus)
    ceil = harness.measure_ceilings(peer=True)
    print(ceil.line(), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ranks = harness.run_ranks(rank_main, args.gpus, (args.models, args.tokens, str(out)),
                              RANKS_TIMEOUT_S * len(args.models), out, "a2a")
    store = ", ".join(f"rank {r} {ranks[r]['peer_store_GBps']:.0f}" for r in ranks)
    body = [line for m in args.models for line in render(ranks, m)]
    text = harness.section(f"All-to-all, ep {args.gpus}", METHOD + f"\nPeer-store GB/s: {store}.",
                           info, ceil, body)
    harness.save(out, "a2a", {"info": info, "ceilings": ceil, "ranks": ranks}, text,
                 args.results)
    for r in range(args.gpus):
        os.remove(out / f"a2a_rank{r}.json")
    return 0
