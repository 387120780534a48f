"""The four architectures against transformers, on one rank, in fp32.

Each case builds a tiny random model with transformers, saves it (one file or shards), loads it
with moeserve and runs a batch of prompts of different lengths three ways: whole prompts in one
extend, prompts in two chunks (the second after a cached prefix), then decode steps. Every
logit row must match transformers' logits of the same position: relative error <= 1e-4.
"""

from __future__ import annotations

import pytest

from moeserve.parallel.groups import single_process_state
from moeserve.batch.forward_batch import ForwardMode
from moeserve.testing.tiny_models import (TinyRunner, compare_three_ways, hf_logits,
                                          load_tiny, make_hf_model, rel_err, save_checkpoint,
                                          tiny_config)

TOL = 1e-4
V = 97
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0}

# (architecture, transformers config, max_shard_size or None for one file)
CASES = {
    # odd head count, one KV head, head_dim 12 != 40/5, a dense layer between MoE layers
    "qwen3-odd-heads": ("Qwen3MoeForCausalLM", dict(
        vocab_size=V, hidden_size=40, num_attention_heads=5, num_key_value_heads=1, head_dim=12,
        num_hidden_layers=3, mlp_only_layers=[1], intermediate_size=36, moe_intermediate_size=20,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=True), None),
    # tied embeddings, biases, yarn rope, decoder_sparse_step 2 (layers 0 and 2 dense)
    "qwen3-tied-yarn": ("Qwen3MoeForCausalLM", dict(
        vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=3, decoder_sparse_step=2, intermediate_size=36,
        moe_intermediate_size=20, num_experts=4, num_experts_per_tok=2, attention_bias=True,
        tie_word_embeddings=True, rope_parameters=YARN, norm_topk_prob=False), "24KB"),
    # shared expert with its sigmoid gate, odd heads, a dense first layer
    "qwen2-shared-expert": ("Qwen2MoeForCausalLM", dict(
        vocab_size=V, hidden_size=36, num_attention_heads=3, num_key_value_heads=3,
        num_hidden_layers=3, mlp_only_layers=[0], intermediate_size=40, moe_intermediate_size=20,
        shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2), None),
    # a dense layer and a shared expert under TP (dense 40 and shared 24 split evenly)
    "qwen2-dense-first": ("Qwen2MoeForCausalLM", dict(
        vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=3, mlp_only_layers=[0], intermediate_size=40,
        moe_intermediate_size=20, shared_expert_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True), "24KB"),
    "mixtral-odd-heads": ("MixtralForCausalLM", dict(
        vocab_size=V, hidden_size=40, num_attention_heads=5, num_key_value_heads=5,
        num_hidden_layers=2, intermediate_size=20, num_local_experts=4,
        num_experts_per_tok=2), None),
    # head_dim 16 != 40/4, a sliding window shorter than the prompts
    "mixtral-tied-window": ("MixtralForCausalLM", dict(
        vocab_size=V, hidden_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, intermediate_size=20, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=True, sliding_window=5), "24KB"),
    "olmoe-clip": ("OlmoeForCausalLM", dict(
        vocab_size=V, hidden_size=36, num_attention_heads=3, num_key_value_heads=3,
        num_hidden_layers=2, intermediate_size=20, num_experts=6, num_experts_per_tok=2,
        clip_qkv=2.0, eos_token_id=V - 1), None),
    "olmoe-tied-bias": ("OlmoeForCausalLM", dict(
        vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
        num_hidden_layers=2, intermediate_size=20, num_experts=4, num_experts_per_tok=2,
        attention_bias=True, norm_topk_prob=True, tie_word_embeddings=True,
        eos_token_id=V - 1), "24KB"),
}

PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [12], [7, 7, 31, 2, 96, 50, 13, 70, 21, 4, 33], [64, 1, 8]]
DECODE = [[11, 45], [3, 90], [57, 6], [25, 77]]  # teacher-forced decode tokens


def full_sequences() -> list[list[int]]:
    return [p + d for p, d in zip(PROMPTS, DECODE)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    arch, hf_cfg, shard = CASES[case]
    hf = make_hf_model(arch, seed=len(case), **hf_cfg)
    folder = save_checkpoint(hf, tmp_path / case, shard)
    if shard:
        assert (folder / "model.safetensors.index.json").exists()
    ref = hf_logits(hf, full_sequences())
    state = single_process_state()
    model, plan = load_tiny(tiny_config(folder), state)
    errs = compare_three_ways(TinyRunner(model, state, plan), PROMPTS, DECODE, ref,
                              first=[4, 1, 6, 0])
    worst = max(errs, key=lambda e: e[1])
    assert worst[1] <= TOL, f"{case}: {worst[0]} has relative error {worst[1]:.2e}"


def test_logits_of_last_tokens_only(tmp_path):
    arch, hf_cfg, _ = CASES["qwen2-shared-expert"]
    hf = make_hf_model(arch, seed=3, **hf_cfg)
    folder = save_checkpoint(hf, tmp_path / "ckpt")
    ref = hf_logits(hf, PROMPTS)
    state = single_process_state()
    model, plan = load_tiny(tiny_config(folder), state)
    got = TinyRunner(model, state, plan).forward(ForwardMode.EXTEND, PROMPTS, range(4),
                                                 all_logits=False)
    assert got.shape == (4, V)
    for i, r in enumerate(ref):
        assert rel_err(got[i], r[-1]) <= TOL
