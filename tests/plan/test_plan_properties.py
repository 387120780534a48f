"""Property tests of the capacity plan over random layouts and knobs (hypothesis)."""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeserve.config import EngineConfig
from moeserve.kernels.attention import tiles as AT
from moeserve.config.spec import load_model_spec
from moeserve.kernels.moe.configs import (BLOCK_MS, align_scratch_len, max_blocks,
                                          rows_writing_pairs)
from moeserve.plan.buffers import token_payload_bytes
from moeserve.plan.memory import DTYPE_BYTES
from moeserve.plan.budget import moe_tokens_per_rank
from moeserve.plan.capacity import build_plan, down_sum_tables
from moeserve.plan.capture import capture_multiple
from moeserve.plan.memory import kv_heads_per_rank

SPECS = {name: load_model_spec(f"preset:{name}")
         for name in ("tiny", "qwen3-30b-a3b", "deepseek-v2-lite", "mixtral-8x7b", "olmoe-1b-7b")}
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def valid_configs(draw):
    name = draw(st.sampled_from(sorted(SPECS)))
    spec = SPECS[name]
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    dp_attn = draw(st.booleans())
    dp = draw(st.sampled_from([d for d in (1, 2, 4, 8) if tp % d == 0])) if dp_attn else 1
    a2a = draw(st.booleans())
    eps = [e for e in (1, 2, 4, 8) if tp % e == 0 and spec.num_experts % e == 0
           and spec.moe_intermediate_size % (tp // e) == 0]
    ep = tp if a2a else draw(st.sampled_from(eps))
    attn_tp = tp // dp
    if spec.num_experts % ep or spec.num_heads % attn_tp or (
            spec.mla is None and spec.num_kv_heads % attn_tp and attn_tp % spec.num_kv_heads):
        tp, dp, ep, dp_attn, a2a = 1, 1, 1, False, False
    dense_tp = draw(st.sampled_from([None, 1]))
    graph_bs = draw(st.one_of(st.none(), st.lists(st.integers(1, 600), min_size=1,
                                                          max_size=8).map(tuple)))
    return EngineConfig(
        model=f"preset:{name}", tp_size=tp, dp_size=dp, enable_dp_attention=dp_attn,
        ep_size=ep, moe_a2a_backend="all_to_all" if a2a else "none", moe_dense_tp_size=dense_tp,
        max_running_requests=draw(st.integers(dp, 5000)),
        max_prefill_tokens=draw(st.integers(1, 40000)),
        chunked_prefill_size=draw(st.one_of(st.none(), st.just(-1), st.integers(1, 40000))),
        enable_mixed_chunk=draw(st.booleans()),
        speculative_num_draft_tokens=draw(st.one_of(st.none(), st.integers(1, 8))),
        cuda_graph_max_bs=draw(st.one_of(st.none(), st.integers(1, 1024))),
        cuda_graph_bs=graph_bs, disable_cuda_graph=draw(st.booleans()),
        piecewise_cuda_graph_max_tokens=draw(st.one_of(st.none(), st.integers(1, 20000))),
        disable_piecewise_cuda_graph=draw(st.booleans()),
        enable_deterministic_inference=draw(st.booleans()),
        context_length=draw(st.one_of(st.none(), st.integers(16, 2048))),
        gpu_memory_gb=draw(st.sampled_from([24.0, 80.0, 141.0, 1000.0])),
        page_size=draw(st.sampled_from([1, 16, 64])),
        device=draw(st.sampled_from(["cpu", "cuda"])),
    )


@SETTINGS
@given(valid_configs())
def test_every_mode_fits_its_buffers_without_slack(cfg):
    plan = build_plan(cfg, SPECS[cfg.model.split(":")[1]])
    if plan.budget is None:  # a layout problem: errors, never a traceback
        assert plan.errors
        return
    b, lay = plan.budget, plan.layout
    modes = {m: t for m, t in b.by_mode().items() if t is not None}
    worst = max(moe_tokens_per_rank(t, lay) for t in modes.values())
    # no double counting: the cap is the per-rank worst case itself, not a multiple of it
    if lay.a2a:
        assert plan.a2a_cap == worst
        payload = token_payload_bytes(plan.spec.hidden_size, plan.spec.top_k,
                                      DTYPE_BYTES[plan.dtype])
        assert plan.a2a_workspace_bytes_per_rank == 2 * lay.ep * plan.a2a_cap * payload
    else:
        assert plan.a2a_cap is None and plan.a2a_workspace_bytes_per_rank is None
    rows = plan.buffer("moe.router.topk_ids").shape[0]
    assert rows == worst  # the router sees every mode's M, and no more
    reach = lay.ep * worst if lay.a2a else lay.dp * b.max_tokens
    assert plan.moe_runner_rows == reach
    check_backend_records(plan)
    if plan.backends.experts != "triton":  # no other runner takes a workspace
        assert not [r for r in plan.buffers if r.name.startswith("moe.runner.")]
        return
    # the fused runner's workspaces hold what its kernels take at the worst step, any BLOCK_M
    all_pairs, e_local = reach * plan.spec.top_k, plan.spec.num_experts // lay.ep
    grouped = max(max_blocks(all_pairs, m, e_local) * m for m in BLOCK_MS)
    assert plan.buffer("moe.runner.act").shape[0] == grouped
    assert plan.buffer("moe.runner.sorted_pairs").shape == (grouped,)
    assert plan.buffer("moe.runner.block_expert").shape[0] >= max_blocks(all_pairs, 16, e_local)
    # every pair's row, up to the largest step whose tile config writes them (all steps where
    # the GPU has no tile table, or none on this machine)
    spec, i_local = plan.spec, plan.spec.moe_intermediate_size // lay.moe_tp
    down_rows = rows_writing_pairs(reach, e_local, spec.hidden_size, i_local, plan.dtype,
                                   down_sum_tables(cfg))
    assert plan.buffer("moe.runner.down").shape == (down_rows * spec.top_k, spec.hidden_size)
    assert plan.buffer("moe.runner.align").shape == (align_scratch_len(all_pairs, e_local),)


def check_backend_records(plan) -> None:
    """The records that only some backends take are in the plan exactly where its ranks run
    those backends: graph inputs where graphs are captured (a GPU, the triton attention),
    the decode partials for the triton attention; a CPU plan runs torch and reference."""
    b, backends = plan.budget, plan.backends
    assert backends.device == plan.config.device
    assert (backends.device, backends.attention, backends.experts) in (
        ("cpu", "torch", "reference"), ("cuda", "triton", "triton"))
    names = {r.name for r in plan.buffers}
    graphs = backends.graph_blocker is None
    assert graphs == (backends.device == "cuda")
    if graphs and b.decode_batch_sizes:
        assert plan.buffer("graph.decode.input_ids").shape == (b.decode_graph,)
    else:
        assert not [n for n in names if n.startswith("graph.decode.")]
    if not (graphs and b.prefill_token_sizes):
        assert not [n for n in names if n.startswith("graph.prefill.")]
    assert plan.buffer("req_to_token").shape == (b.max_running_requests + 1, b.context_length)
    if backends.attention == "triton":
        check_decode_partials(plan)
    else:
        assert not [n for n in names if n.startswith("attn.decode.")]


def check_decode_partials(plan) -> None:
    """The decode attention's partials hold every decode batch the plan admits (or pads a
    graph to) with the splits the rule takes on a device of up to PLANNED_SMS SMs, and no
    more (a device with more SMs clamps its splits to them)."""
    spec, lay, b = plan.spec, plan.layout, plan.budget
    tiles = AT.ATTENTION_TILES
    heads = spec.num_heads // lay.attn_tp
    if spec.mla is None:
        groups, width, whole = kv_heads_per_rank(spec, lay), spec.head_dim, tiles.gqa_whole_from
    else:
        groups = -(-heads // tiles.mla_decode[0])
        width, whole = spec.mla.kv_lora_rank, tiles.mla_whole_from
    top = min(max([b.max_running_requests, *b.decode_batch_sizes]), 2 * AT.PLANNED_SMS)

    def need(sms: int) -> int:
        splits = [(bs, tiles.decode_num_splits(bs, groups, sms, whole))
                  for bs in range(1, top + 1)]
        return max([bs * s for bs, s in splits if s > 1], default=0)

    names = {r.name for r in plan.buffers}
    if not need(AT.PLANNED_SMS):
        assert "attn.decode.part_o" not in names and "attn.decode.part_lse" not in names
        return
    slots = need(AT.PLANNED_SMS)
    assert plan.buffer("attn.decode.part_o").shape == (slots, heads, width)
    assert plan.buffer("attn.decode.part_lse").shape == (slots, heads)
    assert all(need(sms) <= slots for sms in (8, 78, 114, 132, 148))


@SETTINGS
@given(valid_configs())
def test_each_bound_is_reached_by_an_admissible_forward(cfg):
    plan = build_plan(cfg, SPECS[cfg.model.split(":")[1]])
    if plan.budget is None:
        return
    b = plan.budget
    # extend: one prompt as long as the context, cut by the scheduler's rule
    prompt = b.context_length
    first_chunk = min(prompt, b.chunk_tokens) if b.chunk_tokens else prompt
    prompts_in_one_prefill = [first_chunk]
    while b.chunk_tokens and sum(prompts_in_one_prefill) < b.extend:
        prompts_in_one_prefill.append(min(b.extend - sum(prompts_in_one_prefill), prompt))
    assert sum(prompts_in_one_prefill) <= b.extend
    assert sum(prompts_in_one_prefill) == b.extend or not b.chunk_tokens
    # decode: every running slot full
    assert b.decode == b.max_running_requests * b.tokens_per_decode_request
    # graphs: the largest bucket is itself a forward the runner replays
    assert b.decode_graph == max(b.decode_batch_sizes, default=0) * b.tokens_per_decode_request
    assert b.decode_graph <= b.decode
    assert b.prefill_graph == max(b.prefill_token_sizes, default=0) <= b.extend
    if b.mixed is not None:
        assert b.mixed == b.extend
    assert b.idle == 0 and b.warmup == b.extend


@SETTINGS
@given(valid_configs())
def test_capture_lists_sorted_unique_divisible_and_within_max(cfg):
    plan = build_plan(cfg, SPECS[cfg.model.split(":")[1]])
    if plan.budget is None:
        return
    b, lay = plan.budget, plan.layout
    mult = capture_multiple(lay)
    for sizes in (b.decode_batch_sizes, b.prefill_token_sizes):
        assert list(sizes) == sorted(set(sizes))
        assert all(s >= 1 and s % mult == 0 for s in sizes)
    if cfg.disable_cuda_graph:
        assert b.decode_batch_sizes == ()
    else:
        limit = b.max_running_requests
        if cfg.cuda_graph_max_bs:
            limit = min(limit, cfg.cuda_graph_max_bs)
        assert all(s <= limit for s in b.decode_batch_sizes)
        if cfg.cuda_graph_bs:
            assert set(b.decode_batch_sizes) <= set(cfg.cuda_graph_bs)
        if not b.decode_batch_sizes:
            assert any("decode CUDA-graph" in e.message for e in plan.errors)
    if cfg.disable_piecewise_cuda_graph:
        assert b.prefill_token_sizes == ()
    elif cfg.piecewise_cuda_graph_max_tokens:
        assert all(s <= cfg.piecewise_cuda_graph_max_tokens for s in b.prefill_token_sizes)
    if lay.scatter_across_attn_tp:
        assert mult == lay.attn_tp


@st.composite
def any_configs(draw):
    small = st.integers(-3, 12)
    return EngineConfig(
        model=f"preset:{draw(st.sampled_from(sorted(SPECS)))}",
        tp_size=draw(small), dp_size=draw(small), enable_dp_attention=draw(st.booleans()),
        ep_size=draw(small), moe_dense_tp_size=draw(st.one_of(st.none(), small)),
        moe_a2a_backend=draw(st.sampled_from(["none", "all_to_all"])),
        moe_a2a_max_tokens_per_rank=draw(st.one_of(st.none(), st.integers(-5, 100000))),
        max_running_requests=draw(st.one_of(st.none(), st.integers(-5, 5000))),
        max_prefill_tokens=draw(st.integers(-5, 50000)),
        chunked_prefill_size=draw(st.one_of(st.none(), st.integers(-5, 50000))),
        page_size=draw(st.integers(-1, 64)),
        mem_fraction_static=draw(st.floats(-1, 2, allow_nan=False)),
        cuda_graph_bs=draw(st.one_of(st.none(), st.lists(st.integers(-2, 300), max_size=5)
                                     .map(tuple))),
        cuda_graph_max_bs=draw(st.one_of(st.none(), st.integers(-2, 600))),
        speculative_num_draft_tokens=draw(st.one_of(st.none(), st.integers(-2, 8))),
        context_length=draw(st.one_of(st.none(), st.integers(-2, 10 ** 6))),
        max_total_tokens=draw(st.one_of(st.none(), st.integers(-2, 10 ** 7))),
        gpu_memory_gb=draw(st.one_of(st.none(), st.floats(-1, 200, allow_nan=False))),
    )


@SETTINGS
@given(st.one_of(any_configs(), valid_configs()))
def test_any_config_gives_a_plan_or_errors_never_a_traceback(cfg):
    plan = build_plan(cfg, SPECS[cfg.model.split(":")[1]])
    for e in plan.errors:
        assert e.message and e.fix
    if plan.ok:
        assert plan.budget is not None and plan.memory is not None
        assert plan.memory.kv_capacity_tokens >= plan.budget.context_length
        m = plan.memory
        assert m.weights_bytes_per_rank + m.static_buffer_bytes_per_rank + \
            m.kv_capacity_tokens * m.kv_bytes_per_token_per_rank <= m.static_budget_bytes
        assert math.prod(plan.buffer("kv_cache").shape) > 0


def test_an_empty_capture_list_is_an_error_with_its_fix():
    """Found by the property above: `--cuda-graph-bs` given no sizes raised from max()."""
    plan = build_plan(EngineConfig(model="preset:deepseek-v2-lite", cuda_graph_bs=()),
                      SPECS["deepseek-v2-lite"])
    assert not plan.ok and any("--cuda-graph-bs is empty" in e.message
                               and "--disable-cuda-graph" in e.fix for e in plan.errors)


def test_moe_down_workspace_follows_the_gpu_tile_tables(monkeypatch):
    """On a GPU whose tables sum the top-k in down from some step size on (ATOMIC_SUM), the
    [P, H] workspace holds only the steps below it, and the KV cache gets the bytes."""
    from moeserve.plan import capacity

    spec = SPECS["qwen3-30b-a3b"]
    cfg = EngineConfig(model="preset:qwen3-30b-a3b", gpu_memory_gb=141, device="cuda")
    monkeypatch.setattr(capacity, "local_gpu_name", lambda cfg: None)
    full = build_plan(cfg, spec)
    monkeypatch.setattr(capacity, "local_gpu_name", lambda cfg: "NVIDIA H200")
    h200 = build_plan(cfg, spec)
    rows = full.buffer("moe.router.topk_ids").shape[0]
    assert rows > 1024 and full.buffer("moe.runner.down").shape == (rows * 8, 2048)
    down = h200.buffer("moe.runner.down")
    # the shipped H200 table: entries 512 (top-k pass) and 1024 (ATOMIC_SUM) meet at 724
    assert down.shape == (724 * 8, 2048) and "NVIDIA H200" in down.formula
    saved = (rows - 724) * 8 * 2048 * 2
    assert (full.memory.static_buffer_bytes_per_rank - h200.memory.static_buffer_bytes_per_rank
            == saved)
    assert h200.memory.kv_capacity_tokens > full.memory.kv_capacity_tokens
    # deterministic inference sums every step's top-k in order: every pair's row again
    fixed = build_plan(cfg.replace(enable_deterministic_inference=True), spec)
    assert fixed.buffer("moe.runner.down").shape == (rows * 8, 2048)
