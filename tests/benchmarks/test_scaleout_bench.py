"""`benchmarks scaleout`'s engine loop on the CPU (tiny preset): a row per layout and
concurrency, a layout whose plan cannot be met is a row that says why, and --profile adds
rank 0's decode phases and its kernel window to the section."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import scaleout


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_rows_errors_and_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = SimpleNamespace(gpus=3, model="preset:tiny", quantization="none", concurrency=[1, 4],
                           input_len=8, output_len=24, prompts_per_concurrency=1,
                           context_length=128, mem_fraction_static=0.85, profile=True,
                           out=str(tmp_path))
    configs = ["1 GPU (ep 1)", "tp3 ep3, DP attention (dp 3)"]
    rows = scaleout.bench(args, configs)
    ok = [r for r in rows if "error" not in r]
    assert [(r["config"], r["concurrency"]) for r in ok] == [(configs[0], 1), (configs[0], 4)]
    assert all(r["completed"] == r["num_prompts"] for r in ok)
    failed = [r for r in rows if "error" in r]
    assert [r["config"] for r in failed] == [configs[1]] and failed[0]["error"]
    prof = ok[-1]["profile"]
    assert prof["decode"]["iterations"] >= 20
    # the untimed pass's decode forwards, after its prefill
    assert prof["kernels"][0].startswith("rank 0: 10 forwards (10 decode); ")
    text = "\n".join(scaleout.render(rows) + scaleout.render_profile(rows))
    assert "not run" in text and "decode iterations of" in text and "launch.forward" in text
