"""DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM).

Both are the shared decoder with multi-head latent attention (layers/mla.py) in place of GQA:
  - MoE layers from `first_k_dense_replace` on (every `moe_layer_freq`-th), dense MLPs before;
    routed experts plus `n_shared_experts` shared experts (the MoE layer's `shared_experts`);
  - V2 routing: softmax scores, "greedy" or "group_limited_greedy" top-k, times
    routed_scaling_factor; V3: sigmoid scores, choice by scores + e_score_correction_bias over
    the topk_group best of n_group groups ("noaux_tc"), renormalised, times the factor
    (moe/router.py implements both);
  - rope on the qk_rope_head_dim dims only, in DeepSeek's interleaved pairs (V2 always, V3
    unless rope_interleave is false), yarn with mscale.

Checkpoints use transformers' names (per-expert tensors as on the Hub, or fused experts as
transformers 5 keeps them in memory: the loader reads both). DeepSeek-V3 checkpoints on the
Hub also hold the multi-token-prediction (MTP) module, `num_nextn_predict_layers` extra layers
stored as model.layers.{num_hidden_layers + i}.*; moeserve does no speculative decoding with
it, so those tensors are skipped by name (the loader never reads them).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from torch import nn

from moeserve.layers.attention import AttentionBackend
from moeserve.layers.backends import mla_backend_for
from moeserve.layers.mla import MLAttention
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.decoder import MoECausalLM
from moeserve.models.decoder import register_model
from moeserve.config.spec import ModelSpecError

_LAYER = re.compile(r"model\.layers\.(\d+)\..+")


class _DeepseekCausalLM(MoECausalLM):
    """What V2 and V3 share; `interleaved_rope` is the one attention switch between them."""

    @classmethod
    def interleaved_rope(cls, hf_config: dict[str, Any]) -> bool:
        raise NotImplementedError

    def attention_factory(self, hf_config: dict[str, Any], backend: AttentionBackend
                          ) -> Callable[[int], nn.Module]:
        spec = self.spec
        if spec.mla is None or None in (spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim,
                                        spec.mla.qk_nope_head_dim, spec.mla.v_head_dim):
            raise ModelSpecError(f"{self.architecture} needs kv_lora_rank, qk_rope_head_dim, "
                                 "qk_nope_head_dim and v_head_dim in config.json")
        if hf_config.get("mlp_bias"):
            raise ModelSpecError(f"{self.architecture} with mlp_bias=true is not supported; "
                                 "DeepSeek checkpoints have no MLP biases")
        self.num_mtp_layers = int(hf_config.get("num_nextn_predict_layers") or 0)
        self.rotary = RotaryEmbedding(spec.mla.qk_rope_head_dim, spec.rope_theta,
                                      spec.rope_scaling_dict, spec.max_position_embeddings)
        mla_backend = mla_backend_for(backend)
        self.attention_backend = mla_backend
        interleaved = self.interleaved_rope(hf_config)
        return lambda i: MLAttention(spec, self.state, i, self.dtype, self.rotary, mla_backend,
                                     interleaved_rope=interleaved,
                                     quant=self.attention_quant(i))

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        # the MTP layers that follow the decoder layers (see the module docstring)
        m = _LAYER.fullmatch(name)
        n = self.spec.num_layers
        return m is not None and n <= int(m.group(1)) < n + self.num_mtp_layers


@register_model("DeepseekV2ForCausalLM")
class DeepseekV2ForCausalLM(_DeepseekCausalLM):
    @classmethod
    def interleaved_rope(cls, hf_config: dict[str, Any]) -> bool:
        return True  # transformers' V2 rotates complex pairs; it has no neox-style option


@register_model("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(_DeepseekCausalLM):
    @classmethod
    def interleaved_rope(cls, hf_config: dict[str, Any]) -> bool:
        return bool(hf_config.get("rope_interleave", True))
