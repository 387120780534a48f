"""The MoE layer across ranks (docs/DESIGN.md invariants 1-9).

Two spawned gloo worlds (2 and 4 ranks) run every layout of moe_ranks.LAYOUTS on the same
process group, each with four model kinds (Qwen3-MoE, Qwen2-MoE with a gated shared expert and
GeLU, DeepSeek-V2 grouped top-k, DeepSeek-V3 sigmoid + correction bias), and compare with the
float64 single-process reference (relative error <= 1e-5). Inputs: uneven token counts across
DP ranks and across the attn_tp scatter, a DP rank with zero tokens, an all-idle step, padding
rows, every token routed to one expert, injected ids of -1 and duplicate ids.
"""

from __future__ import annotations

import math

import pytest

from moe_ranks import LAYOUTS, run_world
from moeserve.testing.multiproc import run_ranks

pytestmark = pytest.mark.multiproc
TOL = 1e-5


@pytest.fixture(scope="module")
def records() -> list[dict]:
    out: list[dict] = []
    for world in (2, 4):
        names = [n for n, kw in LAYOUTS.items() if kw["tp"] == world]
        for rank_records in run_ranks(run_world, world, names, timeout=240):
            out += rank_records
    failures = [r for r in out if r["case"] in ("exception", "plan_errors")]
    if failures:
        pytest.fail(f"{failures[0]}\n{failures[0].get('error', '')}")
    return out


def _of(records: list[dict], layout: str, **match) -> list[dict]:
    rows = [r for r in records if r["layout"] == layout
            and all(r.get(k) == v for k, v in match.items())]
    assert rows, (layout, match)
    return rows


def _assert_close(rows: list[dict], *keys: str) -> None:
    for r in rows:
        for k in keys:
            if k in r:
                assert r[k] <= TOL, (f"{r['layout']} {r['kind']} {r['case']} rank {r['rank']}: "
                                     f"{k} = {r[k]:.3g}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layer_matches_single_process_reference(records, layout):
    """Acceptance: every layout, every model kind, every input case (and the decoder flow
    around the layer: reduce-scatter / all-reduce, residual rows, all-gather)."""
    for kind in ("qwen3", "qwen2", "deepseek_v2", "deepseek_v3"):
        rows = _of(records, layout, kind=kind)
        cases = {r["case"] for r in rows}
        assert {"uneven", "idle", "padded", "worst", "hot_expert"} <= cases
        assert "zero_rank" in cases or "few_rows" in cases
        _assert_close(rows, "err_moe", "err_flow")
    for r in _of(records, layout, case="hot_expert"):
        if "all_rows_pick_hot" in r:
            assert r["all_rows_pick_hot"], r  # the case is what it claims


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dense_mlp_and_its_layout_change(records, layout):
    """Dense layers: replicated (--moe-dense-tp-size 1, rows scattered over attn_tp) or split
    over the tp world (all-reduce, or gather + reduce-scatter under DP attention)."""
    rows = _of(records, layout, kind="dense")
    assert len({r["case"] for r in rows}) == 6
    _assert_close(rows, "err_moe", "err_flow")


def test_invariant_1_workspace_is_ep_x_cap_x_payload_from_the_plan(records):
    """The all-to-all workspace allocated at run time has exactly the shape and bytes of the
    plan's record, and cap is per rank: the worst M of any mode, never times ep."""
    for layout, kw in LAYOUTS.items():
        if not kw.get("a2a"):
            continue
        for r in _of(records, layout, case="workspace"):
            k = 3 if r["kind"] == "deepseek_v3" else 2
            payload = 48 * 4 + k * 4 + k * 4
            assert r["a2a_cap"] == max(r["moe_tokens"].values())
            assert r["bound"]  # the dispatcher exchanges through the binder's workspace
            win = r["windows"]
            assert win["recv"]["record_shape"] == (kw["ep"], r["a2a_cap"], payload)
            assert win["recv"]["record_bytes"] == kw["ep"] * r["a2a_cap"] * payload
            if kw["a2a"] == "nvlink":  # results come back into their own window
                assert set(win) == {"recv", "combine", "slots", "sources"}
                assert win["combine"]["record_shape"] == (kw["ep"], r["a2a_cap"], 48 * 4)
            else:  # the combine reuses the send and receive halves
                assert set(win) == {"send", "recv"}
                assert win["send"]["record_shape"] == win["recv"]["record_shape"]
            for w in win.values():  # allocated exactly as recorded
                assert (w["shape"], w["bytes"], w["dtype"]) == \
                    (w["record_shape"], w["record_bytes"], w["record_dtype"])


def test_invariant_2_every_forward_mode_fits_the_cap(records):
    for layout, kw in LAYOUTS.items():
        if not kw.get("a2a"):
            continue
        rows = _of(records, layout, kind="qwen3")
        modes = {r["case"] for r in rows if r["case"].startswith("mode_")}
        assert {"mode_extend", "mode_decode", "mode_decode_graph", "mode_prefill_graph",
                "mode_warmup", "mode_idle"} <= modes
        for r in rows:
            if r["case"].startswith("mode_"):
                assert r["runtime_max"] == r["expect_m"] <= r["cap"], r
        _assert_close([r for r in rows if r["case"].startswith("mode_")], "err_moe")


def test_invariant_3_runner_rows_within_plan_and_workspace_never_reallocated(records):
    """The rows reaching the experts in the worst forward fit the plan's runner rows (which
    size the runner's records, made from the config alone); the all-to-all workspace keeps its
    address across forwards of every size, small ones first."""
    for layout, kw in LAYOUTS.items():
        worst = _of(records, layout, case="worst", kind="qwen3")
        bound = _of(records, layout, case="workspace" if kw.get("a2a") else "runner_bound",
                    kind="qwen3")[0]["runner_rows"]
        for r in worst:
            if "dispatched_rows" in r:
                assert r["dispatched_rows"] <= bound, r
        if kw.get("a2a"):
            for kind in ("qwen3", "deepseek_v3"):
                for rank in range(kw["tp"]):
                    ptrs = {r["a2a_ptrs"] for r in _of(records, layout, kind=kind, rank=rank)
                            if "a2a_ptrs" in r}
                    assert len(ptrs) == 1, ptrs


def test_invariant_4_runtime_max_is_identical_and_covers_local_rows(records):
    for layout, kw in LAYOUTS.items():
        by_case: dict[tuple, set] = {}
        for r in _of(records, layout):
            if "runtime_max" not in r:
                continue
            by_case.setdefault((r["kind"], r["case"]), set()).add(r["runtime_max"])
            if kw.get("a2a"):
                assert r["runtime_max"] >= r.get("rows", 0), r
        for key, values in by_case.items():
            assert len(values) == 1, (layout, key, values)


def test_invariant_5_sp_uses_the_post_scatter_count(records):
    for layout, kw in LAYOUTS.items():
        if not kw.get("a2a"):
            continue
        attn_tp = kw["tp"] // kw.get("dp", 1)
        for r in _of(records, layout, case="random_ids"):
            dp_counts = (13, 6)[: kw.get("dp", 1)]
            assert r["runtime_max"] == max(math.ceil(t / attn_tp) for t in dp_counts)
            assert r["a2a_capacity"] == r["runtime_max"]  # the exchange is sized by it


def test_all_to_all_sends_each_token_once_per_owning_rank(records):
    """Slots a rank receives with ids are exactly the slots the others filled for it (unused
    slots carry ids -1, so no expert computes stale workspace contents)."""
    for layout, kw in LAYOUTS.items():
        if not kw.get("a2a"):
            continue
        for r in _of(records, layout, kind="qwen3", case="random_ids"):
            rows = [x for x in _of(records, layout, kind=r["kind"], case=r["case"])]
            assert sum(x["a2a_sent"][r["rank"]] for x in rows) == r["a2a_received"]
        for r in _of(records, layout, case="one_expert"):
            owner = 5 // (8 // kw["ep"])  # every id is expert 5: one slot per token, to its owner
            assert r["a2a_sent"] == [r["rows"] if p == owner else 0 for p in range(kw["ep"])]


def test_invariant_7_zero_token_ranks_take_part(records):
    """A rank with zero rows runs every collective of the step: nothing hangs (the worlds have
    timeouts) and the other ranks' results are right."""
    for layout, kw in LAYOUTS.items():
        zero = [r for r in _of(records, layout) if r.get("rows") == 0
                or r.get("local_tokens") == 0]
        assert zero, layout
        for case in ("idle", "zero_rank" if kw.get("dp", 1) > 1 else "few_rows"):
            rows = [r for r in _of(records, layout) if r["case"] == case]
            assert len({r["rank"] for r in rows}) == kw["tp"]
            _assert_close(rows, "err_moe", "err_flow", "err_identity")


def test_invariant_8_minus_one_ids_padding_and_duplicates(records):
    for layout in LAYOUTS:
        _assert_close(_of(records, layout, case="random_ids"), "err_moe")
        _assert_close(_of(records, layout, case="one_expert"), "err_moe")
        for r in _of(records, layout, case="padded", kind="qwen3"):
            if "pad_rows_abs_max" in r:
                assert r["pad_rows_abs_max"] == 0.0, r


def test_invariant_9_identity_experts_return_weighted_sum(records):
    for layout in LAYOUTS:
        rows = [r for r in _of(records, layout) if "err_identity" in r]
        assert len({r["case"] for r in rows}) == 4
        _assert_close(rows, "err_identity")


def test_guard_raises_everywhere_and_the_next_step_works(records):
    for layout, kw in LAYOUTS.items():
        checks = ["guard_tokens"] + (["guard_a2a_cap"] if kw.get("a2a") else [])
        for case in checks:
            rows = _of(records, layout, case=case)
            assert len(rows) == kw["tp"]
            messages = {r["error"] for r in rows}
            assert len(messages) == 1 and None not in messages, messages
            knob = ("--moe-a2a-max-tokens-per-rank" if case == "guard_a2a_cap"
                    else "--max-prefill-tokens")
            assert knob in messages.pop()
            _assert_close(rows, "err_after")


def test_nvlink_fp8_rows_equal_the_all_to_all_on_gloo():
    """fp8 rows through the one-sided exchange's layout (peers emulated over gloo): the
    experts get the NCCL-path dispatcher's slots, bytes and scales."""
    from nvlink_ranks import check_fp8_records, run_fp8_world

    check_fp8_records([r for rank in run_ranks(run_fp8_world, 2, "cpu", timeout=300)
                       for r in rank], 2)
