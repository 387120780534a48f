"""The fp8 block GEMM's tiles, the bound of its split-K partials and the workspace that
holds them: no Triton here, so that the plan (plan/buffers.py) sizes that workspace and the
binder hands it out on any install."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


MIN_GPU_BLOCK_K = 32  # the least K of an fp8 tl.dot on the GPU (a scale group's width)
DECODE_GEMM_ROWS = 256  # up to this many rows the GEMM takes decode tiles (at most 64 rows)
SWAP_MAX_ROWS = 8  # up to this many rows the weight is the MMA's M side (swapped tiles)
MAX_SPLIT = 8  # the most parts a decode tile's K is split into
MIN_PART_STEPS = 2  # scale groups each part takes at the least


class GemmTiles(NamedTuple):
    block_m: int  # rows of x a tile takes
    block_n: int  # output columns (weight rows) a tile takes
    stages: int  # loads in flight along K
    split: int  # parts K is split into
    swap: bool  # the weight's rows the MMA's M side, x's rows its N


def gemm_tiles(m: int, n: int = 0, k: int = 0, programs: int = 0,
               block_k: int = 128) -> GemmTiles:
    """The tiles of m rows of an n-column output along k (scale groups of block_k), on a
    device of `programs` SMs.

    Up to DECODE_GEMM_ROWS rows (decode steps) the row tile is the power of two (16 to 64)
    that holds m, the column tile 32 wide (64 past 64 rows), and K is split into the fewest
    parts (a power of two up to MAX_SPLIT, each MIN_PART_STEPS groups or more) that give
    3/2 a program an SM for tiles of up to 32 rows, 7/8 for 64-row ones (whose partials
    cost twice the bytes). A weight this small streams at the memory's rate only from every
    SM at once, and a column tile narrowed instead would have each program read all of the
    rows' K (from L2) for a sliver of the weight. Up to SWAP_MAX_ROWS rows the tile is
    swapped: 64 weight rows (the least M of Hopper's fp8 wgmma) are the MMA's M side and
    the rows its N side, where a 16-row tile of rows runs as mma.sync on operands converted
    to fp16 in registers (H200, cold weights, one run: 5120 x 2048 at 1 row 5.9 against
    6.5 us, at 4 rows 6.0 against 6.6, at 16 rows 7.0 against 6.9; 2048 x 4096 at 1 row 5.5
    against 5.8). Past DECODE_GEMM_ROWS rows 128 x 128 tiles (down to 16 columns to fill the
    device), unsplit. More stages in flight along a long K."""
    if m > DECODE_GEMM_ROWS:
        for block_n in (128, 64, 32, 16):
            if _cdiv(m, 128) * _cdiv(n, block_n) >= programs:
                break
        return GemmTiles(128, block_n, 3, 1, False)
    block_m, block_n, want = _decode_tile(m, programs)
    tiles = _cdiv(m, block_m) * _cdiv(n, block_n)
    steps = _cdiv(k, block_k)
    split = 1
    while (tiles * split < want and split < MAX_SPLIT
           and steps >= 2 * split * MIN_PART_STEPS):
        split *= 2
    if m <= SWAP_MAX_ROWS:
        return GemmTiles(block_m, block_n, 3, split, True)
    return GemmTiles(block_m, block_n, 5 if k >= 4096 else 4, split, False)


def tile_warps(block_m: int, block_n: int) -> int:
    """Warps of a block GEMM tile: 8 from 128 x 128, whose float32 accumulator and the K step's
    product then take 128 registers a thread (4 warps spill them)."""
    return 8 if block_m * block_n >= 128 * 128 else 4


def _decode_tile(m: int, programs: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, the programs K is split to reach) of m <= DECODE_GEMM_ROWS rows."""
    block_m = min(64, max(16, _pow2(m)))
    block_n = 64 if m <= SWAP_MAX_ROWS or m > 64 else 32
    return block_m, block_n, programs * 3 // 2 if block_m <= 32 else programs * 7 // 8


def split_partials_bound(programs: int) -> int:
    """The most float32 partials a split launch of gemm_tiles' decode tiles stores on a device
    of `programs` SMs. K is split only while tiles x parts fall short of the programs the
    tile wants, so tiles x parts < 2 x want, and the partials (parts x M x N) < 2 x want x
    BLOCK_M x BLOCK_N: the largest of that over the decode tiles."""
    return max(2 * want * bm * bn for bm, bn, want in
               {_decode_tile(m, programs) for m in range(1, DECODE_GEMM_ROWS + 1)})


MAX_SPLIT_TILES = 4096  # tiles a split launch may have (its counters)


@dataclass(frozen=True)
class SplitWorkspace:
    """fp8.gemm.* (plan/buffers.py): the split launches' float32 partials, flat (a launch
    takes a [SPLIT, M, N] view of its front), and the tiles' int32 counters, zeros (a
    launch's tiles count their parts up, and each tile's last part sets its counter back to
    0). Every split launch of the device shares them: the engine's launches run one after
    another on one stream (under PDL each one's first store waits for the kernel before)."""
    partials: torch.Tensor
    counters: torch.Tensor
