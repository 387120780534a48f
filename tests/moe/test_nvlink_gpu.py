"""The nvlink dispatcher on 2 and 4 GPUs (moe/dispatch/nvlink.py): the same outputs as the
NCCL all_to_all dispatcher, bit for bit in fp32 and within 1e-2 relative in bf16, under skewed
routing, every token to one rank, a rank with zero rows, ids of -1 and duplicates, and the cap
exactly reached, with DP attention and with the SP layout (ep = the world); a CUDA-graph replay
equals an eager run; the same bits run to run; greedy tokens of every layout of GREEDY equal
one GPU's in fp32. On a CPU: every layout of both builds a plan that the engine accepts."""

from __future__ import annotations

import random

import pytest

from moe_cases import tiny_spec
from moeserve.config import EngineConfig
from moeserve.runtime.engine import make_plan
from moeserve.testing.multiproc import run_ranks
from nvlink_ranks import CASES, layouts, plan_for, run_world

WORLDS = [pytest.param(w, marks=pytest.mark.gpu(w), id=f"{w}gpus") for w in (2, 4)]


def _greedy_layouts() -> dict[str, dict]:
    """tp2 ep2 on the gather path (replicated rows: the block sums left to the norms after
    them, on the one-shot windows) and over nvlink with and without DP attention; on 4 GPUs
    every ep (1, 2, 4) of the
    gather path and tp4 ep4 over all_to_all and nvlink, each with and without DP attention
    (dp 4). preset:tiny has 4 heads, 2 KV heads (replicated at attn_tp 4), 8 experts and an
    expert intermediate of 32: all of these divide."""
    out = {"tp2 ep2": dict(tp_size=2, ep_size=2, moe_a2a_backend="none"),
           "tp2 ep2 nvlink": dict(tp_size=2, ep_size=2, moe_a2a_backend="nvlink"),
           "tp2 dp2 ep2 nvlink": dict(tp_size=2, ep_size=2, dp_size=2,
                                      enable_dp_attention=True, moe_a2a_backend="nvlink")}
    for ep, a2a in [(1, "none"), (2, "none"), (4, "none"), (4, "all_to_all"), (4, "nvlink")]:
        for dp in (1, 4):
            name = f"tp4{' dp4' if dp > 1 else ''} ep{ep}{'' if a2a == 'none' else ' ' + a2a}"
            out[name] = dict(tp_size=4, ep_size=ep, dp_size=dp, enable_dp_attention=dp > 1,
                             moe_a2a_backend=a2a)
    return out


GREEDY = _greedy_layouts()
FLAGS = dict(load_format="dummy", dtype="float32", device="cuda", skip_tokenizer_init=True,
             max_running_requests=16, max_total_tokens=4096, context_length=256,
             moe_runner_backend="reference")


@pytest.mark.multiproc
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nvlink_equals_the_nccl_all_to_all(dtype, world):
    records = [r for rank in run_ranks(run_world, world, dtype, backend="nccl", timeout=400)
               for r in rank]
    failures = [r for r in records if r["case"] == "exception"]
    if failures:
        pytest.fail(failures[0]["error"])
    for layout in layouts(world):
        for case in CASES:
            rows = [r for r in records if r["layout"] == layout and r["case"] == case]
            assert len(rows) == world, (layout, case)
            for r in rows:
                where = (layout, case, r["rank"])
                if dtype == "float32":
                    assert r["equal"], (where, r["rel_err"])
                assert r["rel_err"] <= 1e-2, where
                assert r["graph_equal"] and r["repeat_equal"], where
        cap_rows = [r for r in records if r["layout"] == layout and r["case"] == "cap"]
        assert all(r["runtime_max"] == r["cap"] for r in cap_rows)
        for r in (r for r in records if r["layout"] == layout and r["case"] == "symmetric_bytes"):
            assert r["names"] == ["a2a.combine", "a2a.recv"]
            assert r["plan"] == r["allocated"] > 0


def _greedy_tokens(layout: dict) -> list[list[int]]:
    from moeserve.runtime.engine import Engine

    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 9, 33, 70, 4, 17)]
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    with Engine("preset:tiny", **FLAGS, **layout) as engine:
        out = engine.generate(input_ids=prompts, sampling_params=params)
    assert all(o["error"] is None for o in out), (layout, out)
    return [o["token_ids"] for o in out]


@pytest.fixture(scope="module")
def one_gpu_tokens() -> list[list[int]]:
    return _greedy_tokens({})


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.gpu(kw["tp_size"]))
                                  for n, kw in GREEDY.items()])
def test_greedy_tokens_of_the_layout_equal_one_gpu(name, one_gpu_tokens):
    assert _greedy_tokens(GREEDY[name]) == one_gpu_tokens, name


@pytest.mark.parametrize("name", list(GREEDY))
def test_every_greedy_layout_plans(name):
    plan = make_plan(EngineConfig(model="preset:tiny", **FLAGS, **GREEDY[name]))
    assert plan.layout.tp == GREEDY[name]["tp_size"]
    assert plan.backends.a2a == GREEDY[name]["moe_a2a_backend"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["dp_attention", "sp"])
def test_every_exchange_layout_plans(world, layout):
    for a2a in ("nvlink", "all_to_all"):
        for dtype in ("float32", "bfloat16"):
            plan = plan_for(layouts(world)[layout], a2a, dtype, tiny_spec("qwen3"))
            assert plan.ok, plan.errors
            assert plan.layout.ep == world and plan.backends.a2a == a2a


@pytest.mark.multiproc
@pytest.mark.parametrize("world", WORLDS)
def test_nvlink_fp8_rows_equal_the_nccl_all_to_all(world):
    from nvlink_ranks import check_fp8_records, run_fp8_world

    check_fp8_records([r for rank in run_ranks(run_fp8_world, world, "cuda", backend="nccl",
                                               timeout=400) for r in rank], world)
