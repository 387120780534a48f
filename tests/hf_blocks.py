"""transformers' MoE blocks and routers for the tiny specs of moe_cases, loaded with the same
weights (the reference the models engineer compares whole models against)."""

from __future__ import annotations

import importlib

import torch
from transformers import AutoConfig

from moe_cases import HF_CONFIGS

# kind -> (model_type, module, block class, router class)
HF_CLASSES = {
    "qwen3": ("qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter"),
    "qwen2": ("qwen2_moe", "Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter"),
    "mixtral": ("mixtral", "MixtralSparseMoeBlock", "MixtralTopKRouter"),
    "olmoe": ("olmoe", "OlmoeSparseMoeBlock", "OlmoeTopKRouter"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2Moe", "DeepseekV2TopkRouter"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3MoE", "DeepseekV3TopkRouter"),
}


def hf_config(kind: str):
    model_type = HF_CLASSES[kind][0]
    kwargs = {k: v for k, v in HF_CONFIGS[kind].items() if k != "architectures"}
    return AutoConfig.for_model(model_type, **kwargs)


def _module(kind: str):
    model_type = HF_CLASSES[kind][0]
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def hf_block(kind: str, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    block = getattr(_module(kind), HF_CLASSES[kind][1])(hf_config(kind)).eval()
    e = HF_CONFIGS[kind].get("n_routed_experts") or HF_CONFIGS[kind].get("num_experts") \
        or HF_CONFIGS[kind]["num_local_experts"]
    state = {}
    for name in block.state_dict():
        if name == "experts.gate_up_proj":
            state[name] = torch.stack([torch.cat([weights[f"experts.{x}.gate_proj.weight"],
                                                  weights[f"experts.{x}.up_proj.weight"]])
                                       for x in range(e)])
        elif name == "experts.down_proj":
            state[name] = torch.stack([weights[f"experts.{x}.down_proj.weight"]
                                       for x in range(e)])
        else:
            state[name] = weights[name]
    block.load_state_dict(state, strict=True)
    return block


def hf_router(kind: str, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    router = getattr(_module(kind), HF_CLASSES[kind][2])(hf_config(kind)).eval()
    with torch.no_grad():
        router.weight.copy_(weights["gate.weight"])
        if "gate.e_score_correction_bias" in weights:
            router.e_score_correction_bias.copy_(weights["gate.e_score_correction_bias"])
    return router
