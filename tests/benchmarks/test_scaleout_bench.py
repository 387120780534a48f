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
                           dp_attention="both", out=str(tmp_path))
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


def test_the_table_gives_each_layout_against_one_gpu():
    def row(config, c, tps, itl):
        return {"config": config, "concurrency": c, "output_tokens_per_s": tps,
                "ttft_ms_p50": 10.0, "itl_ms_p50": itl}
    rows = [row("1 GPU (ep 1)", 1, 300.0, 3.0), row("1 GPU (ep 1)", 256, 6000.0, 24.0),
            row("tp2 ep2", 1, 240.0, 4.2), row("tp2 ep2", 256, 9000.0, 12.0),
            {"config": "tp2 ep1", "error": "does not fit"}]
    lines = scaleout.render(rows)
    assert "ITL x one GPU" in lines[0]
    cells = {(r[1].strip(), r[2].strip()): [c.strip() for c in r]
             for r in (line.split("|") for line in lines[2:])}
    assert cells[("tp2 ep2", "1")][4] == "0.80" and cells[("tp2 ep2", "1")][7] == "1.40"
    assert cells[("tp2 ep2", "256")][4] == "1.50" and cells[("tp2 ep2", "256")][7] == "0.50"
    assert cells[("tp2 ep1", "-")][3] == "not run" and cells[("tp2 ep1", "-")][7] == "does not fit"


def test_dp_attention_picks_the_layouts_and_keeps_one_gpu():
    every = scaleout.layouts(2)
    on, off = (list(scaleout.dp_filter(every, w)) for w in ("on", "off"))
    assert on[0] == off[0] == "1 GPU (ep 1)"
    assert all("DP attention" in k for k in on[1:]) and len(on) == 5
    assert not any("DP attention" in k for k in off) and len(off) == 5
    assert set(on) | set(off) == set(every) == set(scaleout.dp_filter(every, "both"))
