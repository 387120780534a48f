"""`python -m benchmarks coldstart` end to end on the CPU (tiny preset): two starts in processes
of their own sharing one compile cache, each batch twice, the section; a cache folder that is
not empty is refused, and a part that fails leaves a section that says so (with what it
measured before) and no RESULTS.md entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model", "preset:tiny", "--device", "cpu", "--output-len", "4",
        "--context-length", "128", "--max-running-requests", "8", "--max-total-tokens", "2048"]


def _bench(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "benchmarks", "coldstart", *TINY, *args,
                           "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=150)


@pytest.mark.timeout(180)
def test_coldstart_runs_two_starts_and_writes_its_section(tmp_path):
    cache = tmp_path / "cache"
    results = tmp_path / "RESULTS.md"
    proc = _bench(tmp_path / "out", "--batches", "4x16", "8x24", "--compile-cache-dir",
                  str(cache), "--results", str(results))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "coldstart.json").read_text())
    assert res["compile_cache_dir"] == str(cache.resolve()) and not res["failed"]
    assert (cache / "triton").is_dir()  # the engine used the folder it was given
    first, second = res["first"], res["second"]
    assert [(b["n"], b["input_len"]) for b in first["batches"]] == [(4, 16), (8, 24)]
    for b in first["batches"]:
        assert [r["completed"] for r in b["rounds"]] == [b["n"], b["n"]]
        assert all(r["ttft_ms_p50"] > 0 for r in b["rounds"])
    assert second["batches"] == []
    for start in (first, second):
        assert start["start_s"] > 0 and start["kernels_in_start"] >= 0
        assert set(start["phases"]) == {"weights", "plan buffers", "warm-up compile",
                                        "graph capture"}
        assert any(line.startswith("startup: ready in") for line in start["log"])
    md = (tmp_path / "out" / "coldstart.md").read_text()
    assert md.startswith("## Cold start") and "| 8 x 24 |" in md
    assert "Second start ÷ first start: " in md
    assert results.read_text().count("## Cold start") == 1


@pytest.mark.timeout(60)
def test_a_cache_folder_with_kernels_is_refused(tmp_path):
    (tmp_path / "cache" / "triton").mkdir(parents=True)
    proc = _bench(tmp_path / "out", "--compile-cache-dir", str(tmp_path / "cache"))
    assert proc.returncode != 0 and "is not empty" in proc.stderr
    assert not (tmp_path / "out" / "coldstart.json").exists()


@pytest.mark.timeout(120)
def test_a_failed_start_is_reported_and_kept_out_of_results(tmp_path):
    results = tmp_path / "RESULTS.md"
    # a context too short for the prompts: the first start's batches fail
    proc = _bench(tmp_path / "out", "--batches", "4x16", "2x200", "--results", str(results))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "coldstart.json").read_text())
    assert len(res["failed"]) == 1 and "batch 2x200: 0 of 2 requests" in res["failed"][0]
    # what the first part measured before its failure is kept, and the second start still ran
    assert [b["n"] for b in res["first"]["batches"]] == [4] and res["first"]["start_s"] > 0
    assert res["second"]["start_s"] > 0
    md = (tmp_path / "out" / "coldstart.md").read_text()
    assert "**Failed: the first start's part: batch 2x200" in md and "| 4 x 16 |" in md
    assert not results.exists()
