"""Qwen2-MoE / Qwen1.5-MoE (Qwen2MoeForCausalLM): biases on q, k and v only (`qkv_bias`), a
shared expert with a sigmoid gate beside the routed experts (the MoE layer owns both), dense
MLP layers where `mlp_only_layers` / `decoder_sparse_step` put them."""

from __future__ import annotations

from typing import Any

from moeserve.models.decoder import AttentionOptions, MoECausalLM, refuse_sliding_window
from moeserve.models.decoder import register_model
from moeserve.config.spec import ModelSpec


@register_model("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(MoECausalLM):
    @classmethod
    def attention_options(cls, spec: ModelSpec, hf_config: dict[str, Any]) -> AttentionOptions:
        refuse_sliding_window(cls.architecture, hf_config)
        return AttentionOptions(qkv_bias=spec.attention_bias, o_bias=False)
