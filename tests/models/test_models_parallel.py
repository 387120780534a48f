"""The architectures under tp=2, ep=2 (with replicated dense layers) and DP attention dp=2, on
gloo ranks: the same logits as transformers (fp32, relative error <= 1e-4). One spawned world
per layout; each world loads the four tiny sharded checkpoints (read slice by slice, each rank
its own part), and the tp=2 world also checks that dummy weights do not depend on the layout."""

from __future__ import annotations

import pytest
import torch

from moeserve.testing.multiproc import run_ranks
from moeserve.testing.tiny_models import hf_logits, make_hf_model, save_checkpoint
from test_models import CASES, DECODE, PROMPTS, TOL, full_sequences

pytestmark = pytest.mark.multiproc

PARALLEL_CASES = ["qwen3-tied-yarn", "qwen2-dense-first", "mixtral-tied-window",
                  "olmoe-tied-bias"]
FIRST = [4, 1, 6, 0]
LAYOUTS = {
    "tp2": {},
    "ep2-dense-replicated": {"ep_size": 2, "moe_dense_tp_size": 1},
    "dp2-attention": {"dp_size": 2, "enable_dp_attention": True},
}
ONE_SHOT = "tp2-one-shot-windows"  # tp2 with each axis's window emulated on gloo


def _spy_windows(calls: list) -> None:
    """Every axis of more than one rank gets a one-shot window of 64 KiB, emulated on gloo
    (collective_ranks.SpyCollectives): the layers take the paths a GPU's window gives them,
    fused norms included, and `calls` records them."""
    from types import SimpleNamespace

    from collective_ranks import SpyCollectives
    from moeserve.batch.buffers import CommWindows

    window = SimpleNamespace(local=torch.empty(8 * (64 << 10), dtype=torch.uint8))  # 64 KiB
    CommWindows.collectives = lambda self, name, axis: (
        None if axis.size == 1 else SpyCollectives(window, axis, calls))


def _world(rank: int, world: int, layout_kw: dict, cases: list, dummy_ref,
           one_shot: bool = False) -> list:
    from moeserve.parallel.groups import init_parallel_state
    from moeserve.parallel.layout import ParallelLayout
    from moeserve.batch.forward_batch import ForwardMode
    from moeserve.testing.tiny_models import (TinyRunner, compare_three_ways, load_tiny,
                                              rel_err, tiny_config)

    calls: list = []
    if one_shot:
        _spy_windows(calls)
    state = None
    results = []
    for name, folder, ref in cases:
        cfg = tiny_config(folder, tp_size=world, **layout_kw)
        state = state or init_parallel_state(ParallelLayout.from_config(cfg))
        model, plan = load_tiny(cfg, state)
        runner = TinyRunner(model, state, plan)
        # DP attention: each DP rank serves its own requests
        mine = list(range(len(PROMPTS)))
        if state.layout.dp > 1:
            mine = mine[:2] if state.dp_rank == 0 else mine[2:]
        pick = lambda xs: [xs[i] for i in mine]  # noqa: E731
        errs = compare_three_ways(runner, pick(PROMPTS), pick(DECODE), pick(ref), pick(FIRST))
        if state.layout.dp > 1:  # one DP rank idle while the other runs a prefill
            if state.dp_rank == 0:
                got = runner.forward(ForwardMode.EXTEND, pick(PROMPTS), [20, 21])
                lens = [len(p) for p in pick(PROMPTS)]
                errs += [(f"extend beside an idle rank {i}", rel_err(g, r[:n])) for i, g, r, n
                         in zip(mine, got.split(lens), pick(ref), lens)]
            else:
                assert runner.idle().shape[0] == 0
        results.append((name, max(errs, key=lambda e: e[1])))
    if dummy_ref is not None:
        cfg = tiny_config("preset:tiny", tp_size=world, load_format="dummy", **layout_kw)
        model, plan = load_tiny(cfg, state)
        got = TinyRunner(model, state, plan).forward(ForwardMode.EXTEND, PROMPTS, range(4))
        results.append(("dummy preset:tiny", ("all tokens", rel_err(got, dummy_ref))))
    if one_shot:
        results.append(("collectives", sorted({c[0] for c in calls})))
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = []
    for name in PARALLEL_CASES:
        arch, hf_cfg, shard = CASES[name]
        hf = make_hf_model(arch, seed=len(name), **hf_cfg)
        folder = save_checkpoint(hf, tmp_path_factory.mktemp(name), shard)
        out.append((name, str(folder), hf_logits(hf, full_sequences())))
    return out


def _dummy_reference() -> torch.Tensor:
    from moeserve.parallel.groups import single_process_state
    from moeserve.batch.forward_batch import ForwardMode
    from moeserve.testing.tiny_models import TinyRunner, load_tiny, tiny_config

    state = single_process_state()
    model, plan = load_tiny(tiny_config("preset:tiny", load_format="dummy"), state)
    logits = TinyRunner(model, state, plan).forward(ForwardMode.EXTEND, PROMPTS, range(4))
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    return logits


def test_with_one_shot_windows_the_norms_take_the_block_sums(checkpoints):
    """tp2 with a one-shot window on each axis (emulated on gloo): the attention's all-reduce
    and each MoE / dense block's sum are left to the norm after them (one launch on a GPU),
    with the same logits as transformers."""
    for rank, results in enumerate(run_ranks(_world, 2, {}, checkpoints, None, True,
                                             timeout=300)):
        *models, (what, calls) = results
        assert what == "collectives" and "all_reduce_add_rms_norm" in calls, calls
        assert len(models) == len(checkpoints)
        for name, (where, err) in models:
            assert err <= TOL, f"{ONE_SHOT} rank {rank} {name}: {where} relative error {err:.2e}"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logits_match_transformers_in_parallel(layout, checkpoints):
    dummy_ref = _dummy_reference() if layout == "tp2" else None
    per_rank = run_ranks(_world, 2, LAYOUTS[layout], checkpoints, dummy_ref, timeout=300)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(checkpoints) + (dummy_ref is not None)
        for name, (what, err) in results:
            tol = 1e-5 if name.startswith("dummy") else TOL
            assert err <= tol, f"{layout} rank {rank} {name}: {what} relative error {err:.2e}"
