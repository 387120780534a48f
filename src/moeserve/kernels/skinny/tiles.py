"""The skinny kernels' tiles and where they beat cuBLAS (pure Python: no triton import, so
that the linear layers can ask on any install; the kernels are kernels/skinny/gemm.py)."""

from __future__ import annotations

from typing import NamedTuple, Optional

# (largest N, largest K, most FMA rows, FMA (BLOCK_N, BLOCK_K, num_warps), most MMA rows, MMA
# (BLOCK_N, BLOCK_K, num_warps, num_stages)); the first entry whose N and K hold (N, K) wins.
# Up to its FMA rows the FMA kernel runs, then the MMA kernel up to its MMA rows; above them
# cuBLAS is as fast or faster, and `linear` keeps it. Why each entry (the times are in
# benchmarks/RESULTS.md, "Decode-step kernels"; benchmarks/step_kernels.py --try-tiles sweeps
# the alternatives):
# - a wide BLOCK_K keeps many bytes in flight per program (the FMA loop is not pipelined) and
#   few iterations on the latency path; a narrow BLOCK_N spreads a small N over the SMs;
# - N <= 512 (routers): the FMA kernel (BLOCK_N 1) in row groups up to 16 rows, since a small
#   N gives the MMA kernel, whose BLOCK_N is at least 16, too few programs; from 17 to 128
#   rows the MMA kernel, where the row groups re-read the weight from L2 (H100, 24 cold
#   [128, 2048] bf16 weights in a graph: 64 rows 3.9 us a product against cuBLAS's 5.0 and
#   the row groups' 5.1-7.3);
# - the other entries hold a dense MLP's gate_up (N, K <= 2048), DeepSeek's fused q / kv_a
#   (N <= 4096), o_proj and a shared expert's down (N <= 2048, K past 2048), and the widest
#   (qkv, a shared expert's gate_up), each with the sweep's best tiles; the FMA kernel gives
#   way to the MMA kernel past 2 rows (1 on the widest N), where its products outgrow it.
TILES: tuple[tuple[int, int, int, tuple[int, int, int], int,
                   Optional[tuple[int, int, int, int]]], ...] = (
    (512, 1 << 62, 16, (1, 2048, 4), 128, (16, 512, 2, 4)),
    (2048, 2048, 2, (2, 1024, 4), 16, (16, 512, 2, 4)),
    (4096, 2048, 2, (4, 1024, 2), 16, (32, 256, 2, 4)),
    (2048, 1 << 62, 2, (4, 2048, 4), 16, (16, 512, 2, 4)),
    (1 << 62, 1 << 62, 1, (2, 512, 2), 16, (64, 256, 4, 3)),
)
MOST_ROWS = max(max(e[2], e[4]) for e in TILES)  # past these rows every shape takes cuBLAS
# row counts that between them run every kernel variant of the table (the FMA kernel's rows
# per program and each entry's MMA tiles): an eager warm-up compiles them all
WARM_ROWS = tuple(sorted({*range(1, max(e[2] for e in TILES) + 1),
                          *(e[2] + 1 for e in TILES if e[4] > e[2])}))
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
    MMA rows, the FMA kernel in row groups past them. BLOCK_K is cut to K, and for the FMA
    kernel to the register budget."""
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
