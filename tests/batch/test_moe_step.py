"""Step metadata (one geometry from the gathered counts), the runtime guard, the layer
communicator's scatter decision, and the capture sizes the scatter needs (invariant 6)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from moe_cases import T_MAX, engine_config, tiny_spec
from moeserve.layers.communicator import LayerCommunicator, layer_scatters
from moeserve.parallel.groups import single_process_state
from moeserve.parallel.layout import ParallelLayout
from moeserve.batch.step import StepTooLarge, check_step, gather_ints, step_from_counts
from moeserve.plan.capacity import build_plan
from moeserve.testing.tiny_models import exchange_step

LAYOUTS = [ParallelLayout(tp=4, dp=1, ep=4, dense_tp=4, a2a=True),
           ParallelLayout(tp=4, dp=2, ep=4, dense_tp=4, a2a=True),
           ParallelLayout(tp=4, dp=2, ep=2, dense_tp=4, a2a=False),
           ParallelLayout(tp=4, dp=1, ep=2, dense_tp=1, a2a=False),
           ParallelLayout(tp=2, dp=2, ep=2, dense_tp=2, a2a=False)]


def _counts_per_rank(lay: ParallelLayout, per_dp: list[int]) -> list[int]:
    return [per_dp[lay.dp_rank(r)] for r in range(lay.tp)]


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda l: l.describe())
@pytest.mark.parametrize("per_dp", [[13, 6], [0, 9], [0, 0], [1, 2], [32, 31]])
def test_every_rank_derives_the_same_geometry(lay, per_dp):
    per_dp = per_dp[: lay.dp]
    counts = _counts_per_rank(lay, per_dp)
    steps = [step_from_counts(counts, lay, r, None) for r in range(lay.tp)]
    # invariant 4: one runtime max, computed from the gathered list, covering every rank's rows
    assert len({s.runtime_max_per_rank for s in steps}) == 1
    scattered = layer_scatters(lay, moe=True)
    for s in steps:
        assert s.tokens_per_dp_rank == tuple(per_dp)
        assert s.rows_per_rank(scattered) == steps[0].rows_per_rank(scattered)
        if lay.a2a:
            assert s.runtime_max_per_rank >= s.num_rows(scattered)
    # invariant 5: under SP the count is the post-scatter count
    want = max(math.ceil(t / lay.attn_tp) if lay.sp else t for t in per_dp)
    assert steps[0].runtime_max_per_rank == want
    # the scatter partitions each DP rank's rows in order, chunks of ceil(T / attn_tp)
    for d in range(lay.dp):
        ranges = [steps[r].row_range(True) for r in range(lay.tp) if lay.dp_rank(r) == d]
        assert ranges[0][0] == 0 and ranges[-1][1] == per_dp[d]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(e - b for b, e in ranges) == math.ceil(per_dp[d] / lay.attn_tp)


def test_padding_rows_are_the_last_rows_of_the_dp_batch():
    lay = LAYOUTS[0]
    steps = [step_from_counts([10] * 4, lay, r, None, num_padding=4) for r in range(4)]
    # chunks of 3: rows 0-2, 3-5, 6-8, 9; valid rows are 0-5
    assert [s.valid_rows(True) for s in steps] == [3, 3, 0, 0]
    assert [s.valid_rows(False) for s in steps] == [6] * 4


def test_attn_tp_ranks_must_agree_on_their_batch():
    with pytest.raises(ValueError, match="must run the same batch"):
        step_from_counts([3, 4, 5, 5], LAYOUTS[1], 0, None)


def _plan(**cfg):
    plan = build_plan(engine_config(**cfg), tiny_spec("qwen3"))
    assert plan.budget is not None
    return plan


def test_guard_names_the_knob_to_raise():
    plan = _plan(tp=4, ep=4, a2a=True)
    check_step([T_MAX], plan.layout, plan)  # the largest planned forward passes
    with pytest.raises(StepTooLarge, match=f"raise --chunked-prefill-size / --max-prefill-tokens "
                                           f"to {T_MAX + 1}"):
        check_step([T_MAX + 1], plan.layout, plan)
    small = _plan(tp=4, ep=4, a2a=True, a2a_cap=3)
    assert not small.ok  # build_plan already refuses it at startup; the guard backs it up
    with pytest.raises(StepTooLarge, match="--moe-a2a-max-tokens-per-rank 4 or more"):
        check_step([13], small.layout, small)  # ceil(13 / 4) = 4 tokens per rank
    check_step([12], small.layout, small)


def test_single_process_step_needs_no_process_group():
    plan = _plan()
    state = single_process_state(plan.layout)
    assert gather_ints([7, 1, 0], state) == [(7, 1, 0)]
    step = exchange_step(7, state, plan, num_padding=2)
    assert (step.num_tokens, step.num_valid_tokens, step.runtime_max_per_rank) == (7, 5, 7)
    comm = LayerCommunicator(state, moe=True)
    x = torch.randn(7, 4)
    assert comm.reduce_attn_output(x, step) is x and comm.gather_rows(x, step) is x
    assert comm.local_rows(x, step).shape == (7, 4)
    with pytest.raises(StepTooLarge):
        exchange_step(T_MAX + 1, state, plan)


def test_scatter_decision_per_kind_of_layer():
    def lay(**kw):
        return ParallelLayout(**{**dict(tp=4, dp=1, ep=4, dense_tp=4, a2a=False), **kw})

    assert not layer_scatters(lay(), moe=True) and not layer_scatters(lay(), moe=False)
    assert layer_scatters(lay(a2a=True), moe=True)  # SP
    assert not layer_scatters(lay(a2a=True), moe=False)
    assert layer_scatters(lay(dense_tp=1), moe=False) and not layer_scatters(lay(dense_tp=1),
                                                                             moe=True)
    assert layer_scatters(lay(dp=2), moe=True) and layer_scatters(lay(dp=2), moe=False)
    assert not layer_scatters(lay(dp=4), moe=True)  # attn_tp 1: rows are already distinct


@pytest.mark.parametrize("cfg", [dict(tp=4, ep=4, a2a=True), dict(tp=4, dp=2, ep=4, a2a=True),
                                 dict(tp=4, ep=4, dense_tp=1), dict(tp=4, dp=2, ep=2),
                                 dict(tp=2, ep=2, dense_tp=1)])
def test_invariant_6_captured_sizes_split_evenly_across_attn_tp(cfg):
    plan = _plan(**cfg)
    lay, b = plan.layout, plan.budget
    assert b.decode_batch_sizes and b.prefill_token_sizes
    for t in b.decode_batch_sizes + b.prefill_token_sizes:
        assert t % lay.attn_tp == 0, t
        step = step_from_counts(_counts_per_rank(lay, [t] * lay.dp), lay, 0, plan)
        assert set(step.scatter_sizes(0)) == {t // lay.attn_tp}  # no padding in a graph
    bad = build_plan(replace(engine_config(**cfg), cuda_graph_bs=(lay.attn_tp + 1,)),
                     tiny_spec("qwen3"))
    assert any("--cuda-graph-bs" in e.fix for e in bad.errors)  # an empty list stops startup
