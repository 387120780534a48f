r"""A step's collectives on the GPUs of one host: the all-reduce (alone, and with the residual
add and RMSNorm after it, as a decoder layer reduces), all-gather and reduce-scatter of [rows,
hidden] at decode and prefill sizes, one-shot on symmetric memory (what the engine runs up to
--symm-comm-max-bytes: parallel/symm_comm.py) beside NCCL, through the same calls of
parallel/collectives.py and parallel/symm_comm.py, in one run; where NCCL starts to win, per
op.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        PYTHONPATH=src python -m benchmarks collectives --gpus 2 --out $OUT \
        [--rows 1 2 4 ... 8192] [--hidden 2048] [--dtype bfloat16] [--results ...]

Each rank times every collective as CUDA-graph replays (ten calls back to back per replay,
after a barrier, between CUDA events: the median of 30 replays, per call; a2a.timed), on a
window for the largest tensor (kernels/comm/layout.window_bytes), so that the one-shot path
runs at every size. The all-gather's rows are split over the ranks as a scattered layer's are
(ceil(rows / ranks) a rank, the last ones fewer), into a buffer as the plan's; the
reduce-scatter's and the all-reduce's tensor is [rows, hidden] on every rank. Before timing,
each one-shot result is checked against NCCL's.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from benchmarks import harness
from benchmarks.harness import RunInfo, table

HELP = "the step's all-reduce, all-gather and reduce-scatter: one-shot on symmetric memory " \
       "against NCCL (several GPUs)"
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
HIDDEN = 2048  # Qwen3-30B-A3B's
OPS = ("all_reduce", "all_reduce_norm", "all_gather", "reduce_scatter")
EPS = 1e-6
RANKS_TIMEOUT_S = 900
METHOD = """\
Per call on each rank, µs, as CUDA-graph replays (ten calls in a graph, the median of 30
replays after a barrier). One-shot: the engine's path on symmetric memory
(kernels/comm/one_shot.py, one launch each, synchronising with the peers inside; the
all-reduce + RMSNorm of 16-bit rows kernels/comm/lamport.py, which waits on the data itself);
torch: the all-reduce as torch's one_shot_all_reduce_out after a copy into the window (bf16
and fp32 only). NCCL: the same calls without the window (all_reduce_norm: NCCL's all-reduce,
then add_rms_norm). Bytes: the whole tensor, all ranks' rows
(what --symm-comm-max-bytes bounds). The crossover: the largest size up to which the one-shot
path is faster at every size, on rank 0."""


def add_arguments(p: Any) -> None:
    harness.add_output_arguments(p)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS),
                   help="rows of the whole tensor (all ranks')")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="elements a row")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))


def split(rows: int, ranks: int) -> list[int]:
    """A scattered layer's rows per rank: ceil(rows / ranks) each, the last ones fewer."""
    c = math.ceil(rows / ranks)
    return [max(0, min(c, rows - r * c)) for r in range(ranks)]


def rank_main(rank: int, world: int, port: int, rows: list[int], hidden: int, dtype_name: str,
              out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    try:
        torch.cuda.set_device(rank)
        result = {"rows": measure(rank, world, rows, hidden, getattr(torch, dtype_name))}
        Path(out, f"collectives_rank{rank}.json").write_text(json.dumps(result, indent=1))
    finally:
        dist.destroy_process_group()


def measure(rank: int, world: int, rows: list[int], hidden: int, dtype: torch.dtype
            ) -> list[dict]:
    import torch.distributed as dist

    from benchmarks.a2a import timed
    from moeserve.kernels.comm.layout import window_bytes
    from moeserve.parallel import collectives as C
    from moeserve.parallel.groups import Axis
    from moeserve.parallel.symm_comm import SymmetricCollectives
    from moeserve.parallel.symmetric import symmetric_empty

    dev = torch.device("cuda", rank)
    axis = Axis(dist.group.WORLD, rank, world, tuple(range(world)))
    most = max(rows) * hidden * dtype.itemsize
    window = symmetric_empty((window_bytes(most, world),), torch.uint8, dev)
    symm = SymmetricCollectives.open(window, axis)
    buffer = torch.empty(most, dtype=torch.uint8, device=dev)  # as the plan's gather buffer
    out = []
    for n in rows:
        sizes = split(n, world)
        x = torch.randn(sizes[rank], hidden, device=dev).to(dtype)
        y = torch.randn(n, hidden, device=dev).to(dtype)
        z = torch.zeros(n, hidden, device=dev, dtype=dtype)  # summed in place, call after call
        res = torch.randn(n, hidden, device=dev).to(dtype)
        w = (torch.rand(hidden, device=dev) + 0.5).to(dtype)
        calls: dict[str, Callable[[Any], Any]] = {
            "all_reduce": lambda s: C.all_reduce(z, axis, s),
            "all_reduce_norm": lambda s: reduce_norm(y, res, w, axis, s, z),
            "all_gather": lambda s: C.all_gather_uneven(x, sizes, axis, buffer, s),
            "reduce_scatter": lambda s: C.reduce_scatter_uneven(y, sizes, axis, s)}
        norms = [reduce_norm(y, res, w, axis, s, y.clone()) for s in (symm, None)]
        row: dict[str, Any] = {"rows": n, "bytes": n * hidden * dtype.itemsize,
                               "agrees": agrees(x, y, sizes, axis, symm)
                               and all(close(a, b) for a, b in zip(*norms))}
        for op, call in calls.items():
            label = f"rank {rank} rows={n} {op}"
            row[f"{op}_symm_us"], row[f"{op}_symm_graph"] = timed(lambda: call(symm), label)
            row[f"{op}_nccl_us"], row[f"{op}_nccl_graph"] = timed(lambda: call(None), label)
        row["all_reduce_torch_us"] = None
        if dtype in (torch.float32, torch.bfloat16):  # what torch's one-shot kernel sums
            staged = symm.window.local[: z.numel() * dtype.itemsize].view(dtype).view(z.shape)

            def torch_one_shot() -> None:
                staged.copy_(z)
                torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum",
                                                           symm.window.group_name, z)

            row["all_reduce_torch_us"], _ = timed(torch_one_shot,
                                                  f"rank {rank} rows={n} torch all-reduce")
        out.append(row)
        print(f"rank {rank}: {n} rows done", flush=True)
    return out


def reduce_norm(y: torch.Tensor, res: torch.Tensor, w: torch.Tensor, axis: Any, symm: Any,
                scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(res + y summed), res + y summed) as a decoder layer reduces: one launch on the
    window, or NCCL's all-reduce (in place on `scratch`, which holds y's values or zeros)
    and add_rms_norm."""
    from moeserve.kernels.elementwise.fused import add_rms_norm
    from moeserve.parallel import collectives as C

    if symm is not None:
        return symm.all_reduce_add_rms_norm(y, res, w, EPS)
    return add_rms_norm(C.all_reduce(scratch, axis), res, w, EPS)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within 1e-2 of b's largest magnitude, element by element."""
    scale = b.float().abs().max().item() if b.numel() else 1.0
    return a.shape == b.shape and bool(((a.float() - b.float()).abs() <= 1e-2 * scale).all())


def agrees(x: torch.Tensor, y: torch.Tensor, sizes: list[int], axis: Any, symm: Any) -> bool:
    """The one-shot results beside NCCL's: the gather equal, the sums within 1e-2."""
    from moeserve.parallel import collectives as C

    gathered = torch.equal(C.all_gather_uneven(x, sizes, axis, symm=symm),
                           C.all_gather_uneven(x, sizes, axis))
    return gathered and close(C.reduce_scatter_uneven(y, sizes, axis, symm),
                              C.reduce_scatter_uneven(y, sizes, axis)) and \
        close(C.all_reduce(y.clone(), axis, symm), C.all_reduce(y.clone(), axis))


def crossover(rows: list[dict], op: str) -> tuple[int, Optional[int]]:
    """(the largest size up to which the one-shot path is faster at every size, 0 when it
    never is; the first size where NCCL is as fast or faster, None when it never is)."""
    best = 0
    for r in sorted(rows, key=lambda r: r["bytes"]):
        if r[f"{op}_symm_us"] >= r[f"{op}_nccl_us"]:
            return best, r["bytes"]
        best = r["bytes"]
    return best, None


def size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def crossover_lines(rows: list[dict]) -> list[str]:
    """One line per op, and the flag's value that every op's crossover admits."""
    lines, most = [], []
    for op in OPS:
        best, first = crossover(rows, op)
        most.append(best)
        nccl = "NCCL is never as fast" if first is None else f"NCCL from {size(first)}"
        lines.append(f"- {op}: one-shot faster up to {size(best) if best else 'no size'} "
                     f"({nccl})")
    lines.append(f"- every op: --symm-comm-max-bytes {min(most)}")
    return lines


def render(ranks: dict[int, dict], hidden: int, dtype: str) -> list[str]:
    """A table per op (rank 0's times, the other ranks' spread), then the crossovers."""
    rows = ranks[0]["rows"]
    out = []
    for op in OPS:
        cells = []
        for i, r in enumerate(rows):
            spread = max(abs(ranks[k]["rows"][i][f"{op}_symm_us"] / r[f"{op}_symm_us"] - 1)
                         for k in ranks)
            symm, nccl = r[f"{op}_symm_us"], r[f"{op}_nccl_us"]
            line = [r["rows"], size(r["bytes"]),
                    f"{symm:.1f}" + ("" if r[f"{op}_symm_graph"] else " (eager)"),
                    f"{nccl:.1f}" + ("" if r[f"{op}_nccl_graph"] else " (eager)")]
            if op == "all_reduce":
                torch_us = r["all_reduce_torch_us"]
                line.append("-" if torch_us is None else f"{torch_us:.1f}")
            line += [f"{nccl / symm:.2f}", f"{100 * spread:.0f}%",
                     "yes" if all(ranks[k]["rows"][i]["agrees"] for k in ranks) else "NO"]
            cells.append(line)
        head = ["rows", "bytes", "one-shot µs", "NCCL µs"]
        head += ["torch one_shot_all_reduce µs"] if op == "all_reduce" else []
        head += ["NCCL ÷ one-shot", "other ranks' one-shot within", "equals NCCL"]
        out += [f"### {op}, [rows, {hidden}] {dtype}", "", *table(head, cells), ""]
    return out + ["Crossover (rank 0):", "", *crossover_lines(rows), ""]


def run(args: Any, argv: list[str]) -> int:
    harness.require_gpu(args.gpus)
    if args.gpus < 2:
        raise SystemExit("collectives need --gpus 2 or more")
    info = RunInfo.collect("collectives", argv, gpus=args.gpus)
    ceil = harness.measure_ceilings(peer=True)
    print(ceil.line(), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(set(args.rows))
    ranks = harness.run_ranks(rank_main, args.gpus, (rows, args.hidden, args.dtype, str(out)),
                              RANKS_TIMEOUT_S, out, "collectives")
    body = render(ranks, args.hidden, args.dtype)
    text = harness.section(f"Step collectives, {args.gpus} ranks", METHOD, info, ceil, body)
    harness.save(out, "collectives", {"info": info, "ceilings": ceil, "ranks": ranks}, text,
                 args.results)
    for r in range(args.gpus):
        os.remove(out / f"collectives_rank{r}.json")
    print("\n".join(crossover_lines(ranks[0]["rows"])), flush=True)
    return 0
