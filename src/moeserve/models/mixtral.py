"""Mixtral (MixtralForCausalLM): plain GQA attention, every layer a MoE layer, an optional
sliding window. Its checkpoints name the MoE block `block_sparse_moe` and the experts' weights
w1 (gate), w3 (up), w2 (down); they are renamed to the canonical names on the way in."""

from __future__ import annotations

import re
from typing import Any

from moeserve.models.decoder import AttentionOptions, MoECausalLM
from moeserve.models.decoder import register_model
from moeserve.config.spec import ModelSpec

_W_TO_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_PROJ_TO_W = {v: k for k, v in _W_TO_PROJ.items()}
_EXPERT = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_CANON_EXPERT = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight")


@register_model("MixtralForCausalLM")
class MixtralForCausalLM(MoECausalLM):
    @classmethod
    def attention_options(cls, spec: ModelSpec, hf_config: dict[str, Any]) -> AttentionOptions:
        window = hf_config.get("sliding_window")
        return AttentionOptions(sliding_window=int(window) if window else None)

    @classmethod
    def to_canonical(cls, name: str) -> str:
        m = _EXPERT.fullmatch(name)
        if m:
            return f"{m.group(1)}.mlp.experts.{m.group(2)}.{_W_TO_PROJ[m.group(3)]}.weight"
        # the router, and the fused expert tensors transformers 5 keeps under "mlp."
        return name.replace(".block_sparse_moe.", ".mlp.")

    @classmethod
    def from_canonical(cls, name: str) -> str:
        m = _CANON_EXPERT.fullmatch(name)
        if m and m.group(3) in _PROJ_TO_W:
            return (f"{m.group(1)}.block_sparse_moe.experts.{m.group(2)}."
                    f"{_PROJ_TO_W[m.group(3)]}.weight")
        return name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
