"""The binder (runtime/buffers.py): every record of the capacity plan allocated once, with the
record's bytes, for every layout and both devices a plan is made for; the layers take the
handles and refuse the ones they cannot use; steps go through views of them, and a step
larger than the plan still meets the runtime guard. Multi-rank runs on the bound buffers are
tests/moe/test_moe_parallel.py and tests/models/test_models_parallel.py."""

from __future__ import annotations

import pytest
import torch

from moe_cases import T_MAX, engine_config, full_weights, load, tiny_spec
from moeserve.batch.buffers import AttentionPartials, GatherBuffers, ModelBuffers
from moeserve.batch.step import StepTooLarge, step_from_counts
from moeserve.kernels.moe.align_torch import Workspace
from moeserve.layers.attention import TorchAttentionBackend
from moeserve.layers.communicator import LayerCommunicator
from moeserve.moe.dispatch.base import payload_bytes
from moeserve.moe.layer import MoELayer
from moeserve.parallel.collectives import region
from moeserve.parallel.groups import single_process_state
from moeserve.parallel.layout import ParallelLayout
from moeserve.plan.buffers import token_payload_bytes
from moeserve.plan.capacity import build_plan
from moeserve.runtime.buffers import bind_buffers, bind_model_buffers
from moe_cases import fake_state

LAYOUTS = {
    "tp1": dict(),
    "tp2_ep2_gather": dict(tp=2, ep=2),
    "tp2_ep2_all_to_all": dict(tp=2, ep=2, a2a=True),
    "tp2_ep2_nvlink": dict(tp=2, ep=2, a2a="nvlink"),
    "dp2_attention": dict(tp=2, dp=2, ep=2),
    "dp2_attn_tp2_gather": dict(tp=4, dp=2, ep=2),
    "sp4": dict(tp=4, ep=4, a2a=True),
    "dense_replicated": dict(tp=2, ep=2, dense_tp=1),
}
# the records each layout adds to those of every plan (router, request table, KV cache, ...)
GATHERS = {
    "tp1": set(), "tp2_ep2_gather": set(), "tp2_ep2_all_to_all": {"attn_tp_gather.hidden"},
    "tp2_ep2_nvlink": {"attn_tp_gather.hidden"},
    "dp2_attention": {"dp_gather.rows"},
    "dp2_attn_tp2_gather": {"dp_gather.rows", "attn_tp_gather.hidden"},
    "sp4": {"attn_tp_gather.hidden"}, "dense_replicated": {"attn_tp_gather.hidden"},
}
# the windows of the one-shot collectives a GPU plan adds: attn_tp where attention is split,
# the world where the gather dispatcher or a dense MLP split over it (tiny's layer 0) runs
BOTH = {"comm.symm.attn_tp", "comm.symm.world"}
COMMS = {"tp1": set(), "tp2_ep2_gather": BOTH, "tp2_ep2_all_to_all": BOTH,
         "tp2_ep2_nvlink": BOTH, "dp2_attention": {"comm.symm.world"},
         "dp2_attn_tp2_gather": BOTH, "sp4": BOTH, "dense_replicated": BOTH}


def _plan(layout: str, device: str):
    cfg = engine_config(**LAYOUTS[layout]).replace(device=device, gpu_memory_gb=1.0,
                                                   max_total_tokens=2048)
    plan = build_plan(cfg, tiny_spec("qwen3"))
    assert plan.ok, plan.errors
    return plan


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # the plan's device; bound on the CPU
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_record_is_allocated_once_with_its_bytes(layout, device):
    plan = _plan(layout, device)
    bufs = bind_buffers(plan, "cpu")
    records = {r.name: r for r in plan.buffers}
    assert set(bufs.allocated) == set(records)
    for name, t in bufs.allocated.items():
        rec = records[name]
        assert t.numel() * t.element_size() == rec.bytes and t.dtype == getattr(torch,
                                                                                 rec.dtype), name
        if name not in ("kv_cache",):  # the pools keep their own dims of the same bytes
            assert tuple(t.shape) == rec.shape, name
    assert len({t.data_ptr() for t in bufs.allocated.values()}) == len(records)  # no aliases
    kv = records["kv_cache"].bytes
    assert bufs.nbytes == plan.memory.static_buffer_bytes_per_rank + kv
    names = set(records)
    gathers = {n for n in names if "gather." in n}
    assert gathers == GATHERS[layout]
    a2a = LAYOUTS[layout].get("a2a", False)
    assert ({"a2a.send", "a2a.recv"} <= names) == (a2a is True)
    assert ({"a2a.recv", "a2a.combine", "a2a.slots", "a2a.sources"} <= names) == (a2a == "nvlink")
    assert ("a2a.route_counts" in names) == (a2a == "nvlink")  # route_slots' block counts
    gpu = device == "cuda"  # the triton runner's workspace, partials and graph inputs
    comm = COMMS[layout] if gpu else set()  # a CPU runs every collective on gloo
    assert {n for n in names if n.startswith("comm.")} == comm
    assert {r.name for r in plan.buffers if r.symmetric} == \
        ({"a2a.recv", "a2a.combine"} if a2a == "nvlink" else set()) | comm
    sizes = {"comm.symm.attn_tp": plan.layout.attn_tp, "comm.symm.world": plan.layout.tp}
    assert all(records[n].bytes == 4 * sizes[n] * plan.config.symm_comm_max_bytes for n in comm)
    assert {n for n in ("attn_tp", "world") if getattr(bufs.model.comm, n) is not None} == \
        {n.removeprefix("comm.symm.") for n in comm}
    assert any(n.startswith("moe.runner.") for n in names) == gpu
    assert any(n.startswith("graph.decode.") for n in names) == gpu
    assert (bufs.decode_graph is not None) == (bufs.prefill_graph is not None) == gpu
    m = bufs.model
    assert m.router is not None and (m.experts is not None) == gpu
    if m.a2a is not None:  # one payload formula: the plan's, which the dispatcher uses
        payload = token_payload_bytes(48, 2, 4)
        assert m.a2a.recv.shape[-1] == payload == payload_bytes(48, 2, torch.float32)


def test_the_model_runner_binds_the_plan_and_the_layers_share_it():
    from moeserve.parallel.devices import runtime_config
    from moeserve.config import EngineConfig
    from moeserve.runtime.engine import make_plan
    from moeserve.runtime.worker import RankWorker

    cfg = runtime_config(EngineConfig(model="preset:tiny", load_format="dummy", device="cpu",
                                      context_length=64, max_running_requests=4))
    plan = make_plan(cfg)
    runner = RankWorker(cfg, plan.spec, plan, single_process_state(plan.layout), (3,)).runner
    bufs = runner.buffers
    assert set(bufs.allocated) == {r.name for r in plan.buffers}
    assert runner.kv_pool is bufs.kv_pool and runner.next_tokens is bufs.next_tokens
    moe = [layer.mlp for layer in runner.model.layers if isinstance(layer.mlp, MoELayer)]
    assert moe and all(m.gate.buffers is bufs.model.router for m in moe)
    # a step's top-k are the first rows of the one planned buffer
    x = torch.randn(5, plan.spec.hidden_size)
    ids, weights = moe[0].gate(x)
    assert ids.data_ptr() == bufs.model.router.topk_ids_MK.data_ptr()
    assert weights.data_ptr() == bufs.model.router.topk_weights_MK.data_ptr()


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "deepseek_v2", "deepseek_v3"])
def test_bound_layer_gives_the_unbound_output(kind):
    spec = tiny_spec(kind)
    plan = build_plan(engine_config().replace(device="cpu"), spec)
    state = single_process_state(plan.layout)
    layer = MoELayer(spec, state, plan)
    load(layer, full_weights(spec, seed=3))
    x = torch.randn(T_MAX, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    step = step_from_counts([T_MAX], plan.layout, 0, plan, num_padding=3)
    want = layer(x, step)
    layer.bind_buffers(bind_model_buffers(plan, "cpu"))
    assert torch.equal(layer(x, step), want)
    small = step_from_counts([7], plan.layout, 0, plan)  # fewer rows after more
    layer.gate.bind(None)
    want = layer(x[:7], small)
    layer.bind_buffers(bind_model_buffers(plan, "cpu"))
    assert torch.equal(layer(x[:7], small), want)


def test_a_step_larger_than_the_plan_meets_the_guard_and_the_buffers_refuse_it():
    plan = _plan("sp4", "cpu")
    layout = plan.layout
    with pytest.raises(StepTooLarge, match=f"to {T_MAX + 1} or more"):
        step_from_counts([T_MAX + 1] * layout.tp, layout, 0, plan)
    bufs = bind_model_buffers(plan, "cpu")
    m_max = bufs.router.topk_ids_MK.shape[0]
    assert m_max == T_MAX // layout.attn_tp  # the post-scatter count (SP)
    with pytest.raises(RuntimeError, match="moe.router.topk_"):
        bufs.router.rows(m_max + 1)
    gather = bufs.gather.attn_tp
    rows, h = gather.shape
    assert region(gather, (rows, h), gather.dtype).data_ptr() == gather.data_ptr()
    with pytest.raises(RuntimeError, match="exceeds the token budget"):
        region(gather, (rows + 1, h), gather.dtype)


def test_layers_refuse_handles_they_cannot_use_and_need_the_ones_they_gather_into():
    plan = _plan("tp1", "cpu")
    spec, state = plan.spec, single_process_state(plan.layout)
    layer = MoELayer(spec, state, plan)  # the reference runner
    ws = Workspace(*(torch.empty(1, dtype=torch.int32) for _ in Workspace._fields))
    with pytest.raises(ValueError, match="moe.runner.* for the triton expert runner"):
        layer.bind_buffers(ModelBuffers(experts=ws))
    with pytest.raises(ValueError, match="attn.decode"):
        TorchAttentionBackend().bind_partials(AttentionPartials(
            part_o=torch.empty(1, 1, 1), part_lse=torch.empty(1, 1)))
    sp = ParallelLayout.from_config(engine_config(**LAYOUTS["sp4"]))
    comm = LayerCommunicator(fake_state(sp, 0), moe=True)
    with pytest.raises(ValueError, match="attn_tp_gather.hidden"):
        comm.bind(GatherBuffers())
    dp = ParallelLayout.from_config(engine_config(**LAYOUTS["dp2_attention"]))
    dp_layer = MoELayer(spec, fake_state(dp, 0), _plan("dp2_attention", "cpu"))
    with pytest.raises(ValueError, match="dp_gather.rows"):
        dp_layer.bind_buffers(ModelBuffers())


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # the plan's device; bound on the CPU
def test_fp8_projections_on_a_gpu_take_the_planned_split_workspace(device):
    """With fp8 projections or fp8 experts on the triton runner (its MMA decode down splits
    a row's pairs into parts), a GPU plan records the split-K workspace (fp8.gemm.*: the most
    partials a decode launch stores on PLANNED_SMS SMs, and the tiles' counters, which the
    binder zeroes); a CPU plan, a bf16 plan and one whose projections and experts are all in
    modules_to_not_convert record none."""
    import dataclasses

    from moeserve.config.quant import QuantSpec
    from moeserve.kernels.attention.tiles import PLANNED_SMS
    from moeserve.kernels.fp8.tiles import MAX_SPLIT_TILES, split_partials_bound

    cfg = engine_config().replace(device=device, gpu_memory_gb=1.0, max_total_tokens=2048)
    spec = tiny_spec("qwen3")
    projections = (r"model\.layers\.\d+\.self_attn", r"model\.layers\.\d+\.mlp\.down_proj",
                   r"model\.layers\.\d+\.mlp\.shared_expert")
    experts = (r"model\.layers\.\d+\.mlp\.experts",)
    for quant, not_converted, records in ((None, (), False), ("fp8", (), device == "cuda"),
                                          (None, projections, device == "cuda"),
                                          (None, projections + experts, False)):
        ckpt = (None if not not_converted
                else QuantSpec(128, 128, from_checkpoint=True, not_converted=not_converted))
        plan = build_plan(cfg.replace(quantization=quant),
                          dataclasses.replace(spec, quant=ckpt))
        assert plan.ok and (plan.quant is None) == (quant is None and ckpt is None), plan.errors
        recs = {r.name: r for r in plan.buffers if r.name.startswith("fp8.gemm.")}
        assert bool(recs) == records, (quant, not_converted, recs)
        bufs = bind_buffers(plan, "cpu")
        assert set(bufs.allocated) == {r.name for r in plan.buffers}
        assert bufs.nbytes == plan.memory.static_buffer_bytes_per_rank + \
            plan.buffer("kv_cache").bytes
        ws = bufs.model.fp8_gemm
        assert (ws is not None) == records
        if records:
            assert recs["fp8.gemm.partials"].shape == (split_partials_bound(PLANNED_SMS),)
            assert ws.partials.dtype == torch.float32 and ws.counters.dtype == torch.int32
            assert ws.counters.shape == (MAX_SPLIT_TILES,) and not ws.counters.any()


def test_the_layers_with_fp8_projections_follow_modules_to_not_convert():
    """plan/memory.fp8_projection_layers (whether a plan records fp8.gemm.*): a layer counts
    while its attention, its dense MLP or its shared expert is fp8. DeepSeek's dense layers
    and shared experts keep theirs when the attention is kept; Qwen3-MoE has neither."""
    from moeserve.config.quant import QuantSpec
    from moeserve.config.spec import load_model_spec
    from moeserve.plan.memory import fp8_projection_layers

    layer = r"model\.layers\.\d+\."
    attn = (layer + "self_attn",)
    everything = attn + (layer + r"mlp\.down_proj", layer + r"mlp\.shared_experts?")
    for name, attention_kept in (("deepseek-v3", 61), ("deepseek-v2-lite", 27),
                                 ("qwen3-30b-a3b", 0)):
        spec = load_model_spec(f"preset:{name}")
        assert fp8_projection_layers(spec, None) == 0
        assert fp8_projection_layers(spec, QuantSpec(128, 128, True)) == spec.num_layers
        assert fp8_projection_layers(spec, QuantSpec(128, 128, True, attn)) == attention_kept
        assert fp8_projection_layers(spec, QuantSpec(128, 128, True, everything)) == 0
