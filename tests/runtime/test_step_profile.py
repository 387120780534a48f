"""MOESERVE_PROFILE_DIR: every rank writes the host phases of its loop per kind of iteration,
with MOESERVE_PROFILE_KERNELS the ops of a window of forwards (MOESERVE_PROFILE_TRACE: and
their timeline), with MOESERVE_PROFILE_STACKS
its loop's sampled stacks per phase; off, the loop writes nothing."""

from __future__ import annotations

import gzip
import json

import pytest

from moeserve.runtime.engine import Engine, EngineError
from moeserve.runtime.host_stacks import HostStacks
from moeserve.runtime.step_profile import (DIR_ENV, KERNELS_ENV, STACKS_ENV, TRACE_ENV,
                                          StepProfile)

FLAGS = dict(load_format="dummy", device="cpu", skip_tokenizer_init=True, max_total_tokens=2048,
             context_length=128, max_running_requests=8, cpu_threads_per_rank=1)
PARAMS = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[3, 17, 42, 5], [60, 2, 9], [11, 12, 13, 14, 15]]


@pytest.mark.parametrize("layout", [pytest.param({}, id="tp1"),
                                    pytest.param(dict(tp_size=2, dp_size=2,
                                                      enable_dp_attention=True),
                                                 id="dp2", marks=pytest.mark.multiproc)])
def test_each_rank_writes_its_phases_and_kernel_window(layout, tmp_path, monkeypatch):
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    monkeypatch.setenv(KERNELS_ENV, "2:3")
    monkeypatch.setenv(TRACE_ENV, "1")
    with Engine("preset:tiny", **FLAGS, **layout) as e:
        out = e.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    assert all(o["error"] is None for o in out)
    ranks = layout.get("tp_size", 1)
    for r in range(ranks):
        steps = json.loads((tmp_path / f"rank{r}_steps.json").read_text())
        # 8 tokens: a prefill and 7 decodes, 3 of these forwards in the window (not counted)
        assert steps["prefill"]["iterations"] + steps["decode"]["iterations"] >= 8 - 3
        assert steps["decode"]["iterations"] >= 3
        phases = steps["decode"]["phases"]
        for name in ("schedule", "exchange", "launch.forward", "launch.sampling",
                     "collect.wait", "collect.process", "publish", "iteration"):
            assert name in phases, (r, name, sorted(phases))
        for v in phases.values():  # the tail beside the median
            assert v["p50_us"] <= v["p90_us"] <= v["p99_us"] <= v["max_us"]
        parts = sum(v["mean_us"] for k, v in phases.items() if k != "iteration")
        assert 0 < parts <= phases["iteration"]["mean_us"] * 1.01
        kernels = (tmp_path / f"rank{r}_kernels.txt").read_text().splitlines()
        assert kernels[0].startswith(f"rank {r}: 3 forwards (")
        assert "; host (no GPU) time per forward" in kernels[0]
        assert len(kernels) > 3  # the ops of the window, most expensive first
        with gzip.open(tmp_path / f"rank{r}_trace.json.gz", "rt") as f:  # the window's timeline
            events = json.load(f)["traceEvents"]
        assert any(ev.get("ph") == "X" for ev in events)
        assert not (tmp_path / f"rank{r}_trace.json").exists()
    assert not list(tmp_path.glob(f"rank{ranks}_*"))


def test_off_without_the_folder_and_a_bad_window_is_named(monkeypatch):
    monkeypatch.delenv(DIR_ENV, raising=False)
    assert StepProfile.from_env(0) is None
    monkeypatch.setenv(DIR_ENV, "/tmp/moeserve-profile-test")
    monkeypatch.setenv(KERNELS_ENV, "200")
    with pytest.raises(ValueError, match="expected START:COUNT"):
        StepProfile.from_env(0)
    monkeypatch.delenv(KERNELS_ENV)
    monkeypatch.setenv(STACKS_ENV, "fast")
    with pytest.raises(ValueError, match="interval in milliseconds"):
        StepProfile.from_env(0)
    with pytest.raises(ValueError, match="give one > 0"):
        HostStacks(0)


def test_a_window_on_demand_profiles_the_forwards_after_the_skip(tmp_path, monkeypatch):
    """Engine.profile_kernels: the window starts where the call says, not at startup (a tool
    profiles a pass it does not time); without the folder it is refused."""
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    monkeypatch.delenv(DIR_ENV, raising=False)
    with Engine("preset:tiny", **FLAGS) as e:
        with pytest.raises(EngineError, match=DIR_ENV):
            e.profile_kernels(3)
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    with Engine("preset:tiny", **FLAGS) as e:
        e.generate(input_ids=PROMPTS, sampling_params=PARAMS)
        assert not (tmp_path / "rank0_kernels.txt").exists()  # no window without a call
        with pytest.raises(ValueError, match="count >= 1"):
            e.profile_kernels(0)
        e.profile_kernels(4, skip=2)  # after the prefill and a decode: decodes only
        out = e.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    assert all(o["error"] is None for o in out)
    kernels = (tmp_path / "rank0_kernels.txt").read_text().splitlines()
    assert kernels[0].startswith("rank 0: 4 forwards (4 decode); "), kernels[0]


def test_exclusive_times_count_an_overlap_once_per_stream():
    """Under PDL a kernel starts while the one before runs and waits: its span holds the
    other's tail, its exclusive time does not; the exclusive times sum to the busy time."""
    from moeserve.runtime.step_profile import exclusive_times, kernel_table

    s0, s1 = (0, 7), (0, 8)
    spans = [(s0, 0.0, 10.0, "a"),  # a runs 0-10
             (s0, 4.0, 14.0, "b"),  # b placed at 4, waits for a: 4 us its own
             (s0, 5.0, 9.0, "c"),  # inside b's span entirely: nothing its own
             (s0, 20.0, 25.0, "a"),  # after a gap
             (s1, 2.0, 6.0, "b")]  # another stream: its own busy time
    t = exclusive_times(spans)
    assert t["a"] == [15.0, 15.0, 2] and t["c"] == [0.0, 4.0, 1]
    assert t["b"] == [4.0 + 4.0, 10.0 + 4.0, 2]
    assert sum(v[0] for v in t.values()) == 14.0 + 5.0 + 4.0  # the union, stream by stream
    lines = kernel_table(t, 2, "rank 0: 2 forwards (2 decode); ")
    assert lines[0] == ("rank 0: 2 forwards (2 decode); device busy time per forward 11.5 us "
                        "(the kernels' exclusive times; their spans summed: 16.5 us)")
    assert [ln.split()[-1] for ln in lines[2:]] == ["a", "b", "c"]  # most exclusive first
    assert lines[2].split()[:3] == ["7.5", "7.5", "1.0"]


def test_stacks_count_where_the_open_phase_waits():
    """A phase that blocks in one function gets the samples taken while it is open, and its
    stacks name that function innermost-first; nothing is counted before a phase opens."""
    import sys
    import time

    def held_in_here():
        time.sleep(0.12)

    switch = sys.getswitchinterval()
    stacks = HostStacks(2)
    time.sleep(0.02)  # no phase opened yet: no thread to sample
    assert not stacks.counts
    stacks.enter("wait")
    held_in_here()
    stacks.leave()
    stacks.stop()
    assert sys.getswitchinterval() == switch
    waits = stacks.counts["wait"]
    assert sum(waits.values()) >= 10
    top, _ = waits.most_common(1)[0]
    assert top.startswith("test_step_profile.py:") and "held_in_here" in top.split(" < ")[0]
    report = stacks.report(0)
    assert report[0].startswith("rank 0: ") and any(line.startswith("wait: ") for line in report)


def test_the_engine_loop_writes_its_stacks_per_phase(tmp_path, monkeypatch):
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    monkeypatch.setenv(STACKS_ENV, "0.5")
    with Engine("preset:tiny", **FLAGS) as e:
        out = e.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    assert all(o["error"] is None for o in out)
    lines = (tmp_path / "rank0_stacks.txt").read_text().splitlines()
    assert lines[0].startswith("rank 0: ")
    phases = {line.split(":")[0] for line in lines[1:] if line and not line.startswith(" ")}
    assert "launch.forward" in phases, lines
    assert any(".py:" in line for line in lines if line.startswith("  "))
