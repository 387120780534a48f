"""The real shapes of well-known MoE models, as the config.json their checkpoints ship.

They go through the same reader as a checkpoint's config.json; `preset:NAME` picks one.
`tiny` is a Qwen3-MoE small enough to run on a CPU.
"""

from __future__ import annotations

from typing import Any

_BF16 = {"hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

_QWEN3_MOE = {
    **_BF16, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "attention_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    "vocab_size": 151936, "head_dim": 128, "max_position_embeddings": 40960, "num_experts": 128,
    "num_experts_per_tok": 8,
}

_DEEPSEEK = {
    **_BF16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "moe_layer_freq": 1,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "attention_bias": False,
}


def _yarn(mscale: float) -> dict[str, Any]:
    return {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale}


def _dims(hidden: int, layers: int, heads: int, kv_heads: int, dense_inter: int
          ) -> dict[str, int]:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": dense_inter}


PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {**_QWEN3_MOE, **_dims(2048, 48, 32, 4, 6144), "moe_intermediate_size": 768},
    "qwen3-235b-a22b": {**_QWEN3_MOE, **_dims(4096, 94, 64, 4, 12288),
                        "moe_intermediate_size": 1536},
    "mixtral-8x7b": {
        **_BF16, **_dims(4096, 32, 32, 8, 14336), "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
    },
    "olmoe-1b-7b": {
        **_BF16, **_dims(2048, 16, 16, 16, 1024), "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe", "num_experts": 64, "num_experts_per_tok": 8, "vocab_size": 50304,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "norm_topk_prob": False, "attention_bias": False,
    },
    "qwen1.5-moe-a2.7b": {
        **_BF16, **_dims(2048, 24, 16, 16, 5632), "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe", "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
        "vocab_size": 151936, "max_position_embeddings": 8192, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
    },
    "deepseek-v2-lite": {
        **_DEEPSEEK, **_dims(2048, 27, 16, 16, 10944), "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2", "moe_intermediate_size": 1408, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "q_lora_rank": None, "vocab_size": 102400, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "scoring_func": "softmax", "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "rope_scaling": _yarn(0.707),
    },
    "deepseek-v3": {
        **_DEEPSEEK, **_dims(7168, 61, 128, 128, 18432), "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "q_lora_rank": 1536, "vocab_size": 129280, "topk_method": "noaux_tc", "n_group": 8,
        "topk_group": 4, "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "rope_scaling": _yarn(1.0),
    },
    "tiny": {
        **_QWEN3_MOE, **_dims(64, 2, 4, 2, 128), "head_dim": 16, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 512,
        "max_position_embeddings": 2048, "torch_dtype": "float32",
    },
}
