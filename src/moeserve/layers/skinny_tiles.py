"""The skinny kernel's tiles and where it beats cuBLAS (pure Python: no triton import, so
that the linear layers can ask on any install; the kernel is layers/skinny_gemm.py)."""

from __future__ import annotations

from typing import Optional

# (largest N, largest K, most rows, (BLOCK_N, BLOCK_K, num_warps)); the first entry whose N
# and K hold (N, K) wins. Above its rows cuBLAS is as fast or faster, and `linear` keeps it.
# Measured on an H200, 2026-11-22, CUDA-graph replays over cold weights (bench_decode_kernels.py
# --try-tiles; skinny vs cuBLAS us at 1 / 2 / 4 rows): router 2048->128 2.3 / 2.5 / 2.9 vs
# 5.4; dense 2048->1536 3.7 / 4.2 / 5.5 vs 8.0 / 7.3 / 8.0; o_proj 4096->2048 6.2 / 7.1 / 9.2
# vs 9.3 / 9.5 / 9.5; qkv 2048->5120 7.1 / 8.9 / 13.2 vs 8.0 / 8.1 / 8.1. A wide BLOCK_K keeps
# many bytes in flight per program (the loop is not pipelined) and few iterations on the
# latency path; a narrow BLOCK_N spreads a small N (a router) over SMs. DeepSeek-V2-Lite's
# q_proj and kv_a_proj_with_mqa in one GEMM, 2048->3648 (bench_decode_kernels.py --model
# deepseek-v2-lite --try-tiles, same method, 2026-11-23): (4, 1024, 2) best over 1 and 2 rows
# (9.77 us together), against 5.48 / 5.79 us for the last entry's tiles and cuBLAS's 6.86 /
# 6.82 (q_proj alone, 2048->3072, had (4, 1024, 4): 4.15 / 5.75 us).
TILES: tuple[tuple[int, int, int, tuple[int, int, int]], ...] = (
    (512, 1 << 62, 4, (1, 2048, 4)),
    (2048, 2048, 4, (2, 1024, 4)),
    (4096, 2048, 2, (4, 1024, 2)),
    (2048, 1 << 62, 2, (4, 2048, 4)),
    (1 << 62, 1 << 62, 1, (2, 512, 2)),
)
TILE_BUDGET = 64  # fp32 products per thread held across the K loop
MAX_ROWS = 4  # rows per program; more rows take more row groups, each streaming W again


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _entry(n: int, k: int) -> tuple[int, int, int, tuple[int, int, int]]:
    return next(e for e in TILES if n <= e[0] and k <= e[1])


def beats_cublas(m: int, n: int, k: int) -> bool:
    """Whether the table's measurements favour this kernel for an [m, k] x [n, k]^T product."""
    return 0 < m <= _entry(n, k)[2]


def tiles_for(m: int, n: int, k: int, tiles: Optional[tuple[int, int, int]] = None
              ) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK_N, BLOCK_K, num_warps) for an [m, k] x [n, k]^T product: `tiles` or the
    table's, with BLOCK_K cut to the register budget and to K."""
    if tiles is None:
        tiles = _entry(n, k)[3]
    block_n, block_k, warps = tiles
    rows = min(m, MAX_ROWS)
    budget = TILE_BUDGET * 32 * warps // (rows * block_n)
    block_k = max(16, min(block_k, _pow2(budget + 1) // 2, _pow2(k)))
    return rows, block_n, block_k, warps
