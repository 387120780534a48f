"""OLMoE (OlmoeForCausalLM): RMSNorm over the whole q and k projections (sharded over attn_tp
with an all-reduce of the sum of squares), optional clip_qkv, attention_bias on all four
projections."""

from __future__ import annotations

from typing import Any

from moeserve.models.decoder import AttentionOptions, MoECausalLM
from moeserve.models.decoder import register_model
from moeserve.config.spec import ModelSpec, ModelSpecError


@register_model("OlmoeForCausalLM")
class OlmoeForCausalLM(MoECausalLM):
    @classmethod
    def attention_options(cls, spec: ModelSpec, hf_config: dict[str, Any]) -> AttentionOptions:
        if spec.num_heads * spec.head_dim != spec.hidden_size:
            raise ModelSpecError(
                f"OLMoE normalises q over hidden_size ({spec.hidden_size}) features, so "
                f"heads x head_dim must equal it; config.json gives {spec.num_heads} x "
                f"{spec.head_dim}")
        clip = hf_config.get("clip_qkv")
        return AttentionOptions(qkv_bias=spec.attention_bias, o_bias=spec.attention_bias,
                                qk_norm="full", clip_qkv=None if clip is None else float(clip))
