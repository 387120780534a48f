"""The real shapes of well-known MoE models, as the config.json their checkpoints ship.

They go through the same reader as a checkpoint's config.json; `preset:NAME` picks one.
`tiny` is a Qwen3-MoE small enough to run on a CPU.
"""

from __future__ import annotations

from typing import Any

_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
    "attention_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "torch_dtype": "bfloat16", "vocab_size": 151936,
    "head_dim": 128, "max_position_embeddings": 40960, "num_experts": 128,
    "num_experts_per_tok": 8,
}

_DEEPSEEK = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "moe_layer_freq": 1,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "attention_bias": False,
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        **_QWEN3_MOE, "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "intermediate_size": 6144, "moe_intermediate_size": 768,
    },
    "qwen3-235b-a22b": {
        **_QWEN3_MOE, "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
        "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_act": "silu",
        "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
        "num_key_value_heads": 16, "intermediate_size": 1024, "num_experts": 64,
        "num_experts_per_tok": 8, "vocab_size": 50304, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "norm_topk_prob": False,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
    },
    "qwen1.5-moe-a2.7b": {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_act": "silu",
        "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
        "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
        "vocab_size": 151936, "max_position_embeddings": 8192, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "deepseek-v2-lite": {
        **_DEEPSEEK, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "q_lora_rank": None, "vocab_size": 102400,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "scoring_func": "softmax",
        "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707},
    },
    "deepseek-v3": {
        **_DEEPSEEK, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "q_lora_rank": 1536, "vocab_size": 129280,
        "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    "tiny": {
        **_QWEN3_MOE, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 512, "max_position_embeddings": 2048, "torch_dtype": "float32",
    },
}
