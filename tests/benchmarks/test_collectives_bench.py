"""`python -m benchmarks collectives` on the CPU: its CLI, the rows split as a scattered
layer's, the crossover per op (the largest size up to which the one-shot path wins at every
size), and the section's tables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import collectives  # noqa: E402


@pytest.mark.timeout(60)
def test_help_lists_its_options():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "collectives", "--help"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert all(flag in proc.stdout for flag in ("--gpus", "--out", "--rows", "--hidden"))


def test_parsed_arguments_have_the_decode_and_prefill_sizes():
    import argparse

    p = argparse.ArgumentParser()
    collectives.add_arguments(p)
    args = p.parse_args(["--gpus", "2", "--out", "/tmp/x"])
    assert args.rows[0] == 1 and args.rows[-1] == 8192 and args.hidden == 2048
    assert (args.gpus, args.out, args.dtype, args.results) == (2, "/tmp/x", "bfloat16", None)


def test_rows_split_as_a_scattered_layer_splits_them():
    assert collectives.split(1, 2) == [1, 0]
    assert collectives.split(7, 4) == [2, 2, 2, 1]
    assert collectives.split(8192, 2) == [4096, 4096]


def _row(rows: int, symm: float, nccl: float) -> dict:
    out = {"rows": rows, "bytes": rows * 4096, "agrees": True, "all_reduce_torch_us": 7.0}
    for op in collectives.OPS:
        out.update({f"{op}_symm_us": symm, f"{op}_nccl_us": nccl, f"{op}_symm_graph": True,
                    f"{op}_nccl_graph": op != "reduce_scatter"})
    return out


def test_the_crossover_is_where_nccl_first_wins():
    rows = [_row(1, 5.0, 20.0), _row(64, 9.0, 21.0), _row(128, 30.0, 25.0), _row(256, 20.0, 40.0)]
    # faster up to 64 rows; 128 rows is NCCL's, whatever comes after
    assert collectives.crossover(rows, "all_gather") == (64 * 4096, 128 * 4096)
    assert collectives.crossover(rows[:2], "all_gather") == (64 * 4096, None)
    assert collectives.crossover([_row(1, 30.0, 20.0)], "all_gather") == (0, 4096)
    lines = collectives.crossover_lines(rows)
    assert lines[0] == "- all_reduce: one-shot faster up to 256 KiB (NCCL from 512 KiB)"
    assert lines[-1] == f"- every op: --symm-comm-max-bytes {64 * 4096}"


def test_the_section_has_a_table_per_op_and_the_crossovers():
    ranks = {r: {"rows": [_row(1, 5.0 + r, 20.0), _row(2048, 50.0, 30.0)]} for r in range(2)}
    ranks[0]["rows"][1]["all_reduce_torch_us"] = None  # fp16: torch's kernel does not sum it
    text = "\n".join(collectives.render(ranks, 2048, "bfloat16"))
    for op in collectives.OPS:
        assert f"### {op}, [rows, 2048] bfloat16" in text
    assert text.count("| rows |") == 4 and "| torch one_shot_all_reduce µs |" in text
    assert "| 1 | 4 KiB | 5.0 | 20.0 | 7.0 | 4.00 | 20% | yes |" in text
    assert "| 2048 | 8 MiB | 50.0 | 30.0 | - | 0.60 | 0% | yes |" in text
    assert "| 2048 | 8 MiB | 50.0 | 30.0 (eager) | 0.60 | 0% | yes |" in text
    assert "- every op: --symm-comm-max-bytes 4096" in text
