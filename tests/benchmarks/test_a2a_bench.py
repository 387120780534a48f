"""`python -m benchmarks a2a` on the CPU: its CLI takes --models; every model's plans (nvlink
and all_to_all, 2 and 4 GPUs) build for the buffers alone, DeepSeek-V3 in bf16 included;
the symmetric accounting matches a bind; the section has a table and a workspace per model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import a2a, a2a_plans  # noqa: E402

MODELS = ("preset:qwen3-30b-a3b", "preset:deepseek-v3")
GPU_BYTES = 80 * 10**9


@pytest.mark.timeout(60)
def test_help_lists_models():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "a2a", "--help"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "--models" in proc.stdout


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_every_plan_builds_for_the_buffers_alone(model, world):
    assert a2a_plans.plan_errors(model, world, list(a2a.SIZES), GPU_BYTES) == []
    plan = a2a_plans.plan_for(model, "nvlink", world, list(a2a.SIZES), GPU_BYTES)
    assert plan.backends.a2a == "nvlink" and plan.dtype == "bfloat16" and plan.quant is None
    assert plan.layout.ep == plan.layout.dp == world
    assert sorted(r.name for r in plan.buffers if r.symmetric) == ["a2a.combine", "a2a.recv"]
    # the weights the benchmark leaves out are room beyond the GPU's memory
    assert plan.memory.static_budget_bytes - plan.memory.weights_bytes_per_rank == \
        pytest.approx(GPU_BYTES * plan.config.mem_fraction_static, abs=2)


def test_symmetric_bytes_are_the_bound_windows():
    from moeserve.runtime.buffers import bind_model_buffers

    plan = a2a_plans.plan_for("preset:tiny", "nvlink", 2, [8, 32], GPU_BYTES)
    bufs = bind_model_buffers(plan, "cpu")
    w = a2a_plans.symmetric_bytes(plan, bufs, (0, 10), (4, 3))
    assert w["records"] == ["a2a.recv", "a2a.combine"]
    assert w["plan_bytes"] == w["bound_bytes"] == bufs.a2a.recv.nbytes + bufs.a2a.combine.nbytes
    assert w["other_bound_bytes"] >= bufs.a2a.slots.nbytes + bufs.a2a.sources.nbytes
    assert (w["allocator_bytes"], w["device_bytes"]) == (4, 7)


def _rank(rank: int) -> dict:
    rows = [{"tokens_per_rank": m, "sent_rows": m, "link_bytes": 1000 * m,
             "moved_bytes": 4000 * m, "nvlink_us": 10.0 + rank, "nvlink_graph": True,
             "all_to_all_us": 50.0, "all_to_all_graph": True, "nccl_us": 20.0,
             "nccl_graph": False, "dispatch_us": 5.0, "combine_us": 6.0} for m in (1, 8)]
    workspace = {"records": ["a2a.recv", "a2a.combine"], "plan_bytes": 3 << 20,
                 "bound_bytes": 3 << 20, "other_bound_bytes": 1 << 20,
                 "allocator_bytes": 1 << 20, "device_bytes": 4 << 20}
    return {"peer_store_GBps": 300.0,
            "models": {m: {"workspace": workspace, "rows": rows} for m in MODELS}}


def test_the_section_has_a_table_and_a_workspace_per_model():
    ranks = {r: _rank(r) for r in range(4)}
    lines = [line for m in MODELS for line in a2a.render(ranks, m)]
    text = "\n".join(lines)
    assert "### preset:deepseek-v3: 256 experts, top-8, hidden 7168, bfloat16" in text
    assert "### preset:qwen3-30b-a3b: 128 experts, top-8, hidden 2048, bfloat16" in text
    assert text.count("| tokens per rank |") == 2 and text.count("| rank |") == 2
    assert "| 3 | a2a.recv, a2a.combine | 3.0 | 3.0 | 1.0 | 1.0 | 4.0 |" in text
    assert "| 20.0 (eager) |" in text
