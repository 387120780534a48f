"""Bytes per rank: weights by layout and KV cache per token."""

from __future__ import annotations

from typing import Optional

from moeserve.config import EngineConfig
from moeserve.config.quant import QuantSpec
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


def _fp8_matrices(spec: ModelSpec, layout: ParallelLayout, quant: QuantSpec
                  ) -> list[tuple[int, int, int]]:
    """(count, rows, cols) per rank of every weight that `quant` stores in fp8 (the
    projections models/quant.py names; latent attention's kv_b_proj stays in the model's
    dtype), with modules_to_not_convert applied by module kind per layer."""
    h, a = spec.hidden_size, layout.attn_tp
    mats: list[tuple[int, int, int]] = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        if quant.converts(p + "self_attn.o_proj"):
            if spec.mla is not None:
                m, nh = spec.mla, spec.num_heads
                if m.q_lora_rank:
                    mats += [(1, m.q_lora_rank + m.kv_cache_dim, h),
                             (1, nh * m.qk_head_dim // a, m.q_lora_rank)]
                else:
                    mats.append((1, nh * m.qk_head_dim // a + m.kv_cache_dim, h))
                mats.append((1, h, nh * m.v_head_dim // a))
            else:
                q_width = spec.num_heads * spec.head_dim // a
                kv_width = kv_heads_per_rank(spec, layout) * spec.head_dim
                mats += [(1, q_width + 2 * kv_width, h), (1, h, q_width)]
        if i in spec.dense_layers:
            if quant.converts(p + "mlp.down_proj"):
                i_local = spec.dense_intermediate_size // layout.dense_tp
                mats += [(1, 2 * i_local, h), (1, h, i_local)]
            continue
        if quant.converts(p + "mlp.experts.0.down_proj"):
            i_local = spec.moe_intermediate_size // layout.moe_tp
            e_local = spec.num_experts // layout.ep
            mats += [(e_local, 2 * i_local, h), (e_local, h, i_local)]
        shared = spec.shared_expert_prefix
        if spec.shared_expert_intermediate_size and quant.converts(f"{p}mlp.{shared}.down_proj"):
            i_local = spec.shared_expert_intermediate_size // layout.shared_expert_tp
            mats += [(1, 2 * i_local, h), (1, h, i_local)]
    return mats


def fp8_projection_layers(spec: ModelSpec, quant: Optional[QuantSpec]) -> int:
    """Layers with a projection that runs through the fp8 linear (attention, a dense MLP or
    a shared expert), by modules_to_not_convert as _fp8_matrices applies it."""
    if quant is None:
        return 0
    shared = spec.shared_expert_prefix
    count = 0
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        mlp = (p + "mlp.down_proj" if i in spec.dense_layers
               else f"{p}mlp.{shared}.down_proj" if spec.shared_expert_intermediate_size
               else None)
        count += quant.converts(p + "self_attn.o_proj") or (mlp is not None
                                                          and quant.converts(mlp))
    return count


def fp8_expert_layers(spec: ModelSpec, quant: Optional[QuantSpec]) -> tuple[int, int]:
    """(MoE layers whose routed experts are fp8, MoE layers), by modules_to_not_convert as
    _fp8_matrices applies it."""
    moe = [i for i in range(spec.num_layers) if i not in spec.dense_layers]
    if quant is None:
        return 0, len(moe)
    return sum(quant.converts(f"model.layers.{i}.mlp.experts.0.down_proj") for i in moe), len(moe)


def weight_bytes_per_rank(spec: ModelSpec, layout: ParallelLayout, dtype: str,
                          quant: Optional[QuantSpec] = None) -> int:
    """Bytes of the weights one rank holds: `dtype`, except fp8 weights (a byte each) and their
    float32 block scales."""
    total = weight_params_per_rank(spec, layout) * DTYPE_BYTES[dtype]
    if quant is None:
        return total
    for count, n, k in _fp8_matrices(spec, layout, quant):
        scales = -(-n // quant.block_n) * -(-k // quant.block_k) * 4
        total -= count * (n * k * (DTYPE_BYTES[dtype] - 1) - scales)
    return total
