"""Model spec reading, the generated CLI, the layout checks and `moeserve plan`."""

import json
import re
import subprocess
import sys

import pytest
import transformers

from moeserve.cli import build_parser, main
from moeserve.config import EngineConfig, config_from_args
from moeserve.config.engine import SYMM_COMM_MAX_BYTES
from moeserve.config.presets import PRESETS
from moeserve.config.spec import ModelSpecError, load_model_spec, spec_from_hf_config
from moeserve.parallel.layout import layout_problems
from moeserve.plan.capacity import build_plan
from moeserve.plan.memory import weight_params_per_rank
from moeserve.parallel.layout import ParallelLayout


def _hf_dict(cls, arch, **kw):
    d = cls(**kw).to_dict()
    d["architectures"] = [arch]
    return d


def test_reads_transformers_configs_of_every_architecture():
    q3 = spec_from_hf_config(_hf_dict(
        transformers.Qwen3MoeConfig, "Qwen3MoeForCausalLM", hidden_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
        decoder_sparse_step=1, norm_topk_prob=True))
    assert q3.head_dim == 24 and q3.dense_layers == (1,) and q3.moe_layers == (0, 2, 3)
    assert q3.qk_norm == "per_head" and q3.norm_topk_prob and q3.rope_theta == 10000.0
    q2 = spec_from_hf_config(_hf_dict(
        transformers.Qwen2MoeConfig, "Qwen2MoeForCausalLM", num_hidden_layers=4,
        decoder_sparse_step=2, shared_expert_intermediate_size=96))
    assert q2.dense_layers == (0, 2) and q2.shared_expert_gate and q2.num_shared_experts == 1
    mx = spec_from_hf_config(_hf_dict(transformers.MixtralConfig, "MixtralForCausalLM",
                                      num_local_experts=4, intermediate_size=77))
    assert mx.num_experts == 4 and mx.moe_intermediate_size == 77 and mx.dense_layers == ()
    ol = spec_from_hf_config(_hf_dict(transformers.OlmoeConfig, "OlmoeForCausalLM"))
    assert ol.qk_norm == "full" and ol.num_experts == 64
    v2 = spec_from_hf_config(_hf_dict(
        transformers.DeepseekV2Config, "DeepseekV2ForCausalLM", num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=2,
        moe_intermediate_size=16, topk_method="group_limited_greedy", n_group=4, topk_group=2))
    assert v2.dense_layers == (0,) and v2.mla is not None
    assert v2.head_dim == v2.mla.qk_nope_head_dim + v2.mla.qk_rope_head_dim
    assert v2.shared_expert_intermediate_size == 32 and v2.topk_method == "group_limited_greedy"
    v3 = spec_from_hf_config(_hf_dict(transformers.DeepseekV3Config, "DeepseekV3ForCausalLM"))
    assert v3.scoring == "sigmoid" and v3.n_group == 8 and v3.norm_topk_prob


def test_presets_have_the_real_sizes():
    # total parameters, as published: Qwen3-30B-A3B 30.5B, Mixtral 46.7B, DeepSeek-V3 671B
    published = {"qwen3-30b-a3b": 30.5e9, "mixtral-8x7b": 46.7e9, "deepseek-v3": 671e9,
                 "olmoe-1b-7b": 6.9e9, "qwen3-235b-a22b": 235e9, "deepseek-v2-lite": 15.7e9,
                 "qwen1.5-moe-a2.7b": 14.3e9}
    one = ParallelLayout(tp=1, dp=1, ep=1, dense_tp=1, a2a=False)
    for name, total in published.items():
        params = weight_params_per_rank(load_model_spec(f"preset:{name}"), one)
        assert abs(params - total) / total < 0.03, (name, params)
    assert set(PRESETS) >= set(published) | {"tiny"}


def test_bad_models_say_what_is_supported(tmp_path):
    with pytest.raises(ModelSpecError, match="qwen3-30b-a3b"):
        load_model_spec(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelSpecError, match="Qwen3MoeForCausalLM.*MixtralForCausalLM"):
        load_model_spec(str(tmp_path))
    with pytest.raises(ModelSpecError, match="unknown preset"):
        load_model_spec("preset:gpt5")


def test_cli_is_generated_from_the_config_with_sglang_spellings():
    args = build_parser().parse_args([
        "plan", "--model", "preset:tiny", "--load-format", "dummy", "--dtype", "float32",
        "--tp", "4", "--dp", "2", "--enable-dp-attention", "--ep", "2",
        "--moe-dense-tp-size", "1", "--moe-a2a-backend", "none",
        "--max-running-requests", "64", "--max-prefill-tokens", "1024",
        "--chunked-prefill-size", "512", "--max-total-tokens", "9999",
        "--mem-fraction-static", "0.5", "--page-size", "16", "--cuda-graph-max-bs", "32",
        "--cuda-graph-bs", "4", "8", "--disable-cuda-graph", "--piecewise-cuda-graph-max-tokens",
        "256", "--disable-piecewise-cuda-graph", "--speculative-num-draft-tokens", "3",
        "--context-length", "128", "--gpu-memory-gb", "24", "--moe-a2a-max-tokens-per-rank", "7",
        "--enable-deterministic-inference"])
    cfg = config_from_args(args)
    assert cfg == EngineConfig(
        model="preset:tiny", load_format="dummy", dtype="float32", tp_size=4, dp_size=2,
        enable_dp_attention=True, ep_size=2, moe_dense_tp_size=1, moe_a2a_backend="none",
        max_running_requests=64, max_prefill_tokens=1024, chunked_prefill_size=512,
        max_total_tokens=9999, mem_fraction_static=0.5, page_size=16, cuda_graph_max_bs=32,
        cuda_graph_bs=(4, 8), disable_cuda_graph=True, piecewise_cuda_graph_max_tokens=256,
        disable_piecewise_cuda_graph=True, speculative_num_draft_tokens=3, context_length=128,
        gpu_memory_gb=24.0, moe_a2a_max_tokens_per_rank=7, enable_deterministic_inference=True)
    assert cfg.attn_dp_size == 2 and cfg.chunk_tokens_per_dp_rank == 256
    assert config_from_args(build_parser().parse_args(["plan", "--tp-size", "2"])).tp_size == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--moe-a2a-backend", "deepep"])


@pytest.mark.parametrize("kw,needle,fix", [
    (dict(tp_size=4, dp_size=3, enable_dp_attention=True), "tp % dp", "--dp-size"),
    (dict(tp_size=4, ep_size=3), "tp % ep", "--ep-size"),
    (dict(tp_size=8, ep_size=8, model="preset:qwen1.5-moe-a2.7b"), "experts % ep",
     "--ep-size"),
    (dict(tp_size=4, ep_size=1, model="tiny-odd"), "expert intermediate % moe_tp",
     "--ep-size"),
    (dict(tp_size=8, model="preset:tiny"), "heads % attn_tp", "attn_tp"),
    (dict(tp_size=3, ep_size=3, model="preset:qwen3-30b-a3b"), "KV heads", "attn_tp"),
    (dict(tp_size=4, moe_dense_tp_size=2), "--moe-dense-tp-size 2", "--moe-dense-tp-size 1"),
    (dict(tp_size=2, dp_size=2), "without --enable-dp-attention", "--enable-dp-attention"),
    (dict(tp_size=2, ep_size=1, moe_a2a_backend="all_to_all"), "ep (1) must equal tp (2)",
     "--ep-size 2"),
])
def test_layout_errors_quote_the_numbers(kw, needle, fix):
    cfg = EngineConfig(**{"model": "preset:qwen3-30b-a3b", **kw})
    spec = None
    if cfg.model == "tiny-odd":  # an expert width that 4 ranks cannot split
        spec = spec_from_hf_config({**PRESETS["tiny"], "moe_intermediate_size": 30})
    problems = build_plan(cfg, spec).errors
    assert any(needle in p.message and fix in p.fix for p in problems), problems


def test_layout_of_a_valid_config_has_no_problems():
    cfg = EngineConfig(model="preset:qwen3-30b-a3b", tp_size=8, dp_size=4,
                       enable_dp_attention=True, ep_size=8, moe_a2a_backend="all_to_all")
    assert layout_problems(cfg, load_model_spec(cfg.model)) == []


def test_plan_json_has_the_contract_fields(capsys):
    rc = main(["plan", "--model", "preset:deepseek-v2-lite", "--tp", "2", "--dp", "2",
               "--enable-dp-attention", "--ep", "2", "--moe-a2a-backend", "all_to_all",
               "--gpu-memory-gb", "80", "--device", "cuda", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["errors"] == []
    assert set(out["budget"]) >= {"extend", "decode", "mixed", "decode_graph", "prefill_graph",
                                  "warmup", "idle"}
    assert out["a2a"]["max_tokens_per_rank"] == out["budget"]["extend"]
    names = {b["name"] for b in out["buffers"]}
    assert {"a2a.send", "a2a.recv", "kv_cache", "moe.runner.down", "moe.router.topk_ids"} <= names
    assert out["backends"] == {"device": "cuda", "attention": "triton", "experts": "triton",
                               "a2a": "all_to_all", "symm_comm_max_bytes": SYMM_COMM_MAX_BYTES}
    # attn_tp is 1; the dense first layer is split over the world, which it gathers over
    assert {n for n in names if n.startswith("comm.")} == {"comm.symm.world"}
    assert out["a2a"]["workspace_bytes_per_rank"] == sum(
        b["bytes"] for b in out["buffers"] if b["name"].startswith("a2a."))
    for b in out["buffers"]:
        assert set(b) == {"name", "shape", "dtype", "bytes", "formula", "knobs", "symmetric"}
    mem = out["memory"]
    assert set(mem) >= {"weights_bytes_per_rank", "kv_bytes_per_token_per_rank",
                        "static_buffer_bytes_per_rank", "kv_capacity_tokens"}
    assert mem["weights_bytes_per_rank"] + mem["static_buffer_bytes_per_rank"] < 80e9 * 0.88
    assert out["graphs"]["decode_batch_sizes"][0] == 1


def test_qwen3_tp2_fits_80gb_and_gather_path_has_no_a2a(capsys):
    assert main(["plan", "--model", "preset:qwen3-30b-a3b", "--tp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["a2a"] is None and out["memory"]["kv_capacity_tokens"] > 100_000


def test_deepseek_v3_on_8x80gb_shows_plan_then_error_and_exits_nonzero():
    proc = subprocess.run(
        [sys.executable, "-m", "moeserve.cli", "plan", "--model", "preset:deepseek-v3",
         "--tp", "8", "--dp", "8", "--enable-dp-attention", "--ep", "8",
         "--moe-a2a-backend", "all_to_all", "--gpu-memory-gb", "80"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    out = proc.stdout
    assert "a2a.recv" in out and "kv_cache" in out and "decode graph batch sizes" in out
    m = re.search(r"--tp (\d+) --ep (\d+) --dp (\d+) ", out)
    assert "do not fit" in out and m and m[1] == m[2]
    # the suggested layout really fits
    from moeserve.plan.capacity import build_plan as plan_of
    suggested = plan_of(EngineConfig(
        model="preset:deepseek-v3", tp_size=int(m[1]), ep_size=int(m[2]), dp_size=int(m[3]),
        enable_dp_attention=True, moe_a2a_backend="all_to_all", gpu_memory_gb=80))
    assert not any("do not fit" in e.message for e in suggested.errors)
    assert out.index("static buffers per rank") < out.index("error(s)")


def test_missing_model_is_a_clear_cli_error(capsys):
    assert main(["plan", "--model", "/no/such/model"]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize("dp, device, want", [
    (1, "cuda", "none"),  # replicated rows: the gather path, one all-reduce
    (2, "cuda", "nvlink"),  # DP attention: each rank's own rows travel one-sided
    (2, "cpu", "all_to_all"),
    (1, "cpu", "none")])
def test_auto_exchanges_tokens_only_under_dp_attention(dp, device, want):
    cfg = EngineConfig(model="preset:qwen3-30b-a3b", tp_size=2, ep_size=2, dp_size=dp,
                       enable_dp_attention=dp > 1, moe_a2a_backend="auto", device=device,
                       gpu_memory_gb=80)
    plan = build_plan(cfg)
    assert plan.ok, plan.errors
    assert plan.backends.a2a == want and plan.layout.a2a == (want != "none")
    # ep < tp never exchanges: experts are split, and the gather path sums them
    assert not EngineConfig(model="preset:qwen3-30b-a3b", tp_size=2, ep_size=1,
                            moe_a2a_backend="auto").a2a_enabled
