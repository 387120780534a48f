"""What each spawned rank runs in test_moe_parallel: every layout of one world size, in one
process group, each checked against the float64 single-process reference of moe_cases.

A rank returns records (dicts); the test process asserts on them, so a failure names the
layout, model and case. Assertions that would leave other ranks waiting are not made here.
Layers run on the plan's buffers, bound as the engine binds them (runtime/buffers.py), so the
gathers and the exchanges go through views of them.
"""

from __future__ import annotations

import math
import traceback
from typing import Any

import torch

from moe_cases import (H, IdentityExperts, SPEC_KINDS, T_MAX, dense_weights, engine_config,
                       full_weights, load, reference_dense, reference_experts, reference_moe,
                       rel_err, tiny_spec)
from moeserve.layers.mlp import DenseMLP
from moeserve.moe.layer import MoELayer
from moeserve.layers.communicator import LayerCommunicator
from moeserve.parallel.groups import init_parallel_state
from moeserve.parallel.layout import ParallelLayout
from moeserve.batch.step import StepTooLarge
from moeserve.plan.capacity import build_plan
from moeserve.runtime.buffers import bind_model_buffers
from moeserve.testing.tiny_models import exchange_step

LAYOUTS: dict[str, dict[str, Any]] = {
    # world of 2
    "ep2": dict(tp=2, ep=2),
    "tp2_moe_tp2": dict(tp=2, ep=1),
    "dp2_attn_tp1": dict(tp=2, dp=2, ep=2),
    "dense_tp1_tp2": dict(tp=2, ep=2, dense_tp=1),
    "a2a_dp2": dict(tp=2, dp=2, ep=2, a2a=True),
    "a2a_sp2": dict(tp=2, ep=2, a2a=True),
    "nvlink_dp2": dict(tp=2, dp=2, ep=2, a2a="nvlink"),  # the peers' stores emulated by gloo
    # world of 4
    "ep4": dict(tp=4, ep=4),
    "tp4_ep2_moe_tp2": dict(tp=4, ep=2),
    "dp2_attn_tp2": dict(tp=4, dp=2, ep=2),
    "dense_tp1_dp2_attn_tp2": dict(tp=4, dp=2, ep=4, dense_tp=1),
    "a2a_sp4": dict(tp=4, ep=4, a2a=True),
    # the combine's sum in peer order (--enable-deterministic-inference)
    "a2a_dp2_sp2": dict(tp=4, dp=2, ep=4, a2a=True, deterministic=True),
    "nvlink_sp4": dict(tp=4, ep=4, a2a="nvlink"),
}
HOT_EXPERT = 5


def scenarios(dp: int) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (tokens per DP rank, padding rows at the end of each DP rank's batch)."""
    if dp == 1:
        return {"uneven": ((13,), 0), "few_rows": ((2,), 0), "idle": ((0,), 0),
                "padded": ((12,), 3), "worst": ((T_MAX,), 0), "hot_expert": ((11,), 0)}
    return {"uneven": ((13, 6), 0), "zero_rank": ((9, 0), 0), "idle": ((0, 0), 0),
            "padded": ((12, 7), 3), "worst": ((T_MAX, T_MAX), 0), "hot_expert": ((11, 5), 0)}


def _inputs(seed: int, dp_rank: int, tokens: int, attn_tp: int, hot: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """This DP rank's residual x [T, H] and attention partial sums [attn_tp, T, H]."""
    g = torch.Generator().manual_seed(seed * 101 + dp_rank)
    x = torch.randn(tokens, H, generator=g)
    if hot:
        x += 6.0 * _hot_direction()
    return x, torch.randn(attn_tp, tokens, H, generator=g) * 0.5


def _hot_direction() -> torch.Tensor:
    u = torch.randn(H, generator=torch.Generator().manual_seed(7))
    return u / u.norm()


def _hot_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gate weights under which every token picks HOT_EXPERT (inputs carry +6 u)."""
    w = dict(weights)
    gate = w["gate.weight"].clone()
    gate[HOT_EXPERT] = 4.0 * _hot_direction()
    w["gate.weight"] = gate
    if "gate.e_score_correction_bias" in w:
        bias = w["gate.e_score_correction_bias"].clone()
        bias[HOT_EXPERT] = 2.0
        w["gate.e_score_correction_bias"] = bias
    return w


def _flow(block: Any, comm: LayerCommunicator, step, x: torch.Tensor, partials: torch.Tensor,
          attn_tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer's data flow around `block`; returns (block output gathered to [T, H],
    next layer input [T, H]), on the CPU."""
    dev = comm.state.device
    a = comm.reduce_attn_output(partials[attn_tp_rank].to(dev, copy=True), step)
    r = comm.local_rows(x.to(dev), step) + a
    y = block(r, step)
    # copies: a gather's result may be a view of the plan's buffer, which the next overwrites
    y_TH = comm.gather_rows(y, step).to("cpu", copy=True)
    return y_TH, comm.gather_rows(r + y, step).to("cpu", copy=True)


def _bound(state, plan, block, comm=None):
    """`block` (and `comm`) on the plan's buffers, as MoECausalLM.bind_buffers binds them."""
    bufs = bind_model_buffers(plan, state.device)
    block.bind_buffers(bufs)
    if comm is not None:
        comm.bind(bufs.gather, bufs.comm)
    return bufs


def _layer_cases(name: str, kind: str, state, plan, rank: int, out: list) -> None:
    spec = tiny_spec(kind)
    lay = state.layout
    weights = full_weights(spec, seed=11)
    layer = MoELayer(spec, state, plan)
    comm = LayerCommunicator(state, moe=True)
    load(layer, weights)
    layer.to(state.device)
    _bound(state, plan, layer, comm)
    for s_i, (case, (counts, pad)) in enumerate(scenarios(lay.dp).items()):
        hot = case == "hot_expert"
        w = _hot_weights(weights) if hot else weights
        if hot:
            layer.gate.load_weight("weight", w["gate.weight"])
            if "gate.e_score_correction_bias" in w:
                layer.gate.load_weight("e_score_correction_bias",
                                       w["gate.e_score_correction_bias"])
        d = lay.dp_rank(rank)
        t = counts[d]
        pad_d = min(pad, t)
        x, partials = _inputs(s_i, d, t, lay.attn_tp, hot)
        step = exchange_step(t, state, plan, num_padding=pad_d)
        y, nxt = _flow(layer, comm, step, x, partials, lay.attn_tp_rank(rank))
        r_ref = x.double() + partials.double().sum(0)
        valid = t - pad_d
        y_ref = reference_moe(spec, w, r_ref[:valid])
        rec = dict(layout=name, kind=kind, case=case, rank=rank, local_tokens=t,
                   rows=step.num_rows(comm.scattered), runtime_max=step.runtime_max_per_rank,
                   err_moe=rel_err(y[:valid], y_ref),
                   err_flow=rel_err(nxt[:valid], r_ref[:valid] + y_ref))
        if pad_d and not spec.num_shared_experts:
            rec["pad_rows_abs_max"] = y[valid:].abs().max().item()
        if hot:  # every row of the DP rank through the gate (more than a rank's step routes)
            bound, _ = layer.gate.buffers, layer.gate.bind(None)
            ids, _ = layer.gate(r_ref.float().to(state.device))
            layer.gate.bind(bound)
            rec["all_rows_pick_hot"] = bool((ids == HOT_EXPERT).any(dim=1).all())
            load(layer, weights)
        out.append(rec)


def _dense_cases(name: str, state, plan, rank: int, out: list) -> None:
    spec = tiny_spec("qwen3")
    lay = state.layout
    weights = dense_weights(spec, seed=5)
    mlp = DenseMLP(spec, state)
    load(mlp, weights)
    mlp.to(state.device)
    comm = LayerCommunicator(state, moe=False)
    _bound(state, plan, mlp, comm)
    for s_i, (case, (counts, _)) in enumerate(scenarios(lay.dp).items()):
        d = lay.dp_rank(rank)
        x, partials = _inputs(100 + s_i, d, counts[d], lay.attn_tp)
        step = exchange_step(counts[d], state, plan)
        y, nxt = _flow(mlp, comm, step, x, partials, lay.attn_tp_rank(rank))
        r_ref = x.double() + partials.double().sum(0)
        y_ref = reference_dense(spec, weights, r_ref)
        out.append(dict(layout=name, kind="dense", case=case, rank=rank,
                        err_moe=rel_err(y, y_ref), err_flow=rel_err(nxt, r_ref + y_ref)))


def _routing(seed: int, tokens: int, k: int, one_expert: bool) -> tuple[torch.Tensor, ...]:
    """Top-k ids with -1 entries and duplicate ids in some rows (or every id = HOT_EXPERT)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 8, (tokens, k), generator=g, dtype=torch.int32)
    if one_expert:
        ids[:] = HOT_EXPERT
    else:
        ids[torch.rand(tokens, k, generator=g) < 0.2] = -1
        dup = torch.rand(tokens, generator=g) < 0.3
        ids[dup, 1] = ids[dup, 0]
        ids[torch.rand(tokens, generator=g) < 0.1] = -1  # some rows route nowhere
    weights = torch.rand(tokens, k, generator=g) + 0.1
    return ids, weights


def _dispatch_cases(name: str, kind: str, state, plan, rank: int, out: list) -> None:
    """Dispatch -> experts -> combine with injected ids, reference and identity experts."""
    spec = tiny_spec(kind)
    lay = state.layout
    weights = full_weights(spec, seed=3)
    layer = MoELayer(spec, state, plan)
    load(layer, weights)
    layer.to(state.device)
    bufs = _bound(state, plan, layer)
    identity = IdentityExperts(spec, state, torch.float32).to(state.device)
    disp, scattered = layer.dispatcher, layer.scattered
    for s_i, (case, counts) in enumerate([("random_ids", (13, 6)), ("one_expert", (7, 10)),
                                         ("zero_rank", (0, 9)), ("worst", (T_MAX, T_MAX))]):
        counts = counts[: lay.dp]
        d = lay.dp_rank(rank)
        g = torch.Generator().manual_seed(1000 + s_i * 10 + d)
        x_T = torch.randn(counts[d], H, generator=g)
        ids_T, w_T = _routing(2000 + s_i * 10 + d, counts[d], spec.top_k, case == "one_expert")
        step = exchange_step(counts[d], state, plan)
        start, end = step.row_range(scattered)
        x, ids, w = x_T[start:end], ids_T[start:end], w_T[start:end]
        dev = state.device
        tokens, handle = disp.dispatch(x.to(dev), ids.to(dev), w.to(dev), step)
        y = disp.combine(layer.experts(tokens.x_NH, tokens.topk_ids_NK, tokens.topk_weights_NK),
                         handle).cpu()
        rec = dict(layout=name, kind=kind, case=case, rank=rank, rows=end - start,
                   runtime_max=step.runtime_max_per_rank, dispatched_rows=tokens.x_NH.shape[0],
                   err_moe=rel_err(y, reference_experts(spec, weights, x, ids, w)))
        tokens, handle = disp.dispatch(x.to(dev), ids.to(dev), w.to(dev), step)
        y_id = disp.combine(identity(tokens.x_NH, tokens.topk_ids_NK, tokens.topk_weights_NK),
                            handle).cpu()
        ref_id = (x.double()[:, None, :] * (w.double() * (ids >= 0))[:, :, None]).sum(1)
        rec["err_identity"] = rel_err(y_id, ref_id)
        if lay.a2a:
            rec["a2a_capacity"] = handle.capacity
            # slots this rank filled, per peer; and non-empty slots it received
            if hasattr(handle, "slots_MP"):  # nvlink
                filled = (handle.slots_MP.cpu() >= 0).sum(dim=0)
                ws = disp.buffers
                rec["a2a_ptrs"] = (ws.recv.data_ptr(), ws.combine.data_ptr())
            else:
                filled = (handle.source_S.cpu().view(lay.ep, handle.capacity)
                          < handle.num_tokens).sum(dim=1)
                rec["a2a_ptrs"] = (disp.workspace.send.data_ptr(),
                                   disp.workspace.recv.data_ptr())
            rec["a2a_sent"] = filled.tolist()
            rec["a2a_received"] = int((tokens.topk_ids_NK >= 0).any(dim=1).sum())
        out.append(rec)
    if lay.a2a:
        ws = getattr(disp, "workspace", None) or disp.buffers
        windows = {}
        for field in ("send", "recv", "combine", "slots", "sources"):
            if plan.has_buffer(f"a2a.{field}"):
                rec_, buf = plan.buffer(f"a2a.{field}"), getattr(ws, field)
                windows[field] = dict(record_shape=rec_.shape, record_bytes=rec_.bytes,
                                      record_dtype=rec_.dtype, shape=tuple(buf.shape),
                                      bytes=buf.numel() * buf.element_size(),
                                      dtype=str(buf.dtype).removeprefix("torch."))
        out.append(dict(layout=name, kind=kind, case="workspace", rank=rank,
                        a2a_cap=plan.a2a_cap, moe_tokens=dict(plan.moe_tokens),
                        bound=ws is bufs.a2a, windows=windows,
                        runner_rows=plan.moe_runner_rows))
    else:
        out.append(dict(layout=name, kind=kind, case="runner_bound", rank=rank,
                        runner_rows=plan.moe_runner_rows))


def _guard(rank: int, state, plan, cfg_kwargs: dict, out: list, name: str) -> None:
    """An oversize step raises on every rank; the next step on the same groups works."""
    lay = state.layout
    spec = tiny_spec("qwen3")
    weights = full_weights(spec, seed=17)
    checks = [("tokens", plan, tuple([T_MAX + 1] + [3] * (lay.dp - 1)))]
    if lay.a2a:  # a plan whose all-to-all cap (5 per rank) is below the worst case
        small = build_plan(_config(cfg_kwargs, state.device, a2a_cap=5), spec)
        checks.append(("a2a_cap", small, tuple([6 * lay.attn_tp] + [2] * (lay.dp - 1))))
    for what, p, counts in checks:
        layer = MoELayer(spec, state, p)
        load(layer, weights)
        layer.to(state.device)
        comm = LayerCommunicator(state, moe=True)
        _bound(state, p, layer, comm)
        d = lay.dp_rank(rank)
        rec: dict[str, Any] = dict(layout=name, kind="qwen3", case=f"guard_{what}", rank=rank)
        try:
            exchange_step(counts[d], state, p)
            rec["error"] = None
        except StepTooLarge as exc:
            rec["error"] = str(exc)
        ok_counts = tuple(min(c, 4 * lay.attn_tp) for c in counts)
        x, partials = _inputs(77, d, ok_counts[d], lay.attn_tp)
        step = exchange_step(ok_counts[d], state, p)
        y, _ = _flow(layer, comm, step, x, partials, lay.attn_tp_rank(rank))
        r_ref = x.double() + partials.double().sum(0)
        rec["err_after"] = rel_err(y, reference_moe(spec, weights, r_ref))
        out.append(rec)


def _config(kwargs: dict, device: torch.device, **extra: Any):
    """The layout's config for the layers these ranks build (the reference experts) on
    `device`, so that its plan records their buffers."""
    return engine_config(**kwargs, **extra).replace(device=device.type, attention_backend="torch",
                                                    moe_runner_backend="reference")


def run_world(rank: int, world: int, names: list[str], device: str = "cpu") -> list[dict]:
    """device "cuda": one GPU per rank (NCCL world); the reference stays on the CPU."""
    torch.manual_seed(0)
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    out: list[dict] = []
    for name in names:
        kwargs = LAYOUTS[name]
        cfg = _config(kwargs, dev)
        plans = {kind: build_plan(cfg, tiny_spec(kind)) for kind in SPEC_KINDS}
        bad = {k: [str(e) for e in p.errors] for k, p in plans.items() if not p.ok}
        if bad:
            return [dict(layout=name, case="plan_errors", errors=bad)]
        state = init_parallel_state(ParallelLayout.from_config(cfg), dev)
        try:
            for kind in SPEC_KINDS:
                _layer_cases(name, kind, state, plans[kind], rank, out)
            for kind in ("qwen3", "deepseek_v3"):
                _dispatch_cases(name, kind, state, plans[kind], rank, out)
            _dense_cases(name, state, plans["qwen3"], rank, out)
            _guard(rank, state, plans["qwen3"], kwargs, out, name)
            if kwargs.get("a2a"):
                _mode_cases(name, state, plans["qwen3"], rank, out)
        except Exception:  # report, and stop this world (other ranks time out or fail too)
            out.append(dict(layout=name, case="exception", rank=rank,
                            error=traceback.format_exc()))
            return out
    return out


def _mode_cases(name: str, state, plan, rank: int, out: list) -> None:
    """Invariant 2: a forward of every mode's token count fits the all-to-all cap."""
    spec = tiny_spec("qwen3")
    weights = full_weights(spec, seed=23)
    layer = MoELayer(spec, state, plan)
    load(layer, weights)
    layer.to(state.device)
    comm = LayerCommunicator(state, moe=True)
    _bound(state, plan, layer, comm)
    lay = state.layout
    for m_i, (mode, t) in enumerate(plan.budget.by_mode().items()):
        if t is None:
            continue
        d = lay.dp_rank(rank)
        x, partials = _inputs(300 + m_i, d, t, lay.attn_tp)
        step = exchange_step(t, state, plan)
        y, _ = _flow(layer, comm, step, x, partials, lay.attn_tp_rank(rank))
        r_ref = x.double() + partials.double().sum(0)
        out.append(dict(layout=name, kind="qwen3", case=f"mode_{mode}", rank=rank, tokens=t,
                        runtime_max=step.runtime_max_per_rank, cap=plan.a2a_cap,
                        expect_m=math.ceil(t / lay.attn_tp),
                        err_moe=rel_err(y, reference_moe(spec, weights, r_ref))))
