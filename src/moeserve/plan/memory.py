"""Bytes per rank: weights by layout and KV cache per token."""

from __future__ import annotations

from moeserve.config import EngineConfig
from moeserve.config.spec import ModelSpec
from moeserve.parallel.layout import ParallelLayout

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
GIB = 1024 ** 3
GB = 1000 ** 3


def resolve_dtype(cfg: EngineConfig, spec: ModelSpec) -> str:
    if cfg.dtype != "auto":
        return cfg.dtype
    name = spec.torch_dtype.replace("torch.", "")
    return name if name in DTYPE_BYTES else "bfloat16"


def kv_heads_per_rank(spec: ModelSpec, layout: ParallelLayout) -> int:
    """KV heads split across attn_tp, or replicated when there are fewer heads than ranks."""
    return max(1, spec.num_kv_heads // layout.attn_tp)


def kv_elems_per_token_per_layer(spec: ModelSpec, layout: ParallelLayout) -> int:
    if spec.mla is not None:  # the compressed latent is replicated on every attn_tp rank
        return spec.mla.kv_cache_dim
    return 2 * kv_heads_per_rank(spec, layout) * spec.head_dim


def kv_bytes_per_token(spec: ModelSpec, layout: ParallelLayout, dtype: str) -> int:
    return spec.num_layers * kv_elems_per_token_per_layer(spec, layout) * DTYPE_BYTES[dtype]


def attention_params(spec: ModelSpec, layout: ParallelLayout) -> int:
    h, a = spec.hidden_size, layout.attn_tp
    if spec.mla is not None:
        m, nh = spec.mla, spec.num_heads
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * nh * m.qk_head_dim // a
        else:
            q = h * nh * m.qk_head_dim // a
        kv = h * m.kv_cache_dim + m.kv_lora_rank + m.kv_lora_rank * nh * (
            m.qk_nope_head_dim + m.v_head_dim) // a
        return q + kv + nh * m.v_head_dim * h // a
    q_width = spec.num_heads * spec.head_dim // a
    kv_width = kv_heads_per_rank(spec, layout) * spec.head_dim
    params = h * (q_width + 2 * kv_width) + q_width * h
    if spec.attention_bias:
        params += q_width + 2 * kv_width
    if spec.qk_norm == "per_head":
        params += 2 * spec.head_dim
    elif spec.qk_norm == "full":
        params += q_width + kv_width
    return params


def weight_params_per_rank(spec: ModelSpec, layout: ParallelLayout) -> int:
    """Parameters one rank holds under `layout`."""
    h = spec.hidden_size
    vocab = spec.vocab_size * h // layout.attn_tp
    total = vocab if spec.tie_word_embeddings else 2 * vocab
    total += h  # final norm
    per_layer_common = attention_params(spec, layout) + 2 * h
    experts = (spec.num_experts // layout.ep) * 3 * h * spec.moe_intermediate_size // layout.moe_tp
    router = spec.num_experts * h + (spec.num_experts if spec.scoring == "sigmoid" else 0)
    shared = 3 * h * spec.shared_expert_intermediate_size // layout.shared_expert_tp
    shared += h if spec.shared_expert_gate else 0
    dense = 3 * h * spec.dense_intermediate_size // layout.dense_tp
    n_dense = len(spec.dense_layers)
    total += spec.num_layers * per_layer_common
    total += n_dense * dense + (spec.num_layers - n_dense) * (experts + router + shared)
    return total
