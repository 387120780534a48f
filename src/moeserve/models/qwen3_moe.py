"""Qwen3-MoE (Qwen3MoeForCausalLM): per-head RMSNorm on q and k, attention_bias on all four
projections, dense MLP layers where `mlp_only_layers` / `decoder_sparse_step` put them."""

from __future__ import annotations

from typing import Any

from moeserve.models.decoder import AttentionOptions, MoECausalLM, refuse_sliding_window
from moeserve.models.decoder import register_model
from moeserve.config.spec import ModelSpec


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(MoECausalLM):
    @classmethod
    def attention_options(cls, spec: ModelSpec, hf_config: dict[str, Any]) -> AttentionOptions:
        refuse_sliding_window(cls.architecture, hf_config)
        return AttentionOptions(qkv_bias=spec.attention_bias, o_bias=spec.attention_bias,
                                qk_norm="per_head")
