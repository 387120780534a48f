"""The MoE layer across 2 GPUs over NCCL: the same layouts and cases as the gloo worlds of
test_moe_parallel, on CUDA tensors, against the float64 CPU reference."""

from __future__ import annotations

import pytest

from moe_ranks import LAYOUTS, run_world
from moeserve.testing.multiproc import run_ranks

pytestmark = [pytest.mark.gpu(2), pytest.mark.multiproc]


def test_moe_layer_over_nccl_matches_the_reference():
    names = [n for n, kw in LAYOUTS.items() if kw["tp"] == 2]
    records = [r for rank in run_ranks(run_world, 2, names, "cuda", backend="nccl",
                                       timeout=400) for r in rank]
    failures = [r for r in records if r["case"] in ("exception", "plan_errors")]
    if failures:
        pytest.fail(f"{failures[0]}\n{failures[0].get('error', '')}")
    assert {r["layout"] for r in records} == set(names)
    for r in records:
        for key in ("err_moe", "err_flow", "err_identity", "err_after"):
            if key in r:
                assert r[key] <= 1e-5, (r["layout"], r["kind"], r["case"], r["rank"], key, r[key])
    for layout in names:
        guards = [r for r in records if r["layout"] == layout and r["case"] == "guard_tokens"]
        assert len({r["error"] for r in guards}) == 1 and guards[0]["error"]
