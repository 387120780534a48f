"""The warm-up list (plan/warmup.py) is the set of shapes the plan allows: every bucket of the
capture lists, the eager prefills the buckets leave out, one row count per MoE tile config,
every SDPA length, and nothing else; for several layouts, planned for a GPU from this CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moeserve.config import EngineConfig
from moeserve.kernels.attention.tiles import ATTENTION_TILES
from moeserve.kernels.moe import configs
from moeserve.plan.capacity import build_plan
from moeserve.plan.capture import default_decode_batch_sizes
from moeserve.plan.warmup import (CAPTURE, EAGER, PATHS, SAMPLING_MODES, expert_shape,
                                  warmup_plan)

H100, HOPPER = "NVIDIA H100 80GB HBM3", (9, 0)
LAYOUTS = {
    "tp1": {},
    "tp2 ep2": dict(tp_size=2, ep_size=2),
    "dp-attention": dict(tp_size=2, dp_size=2, enable_dp_attention=True),
    "tp2 ep2 all_to_all": dict(tp_size=2, ep_size=2, moe_a2a_backend="all_to_all"),
    "tp2 dense tp1": dict(tp_size=2, moe_dense_tp_size=1),
}
MODEL = "preset:qwen3-30b-a3b"


def _gpu_plan(**flags):
    plan = build_plan(EngineConfig(model=MODEL, device="cuda", **flags))
    assert plan.ok, plan.errors
    return plan


def _config_of(plan, rows):
    e, h, i = expert_shape(plan)
    return json.dumps(configs.get_config(rows, plan.spec.top_k, e, h, i, plan.dtype, H100,
                                         HOPPER), sort_keys=True)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_list_is_every_shape_the_plan_allows_and_nothing_else(name):
    plan = _gpu_plan(**LAYOUTS[name])
    b, lay = plan.budget, plan.layout
    w = warmup_plan(plan, H100, HOPPER)
    assert w.skipped is None and {v.path for v in w.variants} <= set(PATHS)
    # every bucket of both capture lists, run by its capture, and no other graph size
    assert w.sizes("decode") == list(b.decode_batch_sizes) == w.sizes("decode", CAPTURE)
    assert w.sizes("prefill") == list(b.prefill_token_sizes) == w.sizes("prefill", CAPTURE)
    assert b.decode_batch_sizes and b.prefill_token_sizes
    # eager prefills: the two extend-attention tile entries (a request of up to 1024 new
    # tokens, and more) and the full extend when no bucket stands for it
    longest = min(b.extend, b.context_length)
    want = {1} | ({ATTENTION_TILES.extend[0][0] + 1} if longest > 1024 else set())
    if b.warmup not in b.prefill_token_sizes:
        want.add(b.warmup)
    assert sorted(want) == w.sizes("extend", EAGER) == w.sizes("extend")
    # MoE: one row count per tile config of 1..runner rows, each config once
    rows = plan.moe_runner_rows
    got = {_config_of(plan, n): n for n in w.sizes("moe")}
    assert len(got) == len(w.sizes("moe")), "two warm-up sizes share a tile config"
    every = {_config_of(plan, n) for n in range(1, rows + 1)}
    assert set(got) == every
    assert max(w.sizes("moe")) <= rows
    assert w.sizes("attention.sdpa") == ATTENTION_TILES.sdpa_warm_lengths(
        ATTENTION_TILES.sdpa_min_extend, longest)
    assert [v.key for v in w.of("sampling")] == list(SAMPLING_MODES)
    assert set(w.sizes("sampling")) == {max(b.decode_batch_sizes)}
    dispatch = [v.key for v in w.of("dispatch")]
    assert len(dispatch) == 2 * (lay.dp > 1) + lay.scatter_across_attn_tp
    assert w.summary().startswith(f"{len(w.variants)} variants: decode "
                                  f"{len(b.decode_batch_sizes)} (graph capture)")


def test_without_graphs_the_eager_rule_takes_the_kernels_that_differ():
    """No prefill graphs (a CPU, or graphs off): rows 1..17 (each its skinny GEMM tiles), the
    powers of two to 1024 (the rope's head blocks), the extend tile entries, the full extend;
    decode runs the default bucket rule eagerly. The list is there on a CPU; it is not run."""
    cpu = build_plan(EngineConfig(model=MODEL, device="cpu"))
    w = warmup_plan(cpu)
    assert w.skipped and "cpu" in w.skipped
    b = cpu.budget
    want = sorted(set(range(1, 18)) | {32, 64, 128, 256, 512, 1024, 1025, b.extend})
    assert w.sizes("extend") == want
    assert w.sizes("decode", EAGER) == list(b.decode_batch_sizes)
    assert not w.sizes("moe") and not w.sizes("attention.sdpa") and not w.sizes("prefill")
    off = warmup_plan(_gpu_plan(disable_cuda_graph=True, disable_piecewise_cuda_graph=True),
                      H100, HOPPER)
    assert off.sizes("extend") == want and off.sizes("decode", CAPTURE) == []
    assert off.sizes("decode") == default_decode_batch_sizes(b.max_running_requests)


def test_a_short_context_bounds_every_eager_size():
    plan = _gpu_plan(context_length=600, chunked_prefill_size=512, max_running_requests=16)
    w = warmup_plan(plan, H100, HOPPER)
    assert w.sizes("extend") == [1]  # 512 tokens at most: a bucket; one extend tile entry
    assert w.sizes("attention.sdpa") == []  # SDPA starts at 2048 tokens
    assert max(w.sizes("decode")) == 16 and max(w.sizes("prefill")) == 512


def test_latent_attention_lists_its_own_sdpa_range():
    plan = build_plan(EngineConfig(model="preset:deepseek-v2-lite", device="cuda"))
    assert plan.ok, plan.errors
    w = warmup_plan(plan)
    b = plan.budget
    assert w.sizes("attention.sdpa") == ATTENTION_TILES.sdpa_warm_lengths(
        ATTENTION_TILES.mla_sdpa_min_extend, min(b.extend, b.context_length))
    assert [v.key for v in w.of("extend") if v.size == 1] == ["latent extend tiles"]
    assert 1025 not in w.sizes("extend")  # latent extend tiles follow the heads alone


def test_a_plan_with_errors_has_no_list():
    plan = build_plan(EngineConfig(model=MODEL, device="cuda", tp_size=3))
    assert not plan.ok and warmup_plan(plan).variants == ()


def test_moeserve_plan_shows_the_count_and_json_has_the_list():
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "moeserve.cli", "plan", "--model", MODEL,
                               "--device", "cpu", *extra], capture_output=True, text=True,
                              timeout=120)

    text = run()
    assert text.returncode == 0, text.stderr
    w = warmup_plan(build_plan(EngineConfig(model=MODEL, device="cpu")))
    assert f"warm-up before ready: {len(w.variants)} variants" in text.stdout
    assert "not run here" in text.stdout
    out = json.loads(run("--json").stdout)["warmup"]
    assert out["count"] == len(out["variants"]) == len(w.variants)
    assert out["variants"][0] == w.variants[0].to_json()
