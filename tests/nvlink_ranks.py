"""What each GPU rank runs in moe/test_nvlink_gpu.py: one MoE layer behind the nvlink
dispatcher and behind the NCCL all_to_all dispatcher (the reference, its combine summing in
rank order), on the same weights and the same routed rows, eagerly and as a CUDA-graph replay,
on a world of 2 or 4 GPUs (ep = world; the spec's 8 experts split either way). Records come
back to the test process, which asserts on them."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from moe_cases import H, E, engine_config, full_weights, load, rel_err, tiny_spec
from moeserve.moe.layer import MoELayer
from moeserve.parallel.groups import init_parallel_state
from moeserve.plan.capacity import build_plan
from moeserve.runtime.buffers import bind_model_buffers
from moeserve.testing.graphs import captured
from moeserve.testing.tiny_models import exchange_step

CASES = ("skewed", "all_to_one_rank", "zero_rows_here", "minus_one_and_duplicates", "cap")


def layouts(world: int) -> dict[str, dict[str, int]]:
    """DP attention and the SP layout (attention TP over the world), ep = world."""
    return {"dp_attention": dict(tp=world, dp=world, ep=world), "sp": dict(tp=world, ep=world)}


def _routing(case: str, m: int, k: int, g: torch.Generator, world: int) -> torch.Tensor:
    per_rank = E // world
    assert E % world == 0 and per_rank >= k, (E, world, k)
    if case == "all_to_one_rank":  # every id on rank 1's experts
        return torch.stack([torch.randperm(per_rank, generator=g)[:k] + per_rank
                            for _ in range(m)]).reshape(m, k)
    if case == "skewed":  # nine in ten ids on rank 0
        hot = torch.rand(m, k, generator=g) < 0.9
        return torch.where(hot, torch.randint(0, per_rank, (m, k), generator=g),
                           torch.randint(0, E, (m, k), generator=g))
    ids = torch.randint(0, E, (m, k), generator=g)
    if case == "minus_one_and_duplicates":
        ids[::3, 1] = ids[::3, 0]
        ids[1::4] = -1
        ids[2::5, 0] = -1
    return ids


def _records(run: Any, rank: int, *args: Any) -> list[dict]:
    """run's records, or one record of the exception that stopped it (the test names it)."""
    try:
        return run(rank, *args)
    except Exception:
        return [dict(case="exception", rank=rank, error=traceback.format_exc())]


def run_world(rank: int, world: int, dtype_name: str) -> list[dict]:
    return _records(_run, rank, world, dtype_name)


def plan_for(kw: dict[str, int], a2a: str, dtype_name: str, spec: Any) -> Any:
    """The plan of one rank of a layout of `layouts` (built on a CPU too)."""
    cfg = engine_config(**kw, a2a=a2a, deterministic=True).replace(
        device="cuda", dtype=dtype_name, attention_backend="torch",
        moe_runner_backend="reference")
    return build_plan(cfg, spec)


def _run(rank: int, world: int, dtype_name: str) -> list[dict]:
    dev, dtype = torch.device("cuda", rank), getattr(torch, dtype_name)
    spec = tiny_spec("qwen3")
    weights = full_weights(spec, seed=3)
    out: list[dict] = []
    for name, kw in layouts(world).items():
        layers, plans, state = {}, {}, None
        for a2a in ("nvlink", "all_to_all"):
            plans[a2a] = plan = plan_for(kw, a2a, dtype_name, spec)
            assert plan.ok, plan.errors
            state = state or init_parallel_state(plan.layout, dev)
            layer = MoELayer(spec, state, plan, dtype)
            load(layer, weights)
            layer.to(dev)
            layer.bind_buffers(bind_model_buffers(plan, dev))
            layers[a2a] = layer
        assert state is not None
        cap = plans["nvlink"].a2a_cap
        lay = state.layout
        for c, case in enumerate(CASES):
            g = torch.Generator().manual_seed(100 * c + rank)
            tokens = {"zero_rows_here": 0 if rank == 1 else 9,
                      "cap": cap * lay.attn_tp}.get(case, 13 + 4 * rank)
            if lay.dp == 1:  # one token count for the attention-TP group
                tokens = {"zero_rows_here": 1}.get(case, tokens if case == "cap" else 13)
            x_T = torch.randn(tokens, H, generator=g).to(dtype)
            ids_T = _routing(case, tokens, spec.top_k, g, world).to(torch.int32)
            w_T = torch.rand(tokens, spec.top_k, generator=g) + 0.1
            step = exchange_step(tokens, state, plans["nvlink"])
            lo, hi = step.row_range(layers["nvlink"].scattered)
            x, ids, w = (t[lo:hi].to(dev) for t in (x_T, ids_T, w_T))

            def moe(layer: MoELayer) -> torch.Tensor:
                toks, handle = layer.dispatcher.dispatch(x, ids, w, step)
                y = layer.experts(toks.x_NH, toks.topk_ids_NK, toks.topk_weights_NK)
                return layer.dispatcher.combine(y, handle)

            y_nv, y_ref = moe(layers["nvlink"]), moe(layers["all_to_all"])
            graph, y_graph = captured(lambda: moe(layers["nvlink"]))
            x.copy_(x.flip(0))  # new inputs in the captured buffers
            graph.replay()
            y_new = moe(layers["nvlink"])
            torch.cuda.synchronize()
            rec: dict[str, Any] = dict(layout=name, case=case, rank=rank, rows=hi - lo,
                                       runtime_max=step.runtime_max_per_rank, cap=cap,
                                       equal=bool(torch.equal(y_nv, y_ref)),
                                       rel_err=rel_err(y_nv.float().cpu(), y_ref.float().cpu()),
                                       graph_equal=bool(torch.equal(y_graph, y_new)))
            for _ in range(3):  # the same bits run to run
                rec["repeat_equal"] = bool(torch.equal(moe(layers["nvlink"]), y_new))
            out.append(rec)
        ws = layers["nvlink"].dispatcher.buffers
        symmetric = [r for r in plans["nvlink"].buffers
                     if r.symmetric and r.name.startswith("a2a.")]
        out.append(dict(layout=name, case="symmetric_bytes", rank=rank,
                        plan=sum(r.bytes for r in symmetric),
                        allocated=sum(t.numel() * t.element_size()
                                      for t in (ws.recv, ws.combine)),
                        names=sorted(r.name for r in symmetric)))
    return out


def run_fp8_world(rank: int, world: int, device_type: str) -> list[dict]:
    return _records(_run_fp8, rank, world, device_type)


def _run_fp8(rank: int, world: int, device_type: str) -> list[dict]:
    """fp8 rows (--quantization fp8): what the nvlink dispatcher hands the experts against
    what the NCCL all_to_all dispatcher hands them (the same slots: the fp8 bytes, the
    scales, the weights of every filled slot; the ids of every slot), and the two combines of
    the same expert outputs. On a CPU the peers' stores are emulated over gloo."""
    from moeserve.layers.linear import quantize_rows
    from moeserve.moe.dispatch import create_dispatcher
    from moeserve.plan.budget import layer_scatters

    dev = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    spec = tiny_spec("qwen3")
    out: list[dict] = []
    for name, kw in layouts(world).items():
        dispatchers, state = {}, None
        for a2a in ("nvlink", "all_to_all"):
            cfg = engine_config(**kw, a2a=a2a, deterministic=True).replace(
                device=device_type, dtype="bfloat16", attention_backend="torch",
                moe_runner_backend="reference", quantization="fp8")
            plan = build_plan(cfg, spec)
            assert plan.ok, plan.errors
            assert plan.a2a_scale_group and plan.backends.a2a == a2a
            state = state or init_parallel_state(plan.layout, dev)
            d = create_dispatcher(spec, state, plan, torch.bfloat16)
            d.bind(bind_model_buffers(plan, dev))
            dispatchers[a2a] = d
        assert state is not None
        plan_nv = dispatchers["nvlink"].plan
        scattered = layer_scatters(state.layout, moe=True)
        for c, case in enumerate(CASES[:4]):
            g = torch.Generator().manual_seed(100 * c + rank)
            tokens = {"zero_rows_here": 0 if rank == 1 else 9}.get(case, 13 + 4 * rank)
            if state.layout.dp == 1:  # one token count for the attention-TP group
                tokens = {"zero_rows_here": 1}.get(case, 13)
            x_T = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
            ids_T = _routing(case, tokens, spec.top_k, g, world).to(torch.int32)
            w_T = torch.rand(tokens, spec.top_k, generator=g) + 0.1
            step = exchange_step(tokens, state, plan_nv)
            lo, hi = step.row_range(scattered)
            x, ids, w = (t[lo:hi].to(dev) for t in (x_T, ids_T, w_T))
            got = {a2a: d.dispatch(x, ids, w, step) for a2a, d in dispatchers.items()}
            # each dispatcher quantized this step's rows into the plan's a2a.quant records
            xq, xs = quantize_rows(x, plan_nv.a2a_scale_group)
            planned = all(
                torch.equal(ws.quant[:len(x)].view(torch.uint8), xq.view(torch.uint8))
                and torch.equal(ws.quant_scale[:len(x)], xs)
                for ws in (dispatchers["nvlink"].buffers, dispatchers["all_to_all"].workspace))
            (nv, nv_handle), (ref, ref_handle) = got["nvlink"], got["all_to_all"]
            per = spec.num_experts // state.layout.ep
            mine = state.ep.rank * per

            def own(ids_NK: torch.Tensor) -> torch.Tensor:
                return torch.where((ids_NK >= mine) & (ids_NK < mine + per), ids_NK, -1)
            filled = (ref.topk_ids_NK >= 0).any(dim=1)
            y = torch.randn(ref.x_NH.shape[0], H, generator=g).to(torch.bfloat16).to(dev)
            y_nv = dispatchers["nvlink"].combine(y, nv_handle)
            y_ref = dispatchers["all_to_all"].combine(y, ref_handle)
            out.append(dict(
                layout=name, case=case, rank=rank, filled=int(filled.sum()),
                fp8=nv.x_NH.dtype == torch.float8_e4m3fn and nv.x_scale_NG is not None,
                # (the NCCL path carries all K ids, the one-sided one only this rank's)
                ids=bool(torch.equal(own(nv.topk_ids_NK), own(ref.topk_ids_NK))),
                rows=bool(torch.equal(nv.x_NH[filled].view(torch.uint8),
                                      ref.x_NH[filled].view(torch.uint8))),
                scales=bool(torch.equal(nv.x_scale_NG[filled], ref.x_scale_NG[filled])),
                weights=bool(torch.equal(nv.topk_weights_NK[filled],
                                         ref.topk_weights_NK[filled])),
                combine_err=rel_err(y_nv.float().cpu(), y_ref.float().cpu()),
                planned=planned))
    return out


def check_fp8_records(records: list[dict], world: int) -> None:
    """run_fp8_world's records: fp8 rows handed over, the same slots as the NCCL path's,
    combines within 1e-2."""
    failures = [r for r in records if r["case"] == "exception"]
    if failures:
        raise AssertionError(failures[0]["error"])
    assert len(records) == world * len(layouts(world)) * 4
    assert sum(r["filled"] for r in records) > 0
    for r in records:
        where = (r["layout"], r["case"], r["rank"])
        assert r["fp8"] and r["ids"] and r["rows"] and r["scales"] and r["weights"], where
        assert r["planned"], where  # the rows were quantized into the plan's records
        assert r["combine_err"] <= 1e-2, (where, r["combine_err"])
