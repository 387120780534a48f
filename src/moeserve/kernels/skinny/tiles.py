"""The skinny kernels' tiles and where they beat cuBLAS (pure Python: no triton import, so
that the linear layers can ask on any install; the kernels are kernels/skinny/gemm.py)."""

from __future__ import annotations

from typing import NamedTuple, Optional

# (largest N, largest K, most FMA rows, FMA (BLOCK_N, BLOCK_K, num_warps), most MMA rows, MMA
# (BLOCK_N, BLOCK_K, num_warps, num_stages)); the first entry whose N and K hold (N, K) wins.
# Up to its FMA rows the FMA kernel runs, then the MMA kernel up to its MMA rows; above them
# cuBLAS is as fast or faster, and `linear` keeps it.
# FMA: measured on an H200, 2026-11-22, CUDA-graph replays over cold weights
# (bench_decode_kernels.py --try-tiles; skinny vs cuBLAS us at 1 / 2 / 4 rows): router
# 2048->128 2.3 / 2.5 / 2.9 vs 5.4; dense 2048->1536 3.7 / 4.2 / 5.5 vs 8.0 / 7.3 / 8.0;
# o_proj 4096->2048 6.2 / 7.1 / 9.2 vs 9.3 / 9.5 / 9.5; qkv 2048->5120 7.1 / 8.9 / 13.2 vs
# 8.0 / 8.1 / 8.1. A wide BLOCK_K keeps many bytes in flight per program (the loop is not
# pipelined) and few iterations on the latency path; a narrow BLOCK_N spreads a small N (a
# router) over SMs. DeepSeek-V2-Lite's q_proj and kv_a_proj_with_mqa in one GEMM, 2048->3648
# (bench_decode_kernels.py --model deepseek-v2-lite --try-tiles, same method, 2026-11-23):
# (4, 1024, 2) best over 1 and 2 rows (9.77 us together), against 5.48 / 5.79 us for the last
# entry's tiles and cuBLAS's 6.86 / 6.82 (q_proj alone, 2048->3072, had (4, 1024, 4): 4.15 /
# 5.75 us).
# MMA: the same method, H200, 2026-11-23 (a sweep of BLOCK_N 16-64, BLOCK_K 128-512, 2-4
# warps, 2-4 stages at 1-16 rows; MMA vs FMA vs cuBLAS us at 4 / 8 / 16 rows): qkv 7.8 / 7.9 /
# 8.1 vs 11.7 / - / - vs 8.2 / 8.2 / 8.3; o_proj 7.9 / 8.1 / 8.2 vs 10.1 vs 9.5 / 9.5 / 9.7;
# dense 5.0 / 5.1 / 5.2 vs 5.4 vs 8.0 / 6.0 / 6.0; DeepSeek's q_kv_a 6.4 / 6.4 / 6.5 vs 8.9 vs
# 6.9 / 7.0 / 7.2, o_proj 5.2 / 5.3 / 5.4 vs 6.0 vs 6.1 / 6.1 / 6.2, shared gate_up
# (2048->5632) 7.9 / 8.0 / 8.3 vs 12.4 vs 8.5 / 8.5 / 8.6, shared down (2816->2048) 6.5 / 6.6
# / 6.5 vs 8.0 vs 8.1 / 8.1 / 8.3. Routers keep the FMA kernel in row groups to 16 rows
# (2048->128: 2.1 / 2.5 us at 8 / 16 rows against MMA's 4.0 / 4.3 and cuBLAS's 5.8 / 5.6;
# 2048->64: 1.8 / 2.1 against 4.0 / 4.2 and 5.4 / 5.5): a small N gives the MMA kernel, whose
# BLOCK_N is at least 16, too few programs.
TILES: tuple[tuple[int, int, int, tuple[int, int, int], int,
                   Optional[tuple[int, int, int, int]]], ...] = (
    (512, 1 << 62, 16, (1, 2048, 4), 0, None),
    (2048, 2048, 2, (2, 1024, 4), 16, (16, 512, 2, 4)),
    (4096, 2048, 2, (4, 1024, 2), 16, (32, 256, 2, 4)),
    (2048, 1 << 62, 2, (4, 2048, 4), 16, (16, 512, 2, 4)),
    (1 << 62, 1 << 62, 1, (2, 512, 2), 16, (64, 256, 4, 3)),
)
MOST_ROWS = max(max(e[2], e[4]) for e in TILES)  # past these rows every shape takes cuBLAS
TILE_BUDGET = 64  # fp32 products per thread held across the K loop (FMA kernel)
MAX_ROWS = 4  # rows per program of the FMA kernel; more rows take more row groups
MMA_ROWS = 16  # rows per program of the MMA kernel (x's side of the MMA, padded)


class Tiles(NamedTuple):
    """One launch's kernel and tiles: rows per program, BLOCK_N, BLOCK_K, warps, and for the
    MMA kernel its pipeline stages."""
    mma: bool
    rows: int
    block_n: int
    block_k: int
    warps: int
    stages: int = 1


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _entry(n: int, k: int):
    return next(e for e in TILES if n <= e[0] and k <= e[1])


def beats_cublas(m: int, n: int, k: int) -> bool:
    """Whether the table's measurements favour a skinny kernel for an [m, k] x [n, k]^T
    product."""
    entry = _entry(n, k)
    return 0 < m <= max(entry[2], entry[4])


def tiles_for(m: int, n: int, k: int, tiles: Optional[tuple[int, ...]] = None) -> Tiles:
    """The kernel and tiles for an [m, k] x [n, k]^T product: `tiles` when given ((BLOCK_N,
    BLOCK_K, num_warps) for the FMA kernel, (BLOCK_N, BLOCK_K, num_warps, num_stages) for the
    MMA kernel), else the table's: the FMA kernel up to its FMA rows, the MMA kernel up to its
    MMA rows, the FMA kernel in row groups past them (DeepSeek's fp32 router logits). BLOCK_K
    is cut to K, and for the FMA kernel to the register budget."""
    if tiles is None:
        _, _, fma_rows, fma, mma_rows, mma = _entry(n, k)
        tiles = mma if fma_rows < m <= mma_rows else fma
    if len(tiles) == 4:
        block_n, block_k, warps, stages = tiles
        return Tiles(True, MMA_ROWS, block_n, max(16, min(block_k, _pow2(k))), warps, stages)
    block_n, block_k, warps = tiles
    rows = min(m, MAX_ROWS)
    budget = TILE_BUDGET * 32 * warps // (rows * block_n)
    block_k = max(16, min(block_k, _pow2(budget + 1) // 2, _pow2(k)))
    return Tiles(False, rows, block_n, block_k, warps)
