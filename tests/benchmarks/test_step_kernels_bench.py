"""`python -m benchmarks attention --parts kernels [--fp8]` on the CPU: the projection table's
cells."""

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
    found = [_r("qkv 2048->5120", 1, "block GEMM, swapped", 7.7, 8.1),
             _r("qkv 2048->5120", 2, "block GEMM, swapped", 8.0, 8.2),
             _r("qkv 2048->5120", 16, "block GEMM", 9.5, 8.3),
             _r("o_proj 4096->2048", 1, "block GEMM, swapped", 7.3, 9.4)]
    rows = step_kernels.pivot(found, "bf16_us")
    assert rows[0] == ["qkv 2048->5120", "2.5", "7.70 / 8.10 (block GEMM, swapped)",
                       "8.00 / 8.20", "9.50 / 8.30 (block GEMM)"]
    assert rows[1] == ["o_proj 4096->2048", "2.5", "7.30 / 9.40 (block GEMM, swapped)"]
