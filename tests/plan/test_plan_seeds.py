"""Five SGLang fixes of buffers sized from the wrong count (docs/DESIGN.md, "The family of
bugs it rules out"), as regression tests in terms of our plan."""

import math

import pytest

from moeserve.config import EngineConfig
from moeserve.config.spec import load_model_spec
from moeserve.parallel.layout import ParallelLayout
from moeserve.plan.budget import moe_tokens_per_rank, runtime_max_per_rank
from moeserve.plan.buffers import token_payload_bytes
from moeserve.plan.memory import DTYPE_BYTES
from moeserve.plan.capacity import build_plan

V2 = "preset:deepseek-v2-lite"


def plan_of(**kw):
    kw.setdefault("gpu_memory_gb", 141)
    kw.setdefault("device", "cuda")  # plans for GPUs, on any machine
    return build_plan(EngineConfig(**kw))


def test_000_cap_is_per_rank_and_workspace_scales_with_ep():
    # Same per-DP-rank load on 2 and 4 ranks: the per-rank cap must not change, the workspace
    # (ep x cap x payload) must double. SGLang multiplied the cap by ep and then the workspace
    # by ep again.
    small = plan_of(model=V2, tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2,
                    moe_a2a_backend="all_to_all", chunked_prefill_size=8192,
                    max_running_requests=512)
    big = plan_of(model=V2, tp_size=4, dp_size=4, enable_dp_attention=True, ep_size=4,
                  moe_a2a_backend="all_to_all", chunked_prefill_size=16384,
                  max_running_requests=1024)
    assert small.ok and big.ok, (small.errors, big.errors)
    assert small.budget.by_mode() == big.budget.by_mode()
    assert big.a2a_cap == small.a2a_cap == 4096
    assert big.a2a_workspace_bytes_per_rank == 2 * small.a2a_workspace_bytes_per_rank
    payload = token_payload_bytes(small.spec.hidden_size, small.spec.top_k,
                                  DTYPE_BYTES[small.dtype])
    assert small.buffer("a2a.recv").shape == (2, 4096, payload)
    assert small.a2a_workspace_bytes_per_rank == 2 * 2 * 4096 * payload  # send + recv halves


@pytest.mark.parametrize("chunk,running,expect", [(512, 4096, 4096), (8192, 64, 8192)])
def test_001_cap_covers_prefill_and_decode(chunk, running, expect):
    # SGLang sized the workspace from max running requests only, so prefill overflowed it.
    plan = plan_of(model=V2, tp_size=2, ep_size=2, dp_size=2, enable_dp_attention=True,
                   moe_a2a_backend="all_to_all", chunked_prefill_size=2 * chunk,
                   max_running_requests=2 * running, cuda_graph_max_bs=64)
    assert plan.ok, plan.errors
    assert plan.budget.extend == chunk and plan.budget.decode == running
    assert plan.a2a_cap == max(chunk, running) == expect


def test_002_runner_bound_is_max_over_modes_with_speculative_tokens():
    # SGLang sized the expert-runner buffer from the first (warm-up) forward; a later
    # 4073-token batch crashed. Our bound comes from the configured modes only.
    plan = plan_of(model="preset:qwen3-30b-a3b", tp_size=2, ep_size=2, dp_size=2,
                   enable_dp_attention=True, moe_a2a_backend="all_to_all",
                   chunked_prefill_size=4096, piecewise_cuda_graph_max_tokens=1024,
                   max_running_requests=2048, speculative_num_draft_tokens=4)
    b = plan.budget
    assert (b.extend, b.prefill_graph, b.decode) == (2048, 1024, 1024 * 4)
    assert plan.a2a_cap == max(b.extend, b.prefill_graph, b.decode) == 4096
    assert plan.moe_runner_rows == 2 * plan.a2a_cap  # ep x cap rows reach a rank's experts
    pairs = plan.moe_runner_rows * plan.spec.top_k
    assert plan.buffer("moe.runner.down").shape == (pairs, plan.spec.hidden_size)
    # an explicit cap below the worst case is a startup error naming the required value
    low = plan_of(model="preset:qwen3-30b-a3b", tp_size=2, ep_size=2, dp_size=2,
                  enable_dp_attention=True, moe_a2a_backend="all_to_all",
                  chunked_prefill_size=4096, max_running_requests=2048,
                  speculative_num_draft_tokens=4, moe_a2a_max_tokens_per_rank=4073)
    assert not low.ok
    (err,) = [e for e in low.errors if "--moe-a2a-max-tokens-per-rank" in e.message]
    assert "4096" in err.message and "--moe-a2a-max-tokens-per-rank 4096" in err.fix
    ok = plan_of(model="preset:qwen3-30b-a3b", tp_size=2, ep_size=2, dp_size=2,
                 enable_dp_attention=True, moe_a2a_backend="all_to_all",
                 chunked_prefill_size=4096, max_running_requests=2048,
                 speculative_num_draft_tokens=4, moe_a2a_max_tokens_per_rank=4096)
    assert ok.ok and ok.a2a_cap == 4096


def test_003_sp_uses_post_scatter_count_and_dp_uses_gathered_max():
    # SGLang used the pre-scatter count under SP, inflating the workspace.
    plan = plan_of(model="preset:qwen3-30b-a3b", tp_size=4, ep_size=4,
                   moe_a2a_backend="all_to_all", chunked_prefill_size=8191,
                   max_running_requests=64, cuda_graph_max_bs=64)
    assert plan.layout.sp and plan.layout.attn_tp == 4
    assert plan.budget.extend == 8191
    assert plan.moe_tokens["extend"] == math.ceil(8191 / 4) == plan.a2a_cap
    lay = plan.layout
    assert runtime_max_per_rank([8191], lay) == 2048
    # with DP attention, the runtime max is the max over the gathered per-DP-rank counts
    dp = ParallelLayout(tp=4, dp=4, ep=4, dense_tp=4, a2a=True)
    assert runtime_max_per_rank([3, 0, 17, 5], dp) == 17
    sp_dp = ParallelLayout(tp=4, dp=2, ep=4, dense_tp=4, a2a=True)
    assert runtime_max_per_rank([3, 17], sp_dp) == 9 == moe_tokens_per_rank(17, sp_dp)


def test_004_capture_sizes_divisible_by_attn_tp():
    # --moe-dense-tp-size 1 with tp 8: reduce-scatter of a capture size not divisible by
    # attn_tp crashed SGLang at launch.
    plan = plan_of(model=V2, tp_size=8, moe_dense_tp_size=1, gpu_memory_gb=80)
    assert plan.ok, plan.errors
    g = plan.to_json()["graphs"]
    assert g["decode_batch_sizes"] and g["prefill_token_sizes"]
    assert all(s % 8 == 0 for s in g["decode_batch_sizes"] + g["prefill_token_sizes"])
    sp = plan_of(model="preset:qwen3-30b-a3b", tp_size=4, ep_size=4,
                 moe_a2a_backend="all_to_all")
    assert sp.ok and all(s % 4 == 0 for s in sp.budget.decode_batch_sizes)
    assert all(s % 4 == 0 for s in sp.budget.prefill_token_sizes)
    # without scatter, odd sizes stay
    plain = plan_of(model="preset:qwen3-30b-a3b", tp_size=4)
    assert 1 in plain.budget.decode_batch_sizes
    # a list that filtering empties is a startup error with the fix
    none = plan_of(model=V2, tp_size=8, moe_dense_tp_size=1, cuda_graph_bs=(1, 2, 3),
                   gpu_memory_gb=80)
    assert not none.ok
    (err,) = [e for e in none.errors if "decode CUDA-graph" in e.message]
    assert "--cuda-graph-bs 8 16" in err.fix and "--disable-cuda-graph" in err.fix
    disabled = plan_of(model=V2, tp_size=8, moe_dense_tp_size=1, cuda_graph_bs=(1, 2, 3),
                       disable_cuda_graph=True, gpu_memory_gb=80)
    assert disabled.ok and disabled.budget.decode_batch_sizes == ()


def test_spec_of_v2_lite_is_read():
    spec = load_model_spec(V2)
    assert spec.dense_layers == (0,) and spec.mla.kv_lora_rank == 512
    assert spec.num_shared_experts == 2 and spec.shared_expert_intermediate_size == 2816
