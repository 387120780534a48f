"""The MoE layer and the dense MLP in one process: against transformers' blocks, weight loading
(sharding by EP and moe_tp, safetensors slices), the expert runner's edge cases, errors."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_blocks import HF_CLASSES, hf_block
from moe_cases import (dense_weights, engine_config, fake_state, full_weights, load,
                       make_spec, reference_dense, reference_experts, rel_err, tiny_spec)
from moeserve.layers.mlp import DenseMLP
from moeserve.moe.dispatch import create_dispatcher
from moeserve.moe.experts import create_experts
from moeserve.moe.layer import MoELayer
from moeserve.layers.weights import WeightError
from moeserve.parallel.groups import single_process_state
from moeserve.parallel.layout import ParallelLayout
from moeserve.testing.tiny_models import exchange_step
from moeserve.plan.capacity import build_plan
from moeserve.plan.memory import weight_params_per_rank
from moeserve.runtime.buffers import bind_model_buffers


def _single(kind: str, **cfg):
    spec = tiny_spec(kind)
    config = engine_config(**cfg)
    plan = build_plan(config, spec)
    assert plan.ok, plan.errors
    return spec, plan, single_process_state(ParallelLayout.from_config(config))


@pytest.mark.parametrize("kind", list(HF_CLASSES))
def test_layer_matches_transformers_block(kind, tmp_path):
    spec, plan, state = _single(kind)
    weights = full_weights(spec, seed=41)
    layer = MoELayer(spec, state, plan)
    # read through safetensors slices, as the loader does
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(layer.checkpoint_names())
        for name in layer.checkpoint_names():
            assert layer.needs(name)
            layer.load_weight(name, f.get_slice(name))
    x = torch.randn(29, spec.hidden_size, generator=torch.Generator().manual_seed(5))
    y = layer(x, exchange_step(29, state, plan))
    with torch.no_grad():
        ref = hf_block(kind, weights)(x[None])[0]
    assert rel_err(y, ref) <= 1e-5


def test_bfloat16_layer_tracks_transformers():
    spec, _, state = _single("qwen3")
    plan = build_plan(engine_config().replace(dtype="bfloat16"), spec)
    weights = full_weights(spec, seed=43)
    layer = MoELayer(spec, state, plan, dtype=torch.bfloat16)
    load(layer, weights)
    x = torch.randn(16, spec.hidden_size).bfloat16()
    y = layer(x, exchange_step(16, state, plan))
    assert y.dtype == torch.bfloat16
    with torch.no_grad():
        ref = hf_block("qwen3", weights).bfloat16()(x[None])[0]
    assert rel_err(y.float(), ref.float()) < 2e-2


def test_padding_rows_contribute_nothing():
    spec, plan, state = _single("qwen3")
    weights = full_weights(spec, seed=47)
    layer = MoELayer(spec, state, plan)
    load(layer, weights)
    x = torch.randn(12, spec.hidden_size)
    x[9:] = 1e30  # whatever a padded graph row holds
    y = layer(x, exchange_step(12, state, plan, num_padding=3))
    assert (y[9:] == 0).all()
    clean = layer(x[:9].clone(), exchange_step(9, state, plan))
    assert torch.equal(y[:9], clean)


@pytest.mark.parametrize("flag", [False, True])
def test_layer_hands_deterministic_inference_to_its_expert_runner(flag):
    spec = tiny_spec("qwen3")
    plan = build_plan(engine_config().replace(enable_deterministic_inference=flag), spec)
    state = single_process_state(ParallelLayout.from_config(plan.config))
    assert MoELayer(spec, state, plan, experts="grouped_mm").experts.deterministic is flag


def test_all_to_all_sum_by_source_adds_in_peer_order():
    """The combine's sum over the peers a token visited: in peer order (deterministic
    inference) bit for bit the sum taken block by block, and the one-launch sum's value;
    empty slots (source m) are dropped."""
    from moeserve.moe.dispatch.all_to_all import sum_by_source

    g = torch.Generator().manual_seed(3)
    m, peers, r, h = 9, 4, 6, 16
    source = torch.full((peers, r), m, dtype=torch.long)
    for q in range(peers):  # each peer block: distinct rows, then empty slots
        rows = torch.randperm(m, generator=g)[: int(torch.randint(0, r + 1, (1,), generator=g))]
        source[q, : rows.numel()] = rows
    back = torch.randn(peers * r, h, generator=g).bfloat16()
    want = torch.zeros(m + 1, h)
    for q in range(peers):
        for s in range(r):
            want[source[q, s]] += back[q * r + s].float()
    got = sum_by_source(back, source.view(-1), m, peers, in_order=True)
    assert got.shape == (m, h) and torch.equal(got, want[:m])
    torch.testing.assert_close(sum_by_source(back, source.view(-1), m, peers, False), got)


def test_reference_experts_with_minus_one_and_duplicate_ids():
    spec, _, state = _single("qwen2")
    weights = full_weights(spec, seed=53)
    experts = create_experts("reference", spec, state)
    for e in range(spec.num_experts):
        for p in ("gate_proj", "up_proj", "down_proj"):
            experts.load_expert(e, p, weights[f"experts.{e}.{p}.weight"])
    x = torch.randn(6, spec.hidden_size)
    ids = torch.tensor([[3, 3], [-1, 2], [-1, -1], [7, 0], [5, 5], [0, -1]], dtype=torch.int32)
    w = torch.rand(6, 2) + 0.1
    y = experts(x, ids, w)
    assert rel_err(y, reference_experts(spec, weights, x, ids, w)) <= 1e-6
    assert (y[2] == 0).all()
    one = experts(x[:1], torch.tensor([[3, -1]], dtype=torch.int32), w[:1].sum(1, keepdim=True)
                  .expand(1, 2).contiguous())
    torch.testing.assert_close(y[0], one[0])  # [3, 3] with w1, w2 == [3] with w1 + w2


@pytest.mark.parametrize("rank", [0, 3])
def test_weights_shard_by_ep_and_moe_tp(rank):
    """tp=4, ep=2, moe_tp=2: rank r holds experts of EP rank r//2, intermediate rows of moe_tp
    rank r%2; it reads nothing else."""
    spec = tiny_spec("qwen2")
    lay = ParallelLayout(tp=4, dp=1, ep=2, dense_tp=4, a2a=False)
    state = fake_state(lay, rank)
    plan = build_plan(engine_config(tp=4, ep=2), spec)
    layer = MoELayer(spec, state, plan)
    weights = full_weights(spec, seed=59)
    read = load(layer, weights)
    ep_rank, t = rank // 2, rank % 2
    mine = range(4 * ep_rank, 4 * ep_rank + 4)
    assert {int(n.split(".")[1]) for n in read if n.startswith("experts.")} == set(mine)
    assert not any(layer.needs(f"experts.{e}.up_proj.weight") for e in range(8) if e not in mine)
    i = slice(8 * t, 8 * t + 8)
    for local, e in enumerate(mine):
        w13, w2 = layer.experts.w13[local], layer.experts.w2[local]
        assert torch.equal(w13[:8], weights[f"experts.{e}.gate_proj.weight"][i])
        assert torch.equal(w13[8:], weights[f"experts.{e}.up_proj.weight"][i])
        assert torch.equal(w2, weights[f"experts.{e}.down_proj.weight"][:, i])
    # the shared expert is split over the 4 ranks (gather path, dense MLPs split)
    s = slice(8 * rank, 8 * rank + 8)
    gate_up = layer.shared_expert.gate_up.weight
    assert torch.equal(gate_up[:8], weights["shared_expert.gate_proj.weight"][s])
    assert torch.equal(layer.shared_expert.down.weight,
                       weights["shared_expert.down_proj.weight"][:, s])


@pytest.mark.parametrize("kind", ["qwen2", "deepseek_v3"])
@pytest.mark.parametrize("cfg", [dict(tp=4, ep=2), dict(tp=4, ep=4, a2a=True),
                                 dict(tp=4, ep=4, dense_tp=1), dict(tp=4, dp=2, ep=4)])
def test_parameters_per_rank_match_the_plan_memory_count(kind, cfg):
    """plan/memory.py counts the MoE layer's weights per rank with the same sharding (shared
    experts split over layout.shared_expert_tp)."""
    spec = tiny_spec(kind)
    config = engine_config(**cfg)
    lay = ParallelLayout.from_config(config)
    layer = MoELayer(spec, fake_state(lay, 1), build_plan(config, spec))
    dense_spec = spec.__class__(**{**spec.__dict__, "dense_layers": tuple(range(spec.num_layers))})
    per_moe_layer = (weight_params_per_rank(spec, lay) - weight_params_per_rank(dense_spec, lay)
                     + 3 * spec.hidden_size * spec.dense_intermediate_size // lay.dense_tp
                     * len(spec.moe_layers)) // len(spec.moe_layers)
    assert sum(p.numel() for p in layer.parameters()) == per_moe_layer


def test_dense_mlp_matches_reference_and_transformers():
    spec, plan, state = _single("qwen2")
    weights = dense_weights(spec, seed=61)
    mlp = DenseMLP(spec, state)
    load(mlp, weights)
    x = torch.randn(9, spec.hidden_size)
    y = mlp(x, exchange_step(9, state, plan))
    assert rel_err(y, reference_dense(spec, weights, x)) <= 1e-6
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP
    from hf_blocks import hf_config
    hf = Qwen2MoeMLP(hf_config("qwen2"))
    hf.load_state_dict(weights)
    with torch.no_grad():
        assert rel_err(y, hf(x)) <= 1e-6


def test_checkpoint_names_by_architecture():
    for kind, prefix in [("qwen2", "shared_expert."), ("deepseek_v3", "shared_experts.")]:
        spec, plan, state = _single(kind)
        names = MoELayer(spec, state, plan).checkpoint_names()
        assert sum(n.startswith(prefix) for n in names) == 3
        assert len([n for n in names if n.startswith("experts.")]) == 3 * spec.num_experts
        assert ("gate.e_score_correction_bias" in names) == (kind == "deepseek_v3")
        assert ("shared_expert_gate.weight" in names) == (kind == "qwen2")


def test_weight_errors_name_the_tensor():
    spec, plan, state = _single("qwen3")
    layer = MoELayer(spec, state, plan)
    with pytest.raises(WeightError, match="expected \\[16, 48\\]"):
        layer.load_weight("experts.0.gate_proj.weight", torch.zeros(16, 47))
    with pytest.raises(WeightError, match="no checkpoint tensor 'shared_expert.up_proj"):
        layer.load_weight("shared_expert.up_proj.weight", torch.zeros(16, 48))
    with pytest.raises(WeightError, match="no checkpoint tensor"):
        layer.load_weight("experts.8.gate_proj.weight", torch.zeros(16, 48))
    assert not layer.needs("experts.8.gate_proj.weight") and not layer.needs("bogus")


def test_wrong_components_are_refused_with_the_flag():
    spec, plan, state = _single("qwen3")
    with pytest.raises(ValueError, match="unknown MoE dispatcher"):
        create_dispatcher(spec, state, plan, name="nccl_magic")
    with pytest.raises(ValueError, match="unknown expert runner"):
        create_experts("triton_someday", spec, state)
    with pytest.raises(ValueError, match="--moe-a2a-backend all_to_all"):
        create_dispatcher(spec, state, plan, name="all_to_all")
    a2a_cfg = engine_config(tp=2, ep=2, a2a=True)
    a2a_plan = build_plan(a2a_cfg, spec)
    a2a_state = fake_state(ParallelLayout.from_config(a2a_cfg), 0)
    bf16 = create_dispatcher(spec, a2a_state, a2a_plan, torch.bfloat16)
    with pytest.raises(ValueError, match="--dtype bfloat16"):  # the plan's float32 workspace
        bf16.bind(bind_model_buffers(a2a_plan, "cpu"))
    with pytest.raises(ValueError, match="serves one rank"):
        create_dispatcher(spec, a2a_state, a2a_plan, name="local")


@pytest.mark.parametrize("kind", list(HF_CLASSES))
def test_layer_leaves_the_top_k_sum_to_a_combine_that_sums_it(kind, monkeypatch):
    """Where the dispatcher's combine takes the experts' unsummed pair rows (sums_topk_rows:
    nvlink, whose push sums them), the layer lets its experts leave the top-k sum, whatever
    its caller's pending_ok; never with shared experts, which add to the summed rows; and
    the layer's output is the same."""
    spec, plan, state = _single(kind)
    layer = MoELayer(spec, state, plan)
    load(layer, full_weights(spec, seed=43))
    seen = []
    forward = layer.experts.forward

    def spy(*args, pending_ok=False):
        seen.append(pending_ok)
        return forward(*args, pending_ok=pending_ok)

    monkeypatch.setattr(layer.experts, "forward", spy)
    x = torch.randn(5, spec.hidden_size, generator=torch.Generator().manual_seed(5))
    want = layer(x, exchange_step(5, state, plan))
    monkeypatch.setattr(type(layer.dispatcher), "sums_topk_rows", True)
    got = layer(x, exchange_step(5, state, plan))
    assert seen == [False, not spec.num_shared_experts]
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(HF_CLASSES))
@pytest.mark.parametrize("n", [1, 3, 29])
def test_triton_layer_matches_reference_layer_on_gpu(kind, n):
    """bf16 layer on the triton runner (at 1-3 rows the GEMV kernels) against the same bf16
    layer on the reference runner: the same router code, so the same experts; only the expert
    arithmetic differs. With pending_ok its top-k sum goes to the norm after it (29 rows, no
    shared experts), with the same bits."""
    spec, plan, state = _single(kind)
    weights = full_weights(spec, seed=47)
    layers = {}
    for runner in ("triton", "reference"):
        with torch.device("cuda"):
            layers[runner] = MoELayer(spec, state, plan, dtype=torch.bfloat16, experts=runner)
        load(layers[runner], weights)
    x = torch.randn(n, spec.hidden_size, generator=torch.Generator().manual_seed(n))
    x = x.cuda().bfloat16()
    y, want = (layers[r](x, exchange_step(n, state, plan)) for r in ("triton", "reference"))
    assert y.dtype == torch.bfloat16
    assert rel_err(y.float(), want.float()) < 1e-2
    # the block's last sum left to the norm after it (at 29 rows the top-k pass is the
    # norm's launch): the bits of the sum and then add_forward
    from moeserve.kernels.moe.fused_moe import leaves_topk_sum
    from moeserve.layers.norm import RMSNorm
    from moeserve.layers.pending import TopkRows, add_norm

    pending = layers["triton"](x, exchange_step(n, state, plan), pending_ok=True)
    cfg = layers["triton"].experts.config_for(n, x.device)
    assert isinstance(pending, TopkRows) == (leaves_topk_sum(cfg)
                                             and not spec.num_shared_experts)
    assert isinstance(pending, TopkRows) or n < 29 or spec.num_shared_experts
    norm = RMSNorm(spec.hidden_size, 1e-6, torch.bfloat16).cuda()
    norm.weight.data.uniform_(0.5, 1.5)
    res = torch.randn_like(x)
    got, want = add_norm(norm, pending, res), norm.add_forward(y, res)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_fp8_router_quantizes_only_rows_that_reach_the_experts_as_they_are():
    """The router's launch is asked to quantize into the plan's moe.runner.input only where
    the dispatcher hands the experts the layer's own rows (one rank); a CPU router never
    does, and says so."""
    from moeserve.config import EngineConfig
    from moeserve.config.quant import QuantSpec
    spec = make_spec(e=8, k=2, h=256, i=128)
    quant = QuantSpec(128, 128, from_checkpoint=False)
    flags = dict(model="preset:tiny", gpu_memory_gb=8, moe_runner_backend="triton",
                 device="cuda", quantization="fp8", dtype="bfloat16")
    config = EngineConfig(**flags)
    plan = build_plan(config, spec)
    state = single_process_state(ParallelLayout.from_config(config))
    layer = MoELayer(spec, state, plan, dtype=torch.bfloat16, experts="triton", quant=quant)
    assert layer._input_quant(3) is None  # no buffers bound yet
    layer.bind_buffers(bind_model_buffers(plan, "cpu"))
    group, rows, scales = layer._input_quant(3)
    ws = layer.experts.workspace
    assert group == 128 and rows.shape == (3, 256) and scales.shape == (3, 2)
    assert rows.data_ptr() == ws.input.data_ptr()
    assert scales.data_ptr() == ws.input_scale.data_ptr()
    x = torch.randn(3, 256).bfloat16()
    ids, weights, quantized = layer.gate.route(x, 3, (group, rows, scales))
    assert not quantized and ids.shape == (3, 2)
    gather = EngineConfig(**flags, tp_size=2, ep_size=2)
    gather_plan = build_plan(gather, spec)
    rank = fake_state(ParallelLayout.from_config(gather), 0)
    other = MoELayer(spec, rank, gather_plan, dtype=torch.bfloat16, experts="triton",
                     quant=quant)
    other.bind_buffers(bind_model_buffers(gather_plan, "cpu"))
    assert not other.dispatcher.passes_rows and other._input_quant(3) is None


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3])
def test_fp8_layer_takes_the_rows_the_router_quantized(n):
    """fp8 experts on one GPU: the router's top-k launch quantizes the rows into the plan's
    moe.runner.input (the experts then launch no quantizer), and the layer's output is the
    one the experts' own quantizing gives, bit for bit."""
    from moeserve.config import EngineConfig
    from moeserve.config.quant import QuantSpec
    from moeserve.kernels.fp8 import gemm

    spec = make_spec(e=8, k=2, h=256, i=128)  # whole 128-wide scale blocks
    config = EngineConfig(model="preset:tiny", gpu_memory_gb=8, moe_runner_backend="triton",
                          device="cuda", quantization="fp8", dtype="bfloat16")
    plan = build_plan(config, spec)
    state = single_process_state(ParallelLayout.from_config(config))
    with torch.device("cuda"):
        layer = MoELayer(spec, state, plan, dtype=torch.bfloat16, experts="triton",
                         quant=QuantSpec(128, 128, from_checkpoint=False))
    load(layer, full_weights(spec, seed=5))
    layer.bind_buffers(bind_model_buffers(plan, "cuda"))
    x = torch.randn(n, spec.hidden_size, generator=torch.Generator().manual_seed(n))
    x = x.cuda().bfloat16()
    ws = layer.experts.workspace
    ws.input.zero_()
    y = layer(x, exchange_step(n, state, plan))
    want_q, want_s = gemm.quantize_groups(x, 128)
    assert torch.equal(ws.input[:n].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(ws.input_scale[:n], want_s)
    layer._input_quant = lambda rows: None  # the experts quantize the rows themselves
    assert torch.equal(layer(x, exchange_step(n, state, plan)), y)
