"""`python -m benchmarks attention --parts kernels [--fp8]` on the CPU: the projection table's
cells and the FP8 GEMV tiles its sweep tries."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import step_kernels  # noqa: E402


def _r(name, rows, kind, us, base):
    return {"name": name, "rows": rows, "kind": kind, "floor_us": 2.46, "us": us,
            "bf16_us": base}


def test_pivot_gives_a_row_per_projection_naming_kernels_where_they_change():
    found = [_r("qkv 2048->5120", 1, "GEMV", 7.7, 8.1), _r("qkv 2048->5120", 2, "GEMV", 8.0, 8.2),
             _r("qkv 2048->5120", 4, "block GEMM", 9.5, 8.3),
             _r("o_proj 4096->2048", 1, "GEMV", 7.3, 9.4)]
    rows = step_kernels.pivot(found, "bf16_us")
    assert rows[0] == ["qkv 2048->5120", "2.5", "7.70 / 8.10 (GEMV)", "8.00 / 8.20",
                       "9.50 / 8.30 (block GEMM)"]
    assert rows[1] == ["o_proj 4096->2048", "2.5", "7.30 / 9.40 (GEMV)"]


def test_the_fp8_gemv_sweep_tries_valid_tiles_of_2_to_32_kb():
    for block_n, step, warps in step_kernels.TRY_FP8_GEMV:
        assert block_n & (block_n - 1) == 0 and step % step_kernels.FP8_BLOCK[1] == 0
        assert (step // 128) & (step // 128 - 1) == 0 and warps in (2, 4, 8)
        assert 2 << 10 <= block_n * step <= 32 << 10
    assert (16, 512, 4) in step_kernels.TRY_FP8_GEMV  # gemv_tiles' pick for K = 2048
    assert (4, 2048, 4) in step_kernels.TRY_FP8_GEMV  # K = 2048 in one step
