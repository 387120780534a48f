"""The router against transformers' routers, for every scoring / top-k method we support."""

from __future__ import annotations

import pytest
import torch

from hf_blocks import HF_CLASSES, hf_router
from moe_cases import full_weights, tiny_spec
from moeserve.moe.router import Router, RoutingConfig, select_experts


def _sorted_by_id(ids: torch.Tensor, weights: torch.Tensor):
    order = ids.long().argsort(dim=1)
    return ids.long().gather(1, order), weights.float().gather(1, order)


@pytest.mark.parametrize("kind", list(HF_CLASSES))
def test_router_matches_transformers(kind):
    spec = tiny_spec(kind)
    weights = full_weights(spec, seed=31)
    router = Router(spec)
    for name in router.checkpoint_names():
        router.load_weight(name, weights[f"gate.{name}"])
    x = torch.randn(300, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    ids, w = router(x)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    _, hf_w, hf_ids = hf_router(kind, weights)(x)
    ids_s, w_s = _sorted_by_id(ids, w)
    hf_ids_s, hf_w_s = _sorted_by_id(hf_ids, hf_w)
    assert torch.equal(ids_s, hf_ids_s)
    torch.testing.assert_close(w_s, hf_w_s, rtol=1e-6, atol=1e-7)
    assert (ids_s[:, 1:] != ids_s[:, :-1]).all()  # no duplicate expert within a row


def test_grouped_choice_stays_inside_the_best_groups():
    spec = tiny_spec("deepseek_v3")
    cfg = RoutingConfig.from_spec(spec)
    logits = torch.randn(500, spec.num_experts, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(spec.num_experts, generator=torch.Generator().manual_seed(3)) * 0.1
    ids, w = select_experts(logits, cfg, bias)
    per = spec.num_experts // cfg.n_group

    def groups_used(chosen: torch.Tensor) -> torch.Tensor:
        groups = (chosen.long() // per).sort(dim=1).values
        return 1 + (groups[:, 1:] != groups[:, :-1]).sum(dim=1)

    assert (groups_used(ids) <= cfg.topk_group).all()
    unrestricted = (logits.sigmoid() + bias).topk(cfg.top_k, dim=1)[1]
    assert (groups_used(unrestricted) > cfg.topk_group).any()  # the restriction matters here
    # weights come from the unbiased scores: renormalised, then scaled
    torch.testing.assert_close(w.sum(dim=1), torch.full((500,), cfg.routed_scaling_factor))


def test_padding_rows_get_minus_one_and_zero_weight():
    spec = tiny_spec("qwen3")
    cfg = RoutingConfig.from_spec(spec)
    logits = torch.randn(10, spec.num_experts)
    ids, w = select_experts(logits, cfg, num_valid=7)
    assert (ids[7:] == -1).all() and (w[7:] == 0).all()
    assert (ids[:7] >= 0).all() and (w[:7] > 0).all()


@pytest.mark.parametrize("change, message", [
    (dict(topk_method="random"), "topk_method"), (dict(scoring="relu"), "scoring_func"),
    (dict(top_k=9), "num_experts_per_tok"),
    (dict(topk_method="noaux_tc", n_group=3), "n_group"),
])
def test_unsupported_routing_is_refused(change, message):
    base = RoutingConfig(8, 2, "softmax", "greedy", 1, 1, False, 1.0)
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**{**base.__dict__, **change}).validate()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3", "mixtral", "deepseek_v2"])
@pytest.mark.parametrize("m", [1, 3, 4, 16])
def test_router_on_gpu_matches_the_router_on_cpu(kind, m):
    """Logits by the skinny kernel (DeepSeek's fp32 ones up to 64 rows) and the top-k kernel:
    the CPU router's choice and weights."""
    spec = tiny_spec(kind)
    cpu = Router(spec, torch.bfloat16)
    cpu.weight.data = torch.randn(cpu.weight.shape, generator=torch.Generator().manual_seed(m)
                                  ).bfloat16()
    gpu = Router(spec, torch.bfloat16).cuda()
    gpu.weight.data = cpu.weight.data.cuda()
    x = torch.randn(m, spec.hidden_size, generator=torch.Generator().manual_seed(7)).bfloat16()
    valid = max(1, m - 1)
    ids, w = gpu(x.cuda(), valid)
    want_ids, want_w = cpu(x, valid)
    order, want_order = ids.cpu().sort(dim=1)[1], want_ids.sort(dim=1)[1]
    assert torch.equal(ids.cpu().gather(1, order), want_ids.gather(1, want_order))
    assert torch.allclose(w.cpu().gather(1, order), want_w.gather(1, want_order), atol=1e-2)
