"""An architecture-neutral model shape, read from a Hugging Face config.json or a preset.

Shape legend used across moeserve: T tokens, H hidden, E experts, K top-k, I expert
intermediate size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from moeserve.config.presets import PRESETS
from moeserve.config.quant import QuantizationError, QuantSpec, checkpoint_quant


class ModelSpecError(ValueError):
    """The model cannot be read or is not supported; the message lists what is."""


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek multi-head latent attention dims."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per-token, per-layer cache width: the compressed KV plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    # MoE
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_shared_experts: int
    shared_expert_intermediate_size: int  # the width of all shared experts together
    shared_expert_gate: bool  # Qwen2-MoE's sigmoid gate on the shared expert
    dense_intermediate_size: int  # the MLP of dense (non-MoE) layers
    dense_layers: tuple[int, ...]
    # routing
    scoring: str  # "softmax" or "sigmoid"
    topk_method: str  # "greedy", "group_limited_greedy" or "noaux_tc"
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # attention details
    mla: Optional[MLASpec]
    qk_norm: str  # "none", "per_head" (Qwen3-MoE) or "full" (OLMoE)
    attention_bias: bool
    rope_theta: float
    rope_scaling: Optional[tuple[tuple[str, Any], ...]]
    rms_norm_eps: float
    hidden_act: str
    torch_dtype: str
    # the checkpoint's own weight quantization (config.json's quantization_config)
    quant: Optional[QuantSpec] = None

    @property
    def moe_layers(self) -> tuple[int, ...]:
        dense = set(self.dense_layers)
        return tuple(i for i in range(self.num_layers) if i not in dense)

    @property
    def shared_expert_prefix(self) -> str:
        """Checkpoint prefix of the shared experts under `mlp.`: DeepSeek's is plural."""
        return ("shared_experts" if self.architecture.startswith("Deepseek")
                else "shared_expert")

    @property
    def rope_scaling_dict(self) -> Optional[dict[str, Any]]:
        return dict(self.rope_scaling) if self.rope_scaling else None


SUPPORTED_ARCHITECTURES = (
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _rope(cfg: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """rope theta and scaling, from transformers 4's rope_theta/rope_scaling or 5's
    rope_parameters; scaling is None for plain rope."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    kind = params.get("rope_type", params.get("type", "default"))
    return theta, (params if kind not in ("default", None) else None)


def spec_from_hf_config(cfg: dict[str, Any], name: str = "") -> ModelSpec:
    """Read an HF config.json dict of one of SUPPORTED_ARCHITECTURES into a ModelSpec."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelSpecError(
            f"unsupported architecture {archs or '(none given)'} in {name or 'config.json'}; "
            f"moeserve supports: {', '.join(SUPPORTED_ARCHITECTURES)}")
    g = cfg.get
    try:
        quant = checkpoint_quant(cfg)
    except QuantizationError as exc:
        raise ModelSpecError(f"{name or 'config.json'}: {exc}") from exc
    rope_theta, rope_scaling = _rope(cfg)
    hidden, heads, layers = g("hidden_size"), g("num_attention_heads"), g("num_hidden_layers")
    common = dict(
        name=name or g("_name_or_path") or arch, architecture=arch, hidden_size=hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=g("num_key_value_heads") or heads,
        head_dim=g("head_dim") or hidden // heads, vocab_size=g("vocab_size"),
        max_position_embeddings=g("max_position_embeddings", 2048),
        tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        rope_theta=rope_theta, rope_scaling=_freeze(rope_scaling) if rope_scaling else None,
        rms_norm_eps=float(g("rms_norm_eps", 1e-6)), hidden_act=g("hidden_act", "silu"),
        torch_dtype=str(g("torch_dtype") or g("dtype") or "bfloat16"),
        num_shared_experts=0, shared_expert_intermediate_size=0, shared_expert_gate=False,
        scoring="softmax", topk_method="greedy", n_group=1, topk_group=1,
        routed_scaling_factor=1.0, mla=None, qk_norm="none", attention_bias=False,
        quant=quant,
    )
    if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        step = g("decoder_sparse_step", 1) or 1
        only = set(g("mlp_only_layers") or [])
        num_experts = g("num_experts") or g("num_local_experts")
        dense = tuple(i for i in range(layers)
                      if i in only or not num_experts or (i + 1) % step != 0)
        shared = g("shared_expert_intermediate_size") or 0
        return ModelSpec(
            **{**common, "qk_norm": "per_head" if arch == "Qwen3MoeForCausalLM" else "none",
               "attention_bias": bool(g("qkv_bias", True)) if arch == "Qwen2MoeForCausalLM"
               else bool(g("attention_bias", False)),
               "num_shared_experts": 1 if shared else 0,
               "shared_expert_intermediate_size": shared, "shared_expert_gate": bool(shared)},
            num_experts=num_experts, top_k=g("num_experts_per_tok"),
            moe_intermediate_size=g("moe_intermediate_size"),
            dense_intermediate_size=g("intermediate_size"), dense_layers=dense,
            norm_topk_prob=bool(g("norm_topk_prob", False)))
    if arch == "MixtralForCausalLM":
        return ModelSpec(**common, num_experts=g("num_local_experts"),
                         top_k=g("num_experts_per_tok"), moe_intermediate_size=g("intermediate_size"),
                         dense_intermediate_size=g("intermediate_size"), dense_layers=(),
                         norm_topk_prob=True)
    if arch == "OlmoeForCausalLM":
        return ModelSpec(**{**common, "qk_norm": "full",
                            "attention_bias": bool(g("attention_bias", False))},
                         num_experts=g("num_experts"), top_k=g("num_experts_per_tok"),
                         moe_intermediate_size=g("intermediate_size"),
                         dense_intermediate_size=g("intermediate_size"), dense_layers=(),
                         norm_topk_prob=bool(g("norm_topk_prob", False)))
    # DeepSeek-V2 / V3
    first_dense = g("first_k_dense_replace", 0) or 0
    freq = g("moe_layer_freq", 1) or 1
    n_routed = g("n_routed_experts")
    dense = tuple(i for i in range(layers)
                  if not n_routed or i < first_dense or i % freq != 0)
    n_shared = g("n_shared_experts") or 0
    mla = MLASpec(q_lora_rank=g("q_lora_rank"), kv_lora_rank=g("kv_lora_rank"),
                  qk_nope_head_dim=g("qk_nope_head_dim"), qk_rope_head_dim=g("qk_rope_head_dim"),
                  v_head_dim=g("v_head_dim"))
    v3 = arch == "DeepseekV3ForCausalLM"
    return ModelSpec(
        **{**common, "head_dim": mla.qk_head_dim, "mla": mla,
           "num_shared_experts": n_shared,
           "shared_expert_intermediate_size": n_shared * g("moe_intermediate_size"),
           "scoring": g("scoring_func", "sigmoid" if v3 else "softmax"),
           "topk_method": g("topk_method", "noaux_tc" if v3 else "greedy"),
           "n_group": g("n_group") or 1, "topk_group": g("topk_group") or 1,
           "routed_scaling_factor": float(g("routed_scaling_factor", 1.0) or 1.0),
           "attention_bias": bool(g("attention_bias", False))},
        num_experts=n_routed, top_k=g("num_experts_per_tok"),
        moe_intermediate_size=g("moe_intermediate_size"),
        dense_intermediate_size=g("intermediate_size"), dense_layers=dense,
        norm_topk_prob=bool(g("norm_topk_prob", False)))


def load_hf_config(model: str) -> dict[str, Any]:
    """The config.json dict of `model`: a checkpoint folder, a config.json path, or preset:NAME."""
    if model.startswith("preset:"):
        key = model.split(":", 1)[1]
        if key not in PRESETS:
            raise ModelSpecError(f"unknown preset {key!r}; presets: {', '.join(sorted(PRESETS))}")
        return dict(PRESETS[key])
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ModelSpecError(
            f"model {model!r} not found: give a checkpoint folder with a config.json, or "
            f"preset:NAME with NAME one of {', '.join(sorted(PRESETS))}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelSpecError(f"{path} is not valid JSON: {exc}") from exc


def load_model_spec(model: str) -> ModelSpec:
    name = model.split(":", 1)[1] if model.startswith("preset:") else model
    return spec_from_hf_config(load_hf_config(model), name=name)
