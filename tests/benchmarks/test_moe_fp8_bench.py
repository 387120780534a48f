"""`python -m benchmarks moe --fp8` on the CPU: its table's cells, with the same-rows dense FP8
GEMMs where the layer's floor is its FLOPs and without them elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import moe_fp8  # noqa: E402


def _row(**extra):
    return {"model": "qwen3-30b-a3b", "tokens": 8192, "touched": 128.0, "MB": 604.1,
            "floor_us": 426.8, "fp8_us": 1280.0, "GBps": 472.0, "pct_copy": 16.0,
            "TFLOPs": 483.2, "pct_fp8_gemm": 33.0, "triton_us": 1150.0,
            "grouped_mm_us": 4100.0, "err_vs_bf16": 0.064, **extra}


def test_cells_give_the_dense_gemms_and_their_share_where_measured():
    cells = moe_fp8.cells(_row(dense_us=512.0))
    assert len(cells) == len(moe_fp8.HEADER)
    assert cells[-2:] == ["512.0", "40%"]
    assert cells[moe_fp8.HEADER.index("x floor")] == "3.00"


def test_cells_leave_the_dense_columns_empty_where_the_floor_is_the_bytes():
    cells = moe_fp8.cells(_row(tokens=16))
    assert len(cells) == len(moe_fp8.HEADER) and cells[-2:] == ["-", "-"]
