"""The step's collectives on symmetric memory, on a CPU: the rule that picks the one-shot path
(a collective's full tensor within the window; reductions in a float dtype), collectives.py
handing each collective to it or to NCCL (gloo) by that rule on every rank alike, with the
same results either way; the plan's windows (one per axis that exchanges anything, on the
GPUs of one node only) and their bytes; a CPU never opens one. The kernels' arithmetic is
tests/kernels/test_comm_kernels.py; the GPUs' runs test_symm_comm_gpu.py."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console

from collective_ranks import run_choice
from moe_cases import engine_config, tiny_spec
from moeserve.batch.buffers import CommWindows
from moeserve.config import EngineConfig
from moeserve.config.engine import SYMM_COMM_MAX_BYTES
from moeserve.parallel.groups import Axis
from moeserve.parallel.symm_comm import one_shot_fits
from moeserve.plan.capacity import build_plan
from moeserve.plan.report import print_plan
from moeserve.testing.multiproc import run_ranks


def test_the_rule_is_the_window_and_a_float_dtype_for_sums():
    assert one_shot_fits(1, 1024) and one_shot_fits(1024, 1024)
    assert not one_shot_fits(1025, 1024) and not one_shot_fits(0, 1024)
    assert not one_shot_fits(1, 0)  # --symm-comm-max-bytes 0: no window, NCCL alone
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert one_shot_fits(64, 1024, dtype)
    assert not one_shot_fits(64, 1024, torch.int32)  # a sum of ints stays on NCCL
    assert one_shot_fits(64, 1024)  # a gather moves bytes of any dtype


@pytest.mark.multiproc
def test_collectives_take_the_window_up_to_its_size_and_nccl_above_on_every_rank():
    # rows of 32 bytes; the window takes 20 (2 regions x 2 halves x 2 ranks)
    rows = [1, 7, 20, 21, 64, 0]
    for recs in run_ranks(run_choice, 2, 2 * 2 * 2 * 640, rows, timeout=120):
        for rec in recs:
            n = rec["rows"]
            want = [] if n == 0 or n * 32 > 640 else \
                [(op, n * 32) for op in ("all_gather", "reduce_scatter", "all_reduce")]
            assert rec["calls"] == want, rec
            assert all(rec["equal"].values()), rec
            if want:  # the one-shot gather writes the plan's buffer, unpadded
                assert rec["gathered_into_buffer"]


def test_a_cpu_or_single_rank_window_opens_nothing():
    two, one = Axis(None, 0, 2, (0, 1)), Axis(None, 0, 1, (0,))
    comm = CommWindows(attn_tp=torch.empty(64, dtype=torch.uint8))
    assert comm.collectives("attn_tp", two) is None  # on a CPU: gloo
    assert comm.collectives("attn_tp", one) is None and comm.collectives("world", two) is None


def _plan(device: str = "cuda", **changes):
    cfg = engine_config(tp=2, ep=2).replace(device=device, gpu_memory_gb=1.0,
                                            max_total_tokens=2048, **changes)
    return build_plan(cfg, tiny_spec("qwen3"))


def test_the_plan_has_a_window_per_axis_on_the_gpus_of_one_node():
    plan = _plan()
    assert plan.ok, plan.errors
    comm = {r.name: r for r in plan.buffers if r.name.startswith("comm.")}
    assert set(comm) == {"comm.symm.attn_tp", "comm.symm.world"}
    for rec in comm.values():  # two regions of two halves of a slot per rank (window_bytes)
        assert rec.symmetric and rec.shape == (2 * 2 * 2 * SYMM_COMM_MAX_BYTES,)
        assert rec.dtype == "uint8" and rec.knobs == ("--symm-comm-max-bytes",)
    assert plan.backends.symm_comm_max_bytes == SYMM_COMM_MAX_BYTES
    small = _plan(symm_comm_max_bytes=4096)
    assert {r.name: r.bytes for r in small.buffers if r.name.startswith("comm.")} == \
        {"comm.symm.attn_tp": 32768, "comm.symm.world": 32768}
    # the windows count in the static buffers that the KV cache is left after
    none = _plan(symm_comm_max_bytes=0)
    assert small.memory.static_buffer_bytes_per_rank - \
        none.memory.static_buffer_bytes_per_rank == 2 * 32768
    assert "one-shot on symmetric memory up to 4 KiB (all ranks' rows) over attn_tp, world" \
        in _report(small)


@pytest.mark.parametrize("device, changes, why", [
    ("cuda", dict(symm_comm_max_bytes=0), "--symm-comm-max-bytes 0"),
    ("cpu", {}, "not on the GPUs of one node"),
    ("cuda", dict(nnodes=2, dist_init_addr="127.0.0.1:1"), "not on the GPUs of one node")])
def test_no_window_where_every_collective_runs_on_nccl(device, changes, why):
    plan = _plan(device, **changes)
    assert plan.ok, plan.errors
    assert not any(r.name.startswith("comm.") for r in plan.buffers)
    assert plan.backends.symm_comm_max_bytes == 0
    assert f"NCCL (gloo on a CPU) at every size ({why})" in _report(plan)


def _report(plan) -> str:
    console = Console(record=True, width=200)
    print_plan(plan, console)
    return console.export_text()


def test_one_rank_has_no_window_and_a_bad_size_is_a_problem_with_its_fix():
    one = build_plan(engine_config().replace(device="cuda", gpu_memory_gb=1.0,
                                             max_total_tokens=2048), tiny_spec("qwen3"))
    assert one.ok and not any(r.name.startswith("comm.") for r in one.buffers)
    assert "step collectives: none (one rank)" in _report(one)
    # the triton runner's tiles: the shape's table for the GPU it runs on (none here)
    assert "MoE tiles: the tuned table of E=8,H=" in _report(one)
    # DP attention over every rank and the all-to-all: nothing crosses attn_tp or the world
    cfg = EngineConfig(model="preset:qwen3-30b-a3b", tp_size=2, ep_size=2, dp_size=2,
                       enable_dp_attention=True, moe_a2a_backend="nvlink", device="cuda")
    a2a = build_plan(cfg)
    assert a2a.ok and not any(r.name.startswith("comm.") for r in a2a.buffers)
    assert "none over attn_tp or the world (the all-to-all moves the tokens)" in _report(a2a)
    bad = _plan(symm_comm_max_bytes=-1)
    assert [e.fix for e in bad.errors] == [
        f"set --symm-comm-max-bytes {SYMM_COMM_MAX_BYTES}, or 0 for NCCL alone"]
