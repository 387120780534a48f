"""What each GPU rank runs in parallel/test_symm_comm_gpu.py: the one-shot collectives
(parallel/symm_comm.py) beside NCCL through the same calls of parallel/collectives.py, on a
world of 2 or 4 GPUs. Every rank makes every rank's inputs from per-rank seeds, so each can
compute the references alone: the concatenation, and the sums in rank order. Records come back
to the test process, which asserts on them."""

from __future__ import annotations

import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from moe_cases import rel_err
from moeserve.kernels.elementwise.fused import add_rms_norm
from moeserve.parallel import collectives as C
from moeserve.parallel.groups import Axis
from moeserve.parallel.symm_comm import SymmetricCollectives
from moeserve.parallel.symmetric import symmetric_empty
from moeserve.testing.graphs import captured

WINDOW = 128 << 10  # collectives above this run on NCCL, also in the chains below
EPS = 1e-6
DTYPES = ("float32", "bfloat16", "float16")
WIDTHS = (40, 1024)  # elements a row


def size_cases(world: int) -> dict[str, list[int]]:
    return {"uneven": [3 + 2 * r for r in range(world)],
            "zero_rows_here": [0 if r == 1 else 5 for r in range(world)],
            "one_rank_has_all": [9 if r == world - 1 else 0 for r in range(world)],
            "equal": [4] * world, "one_each": [1] * world,
            "decode_batch": [16] * world}


def run_world(rank: int, world: int) -> list[dict]:
    try:
        return _run(rank, world)
    except Exception:
        return [dict(case="exception", rank=rank, error=traceback.format_exc())]


def _inputs(case: int, src: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank src's input of a case, the same on every rank that makes it."""
    g = torch.Generator().manual_seed(1000 * case + src)
    return torch.randn(rows, width, generator=g).to(dtype).cuda()


def _rank_order(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The sum of parts in rank order in fp32, rounded to dtype once (as the kernel sums)."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(dtype)


def _same_on_every_rank(t: torch.Tensor, axis: Axis) -> bool:
    every = [torch.empty_like(t) for _ in range(axis.size)]
    dist.all_gather(every, t.contiguous())
    return all(torch.equal(e, t) for e in every)


def _run(rank: int, world: int) -> list[dict]:
    axis = Axis(dist.group.WORLD, rank, world, tuple(range(world)))
    symm = SymmetricCollectives.open(symmetric_empty((WINDOW,), torch.uint8,
                                                     torch.device("cuda", rank)), axis)
    out: list[dict] = []
    case = 0
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        for width in WIDTHS:
            for name, sizes in size_cases(world).items():
                case += 1
                n = sum(sizes)
                xs = [_inputs(case, r, sizes[r], width, dtype) for r in range(world)]
                ys = [_inputs(case + 500, r, n, width, dtype) for r in range(world)]
                lo = sum(sizes[:rank])
                took = symm.takes(n * width * xs[0].element_size(), dtype)
                ag = C.all_gather_uneven(xs[rank], sizes, axis, symm=symm)
                rs = C.reduce_scatter_uneven(ys[rank], sizes, axis, symm=symm)
                ar = C.all_reduce(ys[rank].clone(), axis, symm=symm)
                ag_nccl = C.all_gather_uneven(xs[rank], sizes, axis)
                rs_nccl = C.reduce_scatter_uneven(ys[rank], sizes, axis)
                ar_nccl = C.all_reduce(ys[rank].clone(), axis)
                ar_ref = _rank_order(ys, dtype)
                rs_ref = ar_ref[lo: lo + sizes[rank]]
                # a view that starts 6 bytes into its storage: narrower accesses, same sums
                odd = torch.cat([ys[rank].view(-1)[:3], ys[rank].view(-1)])[3:]
                odd = C.all_reduce(odd.view(n, width), axis, symm=symm)
                # the all-reduce with the add and norm after it: add_rms_norm's bits
                res = _inputs(case + 900, 0, n, width, dtype)
                w = _inputs(case + 901, 0, 1, width, dtype)[0].abs() + 0.5
                fused = symm.all_reduce_add_rms_norm(ys[rank].clone(), res, w, EPS) \
                    if took and n else None
                apart = add_rms_norm(res, ar_ref, w, EPS) if n else None
                out.append(dict(
                    case=name, dtype=dtype_name, width=width, rank=rank, symmetric=took,
                    gather_equal=torch.equal(ag, torch.cat(xs)) and torch.equal(ag, ag_nccl),
                    rs_shape=tuple(rs.shape) == (sizes[rank], width),
                    rs_ref_equal=torch.equal(rs, rs_ref),
                    rs_nccl_equal=torch.equal(rs, rs_nccl),
                    rs_rel_err=rel_err(rs.float(), rs_nccl.float()),
                    ar_ref_equal=torch.equal(ar, ar_ref) and torch.equal(odd, ar_ref),
                    ar_nccl_equal=torch.equal(ar, ar_nccl),
                    ar_rel_err=rel_err(ar.float(), ar_nccl.float()),
                    ar_same_everywhere=_same_on_every_rank(ar, axis),
                    norm_equal=fused is None or all(torch.equal(f, a)
                                                    for f, a in zip(fused, apart))))
    out += _chains(rank, world, axis, symm)
    return out


def _chain(x: torch.Tensor, z0: torch.Tensor, z: torch.Tensor, sizes: list[int],
           big: list[int], axis: Axis, symm: Any) -> Callable[[], list[torch.Tensor]]:
    """Collectives back to back on one window, each feeding the next, one of them above the
    window (NCCL in between): what consecutive layers do."""
    def run() -> list[torch.Tensor]:
        got = []
        h = x
        for i in range(4):
            a = C.all_gather_uneven(h, sizes, axis, symm=symm)  # [n, w]
            got.append(a)
            s = C.reduce_scatter_uneven(a * (i + 1), sizes, axis, symm=symm)
            h = s * (1.0 / (axis.size * (i + 1)))
            z.copy_(z0)
            got += _reduce_add_norm(z[: len(a)].clone(), a, axis, symm)
            z.copy_(z0)
            got.append(C.all_reduce(z[: len(a)], axis, symm=symm).clone())
            got.append(C.all_gather_uneven(z[: big[axis.rank]].contiguous(), big, axis,
                                           symm=symm))
        got.append(h)
        return got
    return run


def _reduce_add_norm(y: torch.Tensor, x: torch.Tensor, axis: Axis,
                     symm: Any) -> list[torch.Tensor]:
    """RMSNorm(x + y summed over the axis) and that sum: one launch on the window where it
    takes y, else NCCL's all-reduce and add_rms_norm."""
    w = torch.ones(y.shape[1], dtype=y.dtype, device=y.device)
    if symm is not None and symm.takes(y.numel() * y.element_size(), y.dtype):
        return list(symm.all_reduce_add_rms_norm(y, x, w, EPS))
    return list(add_rms_norm(x, C.all_reduce(y, axis), w, EPS))


def _chains(rank: int, world: int, axis: Axis, symm: Any) -> list[dict]:
    """The chain eagerly on the window beside NCCL alone, then as a CUDA-graph replay on new
    inputs beside an eager run on them."""
    out = []
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        sizes = [5 + r for r in range(world)]
        n, width = sum(sizes), 256
        big = [WINDOW // (width * dtype.itemsize) // world + 1] * world  # above the window
        x = _inputs(7, rank, sizes[rank], width, dtype)
        z0 = _inputs(8, rank, max(n, sum(big)), width, dtype)
        z = torch.empty_like(z0)
        symm_chain = _chain(x, z0, z, sizes, big, axis, symm)
        nccl_chain = _chain(x, z0, z, sizes, big, axis, None)
        eager, ref = symm_chain(), nccl_chain()
        errs = [rel_err(a.float(), b.float()) for a, b in zip(eager, ref)]
        graph, graphed = captured(symm_chain)
        x.copy_(_inputs(9, rank, sizes[rank], width, dtype))
        z0.copy_(_inputs(10, rank, z0.shape[0], width, dtype))
        graph.replay()
        again = symm_chain()
        torch.cuda.synchronize()
        out.append(dict(case="chain", dtype=dtype_name, rank=rank,
                        rel_err=max(errs),
                        graph_equal=all(torch.equal(a, b) for a, b in zip(graphed, again))))
    return out


def plan_windows(rank: int, world: int) -> dict:
    """A plan's comm.symm.* records beside the windows the bind allocates and opens."""
    from moe_cases import engine_config, tiny_spec
    from moeserve.parallel.groups import init_parallel_state
    from moeserve.plan.capacity import build_plan
    from moeserve.runtime.buffers import bind_model_buffers

    dev = torch.device("cuda", rank)
    cfg = engine_config(tp=world, ep=world).replace(device="cuda", dtype="bfloat16")
    plan = build_plan(cfg, tiny_spec("qwen3"))
    assert plan.ok, plan.errors
    state = init_parallel_state(plan.layout, dev)
    bufs = bind_model_buffers(plan, dev)
    records = {r.name: r.bytes for r in plan.buffers if r.name.startswith("comm.")}
    opened = {name: bufs.comm.collectives(name, getattr(state, name))
              for name in ("attn_tp", "world")}
    x = torch.full((8, 64), float(rank + 1), device=dev, dtype=torch.bfloat16)
    summed = opened["attn_tp"].all_reduce(x)
    return dict(records=records,
                allocated={f"comm.symm.{n}": getattr(bufs.comm, n).nbytes for n in opened},
                opened=sorted(n for n, s in opened.items() if s is not None),
                same_object=bufs.comm.collectives("world", state.world) is opened["world"],
                sum_ok=bool((summed == world * (world + 1) / 2).all()))
