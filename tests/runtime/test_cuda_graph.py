"""Decode CUDA graphs: the bucket choice (CPU), the static buffers from the plan's binder (a
plan for a GPU, bound on the CPU), and on a GPU the same greedy tokens with and without
--disable-cuda-graph."""

from __future__ import annotations

import random

import pytest
import torch

from moeserve.config import EngineConfig
from moeserve.config.spec import load_model_spec
from moeserve.parallel.groups import single_process_state
from moeserve.plan.capacity import build_plan
from moeserve.runtime.buffers import bind_buffers
from moeserve.runtime.cuda_graph import DecodeGraphRunner, choose_bucket, graph_blockers
from moeserve.batch.forward_batch import ForwardMode
from moeserve.batch.kv_cache import DUMMY_REQ_ROW, DUMMY_SLOT, KVCachePool, ReqToTokenPool
from spies import spy


def test_bucket_is_the_smallest_that_holds_the_largest_dp_rank():
    buckets = [1, 2, 4, 8, 12, 16]
    assert choose_bucket(buckets, [3], True) == 4
    assert choose_bucket(buckets, [4], True) == 4
    assert choose_bucket(buckets, [9, 0, 2], True) == 12  # idle DP ranks replay it too
    assert choose_bucket(buckets, [16], True) == 16
    assert choose_bucket(buckets, [17], True) is None  # above the largest: eager
    assert choose_bucket(buckets, [3, 5], False) is None  # some rank prefills: all eager
    assert choose_bucket(buckets, [0, 0], True) is None
    assert choose_bucket([], [1], True) is None
    assert choose_bucket(buckets, [6], True, tokens_per_request=2) == 4


def test_every_rank_takes_the_same_decision():
    """The decision reads only gathered values: any rank's view gives the same bucket."""
    rng = random.Random(0)
    buckets = [1, 2, 4, 8, 16, 24, 32]
    for _ in range(200):
        counts = [rng.choice([0, 1, 3, 7, 9, 31, 40]) for _ in range(4)]
        flags = [rng.random() < 0.8 for _ in range(4)]
        decisions = {choose_bucket(buckets, counts, all(flags)) for _rank in range(4)}
        assert len(decisions) == 1
        (d,) = decisions
        if d is not None:
            assert d >= max(counts) and all(flags)


def _gpu_plan(**flags):
    """A plan for a GPU (decode graphs on), on any machine; its buffers bind on the CPU."""
    cfg = EngineConfig(model="preset:tiny", device="cuda", gpu_memory_gb=1.0,
                       skip_tokenizer_init=True, **flags)
    return build_plan(cfg, load_model_spec(cfg.model))


def test_graph_buffers_come_from_the_plan_and_pad_with_dummy_rows():
    plan = _gpu_plan(max_running_requests=12)
    assert plan.budget.decode_batch_sizes == (1, 2, 4, 8, 12)
    bufs = bind_buffers(plan, "cpu").decode_graph
    assert bufs.req_pool_indices.shape == plan.buffer("graph.decode.req_pool_indices").shape
    assert bufs.logits.shape == plan.buffer("graph.decode.logits").shape
    assert bufs.seq_lens.dtype == torch.int32
    bufs.input_ids.fill_(5)
    bufs.pad(3, 8)
    assert bufs.input_ids[:3].tolist() == [5, 5, 5] and not bufs.input_ids[3:8].any()
    assert (bufs.out_cache_loc[3:8] == DUMMY_SLOT).all()
    assert (bufs.req_pool_indices[3:8] == DUMMY_REQ_ROW).all()
    assert (bufs.seq_lens[3:8] == 1).all()
    pool = KVCachePool(2, 64, 2, 16, torch.float32)
    rows = ReqToTokenPool(4, 32)
    fb = bufs.batch(8, rows.table, pool)
    assert fb.mode is ForwardMode.DECODE and fb.batch_size == 8 and fb.num_tokens == 8
    assert fb.logit_rows is None  # every row of the bucket writes its logits


def test_graph_inputs_are_staged_in_one_copy_and_spread_by_the_graph():
    """A replay's host work: the rows' token, position and request row into `staging` (one
    copy, dummy rows past the batch); the graph's head spreads them into its inputs."""
    plan = _gpu_plan(max_running_requests=12)
    static = bind_buffers(plan, "cpu")
    next_tokens, bufs = static.next_tokens, static.decode_graph
    assert next_tokens.shape == (12,) and bufs.next_tokens is next_tokens
    next_tokens[:3] = torch.tensor([70, 71, 72])
    assert bufs.staging.shape == plan.buffer("graph.decode.staging").shape == (12, 3)
    bufs.stage([7, 8, 9, 4, 4], [10, 20, 30, 5, 5], [3, 1, 2, 6, 6], 8)
    # a smaller batch in the same bucket; -3 and -1: the tokens of rows 2 and 0 of the step
    # before (the overlap schedule's placeholders), read on the device
    bufs.stage([-3, 8, -1], [10, 20, 30], [3, 1, 2], 8)
    bufs.unpack(8)
    pad = [0] * 5
    assert bufs.input_ids[:8].tolist() == [72, 8, 70] + pad
    assert bufs.positions[:8].tolist() == bufs.prefix_lens[:8].tolist() == [10, 20, 30] + pad
    assert bufs.seq_lens[:8].tolist() == [11, 21, 31] + [1] * 5
    assert bufs.req_pool_indices[:8].tolist() == [3, 1, 2] + [DUMMY_REQ_ROW] * 5
    assert bufs.seq_lens.dtype == torch.int32


def test_disable_cuda_graph_leaves_no_buckets_and_cpu_models_are_refused():
    plan = _gpu_plan(disable_cuda_graph=True)
    assert plan.budget.decode_batch_sizes == ()
    assert not [r for r in plan.buffers if r.name.startswith("graph.decode.")]
    assert bind_buffers(plan, "cpu").decode_graph is None
    from moeserve.models.build import build_model

    # the torch attention reads lengths on the host: no graph buffers, on a GPU or not
    torch_attention = _gpu_plan(attention_backend="torch", moe_runner_backend="reference")
    assert torch_attention.budget.decode_batch_sizes
    assert "host lengths" in torch_attention.backends.graph_blocker
    assert not [r for r in torch_attention.buffers if r.name.startswith("graph.")]
    cfg = EngineConfig(model="preset:tiny", device="cpu", gpu_memory_gb=1.0)
    plan = build_plan(cfg, load_model_spec(cfg.model))
    assert plan.budget.decode_batch_sizes and "not a GPU" in plan.backends.graph_blocker
    assert not [r for r in plan.buffers if r.name.startswith("graph.")]
    state = single_process_state(plan.layout, torch.device("cpu"))
    model = build_model(cfg, plan.spec, state, plan)
    reasons = graph_blockers(model, torch.device("cpu"))
    assert any("not a GPU" in r for r in reasons)
    assert any("TorchAttentionBackend" in r for r in reasons)
    bufs = bind_buffers(plan, "cpu")
    assert bufs.decode_graph is None
    assert DecodeGraphRunner.create(plan, model, state, None, bufs.kv_pool, bufs.req_pool) is None


@pytest.mark.gpu
def test_cuda_graph_and_overlap_decode_give_the_eager_tokens(monkeypatch):
    from moeserve.runtime.engine import Engine

    buckets = spy(monkeypatch, DecodeGraphRunner, "replay", lambda self, batch, bs: bs)
    rng = random.Random(7)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 9, 33, 70, 4, 17)]
    params = [{"max_new_tokens": m, "temperature": 0.0, "ignore_eos": True}
              for m in (24, 9, 17, 3, 30, 12)]
    params[2].update(temperature=0.8, seed=5)  # seeded: the same tokens in every run
    flags = dict(load_format="dummy", dtype="float32", device="cuda", skip_tokenizer_init=True,
                 max_running_requests=16, max_total_tokens=4096, context_length=256,
                 attention_backend="triton", moe_runner_backend="reference")
    results = {}
    for graphs, overlap in ((True, True), (False, True), (True, False)):
        with Engine("preset:tiny", disable_cuda_graph=not graphs,
                    disable_overlap_schedule=not overlap, **flags) as engine:
            out = engine.generate(input_ids=prompts, sampling_params=params)
        assert all(o["error"] is None for o in out), out
        results[graphs, overlap] = [o["token_ids"] for o in out]
    assert [len(t) for t in results[True, True]] == [p["max_new_tokens"] for p in params]
    assert results[True, True] == results[False, True] == results[True, False]
    assert buckets and set(buckets) <= {1, 2, 4, 8, 12, 16}
    assert len(set(buckets)) >= 2  # the batch shrank through several buckets
