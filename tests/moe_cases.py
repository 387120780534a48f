"""Shared helpers of the MoE tests: tiny model specs, engine configs, full HF-named weights, and a
float64 single-process reference of the MoE block that shares no code with the layer's
distributed path except expert selection (which test_moe_router checks against transformers).

Imported by spawned ranks too (tests/ is on sys.path under pytest, and spawn passes sys.path).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from moeserve.config import EngineConfig
from moeserve.config.spec import ModelSpec, spec_from_hf_config
from moeserve.parallel.groups import Axis, ParallelState
from moeserve.parallel.layout import ParallelLayout
from moeserve.moe.experts.base import EXPERT_RUNNERS, Experts
from moeserve.moe.router import RoutingConfig, select_experts

H, I_MOE, E = 48, 16, 8

_COMMON = {"hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 4, "head_dim": 12, "vocab_size": 64,
           "intermediate_size": 64, "max_position_embeddings": 256, "torch_dtype": "float32",
           "rms_norm_eps": 1e-6, "hidden_act": "silu"}
_DEEPSEEK = {**_COMMON, "n_routed_experts": E, "n_shared_experts": 2,
             "moe_intermediate_size": I_MOE,
             "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": None,
             "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}

HF_CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen3-MoE: softmax, renormalised top-k, no shared expert
    "qwen3": {**_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": E,
              "num_experts_per_tok": 2, "moe_intermediate_size": I_MOE, "norm_topk_prob": True,
              "mlp_only_layers": [0]},
    # Qwen2-MoE: softmax without renormalisation, a gated shared expert; GeLU to cover it
    "qwen2": {**_COMMON, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": E,
              "num_experts_per_tok": 2, "moe_intermediate_size": I_MOE, "norm_topk_prob": False,
              "shared_expert_intermediate_size": 32, "hidden_act": "gelu"},
    # DeepSeek-V2: softmax, group-limited greedy, routed scaling, 2 shared experts
    "deepseek_v2": {**_DEEPSEEK, "architectures": ["DeepseekV2ForCausalLM"],
                    "num_experts_per_tok": 2, "topk_method": "group_limited_greedy",
                    "n_group": 4, "topk_group": 2, "scoring_func": "softmax",
                    "norm_topk_prob": False, "routed_scaling_factor": 1.5},
    # DeepSeek-V3: sigmoid + correction bias, noaux_tc groups, renormalised then scaled
    "deepseek_v3": {**_DEEPSEEK, "architectures": ["DeepseekV3ForCausalLM"],
                    "num_experts_per_tok": 3, "topk_method": "noaux_tc", "n_group": 4,
                    "topk_group": 2, "scoring_func": "sigmoid", "norm_topk_prob": True,
                    "routed_scaling_factor": 2.5},
    # single-process comparisons only
    "mixtral": {**_COMMON, "architectures": ["MixtralForCausalLM"], "num_local_experts": E,
                "num_experts_per_tok": 2, "intermediate_size": I_MOE},
    "olmoe": {**_COMMON, "architectures": ["OlmoeForCausalLM"], "num_experts": E,
              "num_experts_per_tok": 2, "intermediate_size": I_MOE, "norm_topk_prob": False},
}
SPEC_KINDS = ("qwen3", "qwen2", "deepseek_v2", "deepseek_v3")  # the multi-rank tests run these

# Small bounds: T_max = 32 tokens per DP rank per forward.
T_MAX = 32



def make_spec(e: int = 16, k: int = 4, h: int = 256, i: int = 192, act: str = "silu"):
    """A one-layer Qwen3-MoE spec of these experts, top-k and widths (the kernel tests')."""
    return spec_from_hf_config({
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": h, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 64,
        "intermediate_size": 64, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "hidden_act": act, "num_experts": e, "num_experts_per_tok": k,
        "moe_intermediate_size": i, "norm_topk_prob": True}, name="test")

def tiny_spec(kind: str) -> ModelSpec:
    return spec_from_hf_config(HF_CONFIGS[kind], name=f"tiny-{kind}")


def engine_config(tp: int = 1, dp: int = 1, ep: int = 1, dense_tp: Optional[int] = None,
                  a2a: bool | str = False, a2a_cap: Optional[int] = None,
                  deterministic: bool = False) -> EngineConfig:
    return EngineConfig(
        tp_size=tp, dp_size=dp, enable_dp_attention=dp > 1, ep_size=ep,
        moe_dense_tp_size=dense_tp,
        moe_a2a_backend=a2a if isinstance(a2a, str) else "all_to_all" if a2a else "none",
        moe_a2a_max_tokens_per_rank=a2a_cap, dtype="float32",
        max_prefill_tokens=T_MAX, chunked_prefill_size=T_MAX * dp,
        max_running_requests=8 * dp, cuda_graph_max_bs=8, piecewise_cuda_graph_max_tokens=16,
        enable_deterministic_inference=deterministic)


def full_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint of this MoE block holds, HF names, full (unsharded)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    h, i, e = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    w = {"gate.weight": rnd(e, h, scale=0.3)}
    if spec.scoring == "sigmoid":
        w["gate.e_score_correction_bias"] = rnd(e, scale=0.1)
    for x in range(e):
        w[f"experts.{x}.gate_proj.weight"] = rnd(i, h)
        w[f"experts.{x}.up_proj.weight"] = rnd(i, h)
        w[f"experts.{x}.down_proj.weight"] = rnd(h, i)
    if spec.num_shared_experts:
        prefix = spec.shared_expert_prefix
        s = spec.shared_expert_intermediate_size
        w[f"{prefix}.gate_proj.weight"] = rnd(s, h)
        w[f"{prefix}.up_proj.weight"] = rnd(s, h)
        w[f"{prefix}.down_proj.weight"] = rnd(h, s)
    if spec.shared_expert_gate:
        w["shared_expert_gate.weight"] = rnd(1, h)
    return w


def dense_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i = spec.hidden_size, spec.dense_intermediate_size
    return {"gate_proj.weight": torch.randn(i, h, generator=g) * 0.2,
            "up_proj.weight": torch.randn(i, h, generator=g) * 0.2,
            "down_proj.weight": torch.randn(h, i, generator=g) * 0.2}


def load(module: Any, weights: dict[str, torch.Tensor]) -> list[str]:
    """Load what this rank needs, strictly (the names must be exactly checkpoint_names());
    returns the names it read."""
    assert sorted(weights) == sorted(module.checkpoint_names()), \
        set(weights) ^ set(module.checkpoint_names())
    read = [n for n in weights if module.needs(n)]
    for n in read:
        module.load_weight(n, weights[n])
    return read


def _act(spec: ModelSpec):
    return F.gelu if spec.hidden_act == "gelu" else F.silu


def _mlp64(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
           act) -> torch.Tensor:
    return (act(x @ gate.double().T) * (x @ up.double().T)) @ down.double().T


def reference_route(spec: ModelSpec, weights: dict[str, torch.Tensor], x_TH: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    x = x_TH.double()
    bias = weights.get("gate.e_score_correction_bias")
    return select_experts(x @ weights["gate.weight"].double().T, RoutingConfig.from_spec(spec),
                          None if bias is None else bias.double())


def reference_experts(spec: ModelSpec, weights: dict[str, torch.Tensor], x_TH: torch.Tensor,
                      ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """sum_k w_k expert_{id_k}(x) in float64, one (token, k) at a time; id -1 adds nothing."""
    x, act = x_TH.double(), _act(spec)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids_TK.shape[1]):
            e = int(ids_TK[t, k])
            if e < 0:
                continue
            y = _mlp64(x[t: t + 1], weights[f"experts.{e}.gate_proj.weight"],
                       weights[f"experts.{e}.up_proj.weight"],
                       weights[f"experts.{e}.down_proj.weight"], act)
            out[t] += float(w_TK[t, k]) * y[0]
    return out


def reference_moe(spec: ModelSpec, weights: dict[str, torch.Tensor], x_TH: torch.Tensor
                  ) -> torch.Tensor:
    """The MoE block on one process, float64."""
    ids, w = reference_route(spec, weights, x_TH)
    out = reference_experts(spec, weights, x_TH, ids, w)
    if spec.num_shared_experts:
        x = x_TH.double()
        p = spec.shared_expert_prefix
        shared = _mlp64(x, weights[f"{p}.gate_proj.weight"], weights[f"{p}.up_proj.weight"],
                        weights[f"{p}.down_proj.weight"], _act(spec))
        if spec.shared_expert_gate:
            shared = torch.sigmoid(x @ weights["shared_expert_gate.weight"].double().T) * shared
        out = out + shared
    return out


def reference_dense(spec: ModelSpec, weights: dict[str, torch.Tensor], x_TH: torch.Tensor
                    ) -> torch.Tensor:
    return _mlp64(x_TH.double(), weights["gate_proj.weight"], weights["up_proj.weight"],
                  weights["down_proj.weight"], _act(spec))


def fake_state(layout: ParallelLayout, rank: int) -> ParallelState:
    """What rank `rank` of `layout` sees, without process groups: for building layers and
    loading their weights in one process (any collective on it would fail)."""
    def axis(groups: list[list[int]]) -> Axis:
        ranks = next(g for g in groups if rank in g)
        return Axis(None, ranks.index(rank), len(ranks), tuple(ranks))

    return ParallelState(layout, rank, torch.device("cpu"), axis([list(range(layout.tp))]),
                         axis(layout.attn_tp_groups()), axis(layout.attn_dp_groups()),
                         axis(layout.ep_groups()), axis(layout.moe_tp_groups()), None)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0 if y.numel() == 0 else float("inf")
    scale = ref.double().abs().max().item()
    return (y.double() - ref.double()).abs().max().item() / max(scale, 1e-30)


@EXPERT_RUNNERS.register("identity_for_tests")
class IdentityExperts(Experts):
    """expert(x) = x for every expert: dispatch + combine must return sum_k w_k x. Only moe_tp
    rank 0 contributes, so the moe_tp partial sums add up to one identity."""

    def forward(self, x_NH, topk_ids_NK, topk_weights_NK):
        out = torch.zeros(x_NH.shape, dtype=torch.float64, device=x_NH.device)
        if self.moe_tp_rank == 0:
            row, k, _ = self.local_pairs(topk_ids_NK)
            out.index_add_(0, row, x_NH[row].double() * topk_weights_NK[row, k, None].double())
        return out.to(x_NH.dtype)
