"""DeepSeek-V2 and DeepSeek-V3 (latent attention) against transformers, in fp32 on the CPU.

One rank: tiny random models in several shapes run three ways (whole prompts, a chunk after a
cached prefix, teacher-forced decode): every logit row within 1e-4 relative error of
transformers'. One spawned 2-rank world runs two of them under tp=2, ep=2 (dense layers
replicated), DP attention dp=2 and all-to-all with attn_tp=2, and checks that dummy weights do
not depend on the layout. The Engine's greedy tokens equal transformers' generate. The real
DeepSeek-V2-Lite and V3 shapes get the plan's latent KV pool (test_loader builds them).
"""

from __future__ import annotations

import json

import pytest
import torch

from moeserve.parallel.groups import single_process_state
from moeserve.batch.forward_batch import ForwardMode
from moeserve.testing.multiproc import run_ranks
from moeserve.testing.tiny_models import (TinyRunner, compare_three_ways, hf_logits, load_tiny,
                                          make_hf_model, rel_err, save_checkpoint, tiny_config)
from test_models import DECODE, PROMPTS, TOL, V, full_sequences

MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)
# yarn as DeepSeek ships it: mscale == mscale_all_dim (attention factor 1, softmax scale
# times mscale^2), and one with a non-trivial attention factor
YARN_V2 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
           "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
           "mscale_all_dim": 0.707}
YARN_V3 = {**YARN_V2, "mscale": 1.0, "mscale_all_dim": 0.5}
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=40, max_position_embeddings=128)

CASES = {
    # q_proj (no q LoRA), greedy softmax routing scaled, two shared experts, a dense first layer
    "v2-greedy-no-q-lora": ("DeepseekV2ForCausalLM", dict(
        COMMON, **MLA, q_lora_rank=None, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
        moe_intermediate_size=12, first_k_dense_replace=1, topk_method="greedy",
        routed_scaling_factor=1.5, rope_parameters=YARN_V2), None),
    # q LoRA, group-limited greedy routing, attention biases, sharded checkpoint
    "v2-group-limited-q-lora": ("DeepseekV2ForCausalLM", dict(
        COMMON, **MLA, q_lora_rank=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=16, first_k_dense_replace=1, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, attention_bias=True), "24KB"),
    # sigmoid + correction bias over 2 of 4 groups, renormalised and scaled; yarn
    "v3-sigmoid-groups": ("DeepseekV3ForCausalLM", dict(
        COMMON, **MLA, q_lora_rank=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        moe_intermediate_size=16, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, rope_parameters=YARN_V3), "24KB"),
    # neox-style rope (rope_interleave false), 3 heads, no q LoRA, one group, no renorm, tied
    "v3-neox-odd-heads": ("DeepseekV3ForCausalLM", dict(
        COMMON, **MLA, q_lora_rank=None, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=3, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=16, first_k_dense_replace=0, n_group=1, topk_group=1,
        norm_topk_prob=False, rope_interleave=False, tie_word_embeddings=True), None),
}
FIRST = [4, 1, 6, 0]


def _checkpoint(name, folder):
    arch, hf_cfg, shard = CASES[name]
    hf = make_hf_model(arch, seed=len(name), **hf_cfg)
    return hf, save_checkpoint(hf, folder, shard)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf, folder = _checkpoint(case, tmp_path / case)
    ref = hf_logits(hf, full_sequences())
    state = single_process_state()
    model, plan = load_tiny(tiny_config(folder), state)
    errs = compare_three_ways(TinyRunner(model, state, plan), PROMPTS, DECODE, ref, FIRST)
    worst = max(errs, key=lambda e: e[1])
    assert worst[1] <= TOL, f"{case}: {worst[0]} has relative error {worst[1]:.2e}"


def test_routing_bias_and_rope_layout_matter(tmp_path):
    """The comparison above would catch a router without the correction bias or the wrong
    rope layout: each changes the logits far beyond the tolerance."""
    hf, folder = _checkpoint("v3-sigmoid-groups", tmp_path / "ckpt")
    ref = hf_logits(hf, PROMPTS)
    state = single_process_state()
    model, plan = load_tiny(tiny_config(folder), state)
    lens = [len(p) for p in PROMPTS]

    def err() -> float:
        got = TinyRunner(model, state, plan).forward(ForwardMode.EXTEND, PROMPTS, range(4))
        return max(rel_err(g, r) for g, r in zip(got.split(lens), ref))

    assert err() <= TOL
    gate = model.layers[1].mlp.gate
    bias = gate.e_score_correction_bias.clone()
    gate.e_score_correction_bias.zero_()
    assert err() > 1e-2
    gate.e_score_correction_bias.copy_(bias)
    for layer in model.layers:
        layer.self_attn.interleaved_rope = False
    assert err() > 1e-2


def test_mtp_layers_are_skipped_and_other_extras_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from moeserve.models.loader import WeightLoadError

    hf, folder = _checkpoint("v3-neox-odd-heads", tmp_path / "ckpt")
    ref = hf_logits(hf, PROMPTS[:1])[0]
    tensors = load_file(folder / "model.safetensors")
    n = hf.config.num_hidden_layers  # the config says num_nextn_predict_layers: 1
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    mtp = {f"model.layers.{n}.eh_proj.weight": torch.randn(32, 64),
           f"model.layers.{n}.self_attn.kv_b_proj.weight": torch.randn(60, 16)}
    save_file({**tensors, **mtp}, str(folder / "model.safetensors"))
    state = single_process_state()
    model, plan = load_tiny(tiny_config(folder), state)
    got = TinyRunner(model, state, plan).forward(ForwardMode.EXTEND, PROMPTS[:1], [0])
    assert rel_err(got, ref) <= TOL
    extra = {f"model.layers.{n + 1}.eh_proj.weight": torch.randn(32, 64)}
    save_file({**tensors, **extra}, str(folder / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=rf"model\.layers\.{n + 1}\.eh_proj"):
        load_tiny(tiny_config(folder), state)


# --- 2 ranks: every layout in one spawned world --------------------------------------------

PARALLEL_CASES = ["v2-group-limited-q-lora", "v3-sigmoid-groups"]
LAYOUTS = {
    "tp2": {},
    "ep2-dense-replicated": {"ep_size": 2, "moe_dense_tp_size": 1},
    "dp2-attention": {"dp_size": 2, "enable_dp_attention": True},
    "a2a-attn-tp2": {"ep_size": 2, "moe_a2a_backend": "all_to_all"},
}
DUMMY_CONFIG = {  # DeepSeek-V2-Lite's structure at a CPU-sized scale
    "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96,
    "moe_intermediate_size": 16, "n_routed_experts": 8, "n_shared_experts": 2,
    "num_experts_per_tok": 3, "first_k_dense_replace": 1, "q_lora_rank": None,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "vocab_size": 128, "max_position_embeddings": 256, "torch_dtype": "float32",
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                     "mscale": 0.707, "mscale_all_dim": 0.707},
}


def _all_layouts(rank: int, world: int, cases: list, dummy_folder: str) -> dict:
    from test_models_parallel import _world

    from moeserve.parallel.groups import init_parallel_state
    from moeserve.parallel.layout import ParallelLayout

    out = {}
    for name, layout_kw in LAYOUTS.items():
        out[name] = _world(rank, world, layout_kw, cases, None)
        cfg = tiny_config(dummy_folder, tp_size=world, load_format="dummy", **layout_kw)
        model, plan = load_tiny(cfg, init_parallel_state(ParallelLayout.from_config(cfg)))
        out[name + " dummy"] = TinyRunner(model, model.state, plan).forward(
            ForwardMode.EXTEND, PROMPTS, range(4))
    return out


@pytest.mark.multiproc
def test_logits_match_transformers_on_every_layout(tmp_path):
    cases = []
    for name in PARALLEL_CASES:
        hf, folder = _checkpoint(name, tmp_path / name)
        cases.append((name, str(folder), hf_logits(hf, full_sequences())))
    dummy = tmp_path / "dummy"
    dummy.mkdir()
    (dummy / "config.json").write_text(json.dumps(DUMMY_CONFIG))
    state = single_process_state()
    model, plan = load_tiny(tiny_config(dummy, load_format="dummy"), state)
    dummy_ref = TinyRunner(model, state, plan).forward(ForwardMode.EXTEND, PROMPTS, range(4))
    assert torch.isfinite(dummy_ref).all() and dummy_ref.std() > 0.1

    per_rank = run_ranks(_all_layouts, 2, cases, str(dummy), timeout=300)
    for rank, results in enumerate(per_rank):
        for layout in LAYOUTS:
            assert len(results[layout]) == len(cases)
            for name, (what, err) in results[layout]:
                assert err <= TOL, f"{layout} rank {rank} {name}: {what} relative error {err:.2e}"
            err = rel_err(results[layout + " dummy"], dummy_ref)
            assert err <= 1e-5, f"{layout} rank {rank}: dummy weights differ ({err:.2e})"


# --- the Engine, and the real shapes ---------------------------------------------------------

def test_engine_greedy_equals_transformers_generate(tmp_path):
    from moeserve.runtime.engine import Engine

    hf, folder = _checkpoint("v2-greedy-no-q-lora", tmp_path / "ckpt")
    hf.generation_config.eos_token_id = None
    prompts, new = [[3, 17, 42, 5, 9], [60, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19], [7]], 6
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    base = dict(dtype="float32", max_total_tokens=1024, context_length=64,
                skip_tokenizer_init=True, max_running_requests=8, disable_cuda_graph=True,
                device="cpu")
    greedy = dict(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    with Engine(str(folder), **base) as engine:
        assert [r["token_ids"] for r in engine.generate(input_ids=prompts,
                                                        sampling_params=greedy)] == ref
    with Engine(str(folder), **base, chunked_prefill_size=3, page_size=4) as engine:
        assert [r["token_ids"] for r in engine.generate(input_ids=prompts,
                                                        sampling_params=greedy)] == ref


@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "deepseek-v3"])
def test_real_shapes_get_the_plans_latent_kv_pool(preset):
    """The runtime's KV pool for the real shapes is the plan's latent record (on the meta
    device: no memory is touched). test_loader builds these presets with every tensor."""
    from moeserve.config.spec import load_model_spec
    from moeserve.plan.capacity import build_plan
    from moeserve.batch.kv_cache import MLAKVCachePool
    from moeserve.runtime.buffers import bind_buffers

    cfg = tiny_config(f"preset:{preset}", load_format="dummy", dtype="bfloat16",
                      gpu_memory_gb=2000.0, page_size=16)
    spec = load_model_spec(cfg.model)
    plan = build_plan(cfg, spec)
    assert plan.ok, plan.errors
    pool = bind_buffers(plan, "meta").kv_pool
    assert isinstance(pool, MLAKVCachePool) and pool.page_size == 16
    layers, tokens, width = plan.buffer("kv_cache").shape
    assert pool.kv_LSW.shape == (layers, pool.num_slots, width) and pool.num_slots <= tokens
    assert width == spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
    assert pool.kv_LSW.dtype == torch.bfloat16
