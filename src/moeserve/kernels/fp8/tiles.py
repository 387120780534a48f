"""The fp8 block GEMM's decode tiles, the bound of its split-K partials and the workspace that
holds them: no Triton here, so that the plan (plan/buffers.py) sizes that workspace and the
binder hands it out on any install."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


DECODE_GEMM_ROWS = 256  # up to this many rows the GEMM takes decode tiles (at most 64 rows)
MAX_SPLIT = 8  # the most parts a decode tile's K is split into
MIN_PART_STEPS = 2  # scale groups each part takes at the least


def gemm_tiles(m: int, n: int = 0, k: int = 0, programs: int = 0,
               block_k: int = 128) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_stages, SPLIT) for m rows of an n-column output along k (scale
    groups of block_k), on a device of `programs` SMs.

    Up to DECODE_GEMM_ROWS rows (decode steps) the row tile is the power of two (16 to 64)
    that holds m, the column tile 32 wide (64 past 64 rows), and K is split into the fewest
    parts (a power of two up to MAX_SPLIT, each MIN_PART_STEPS groups or more) that give
    3/2 a program an SM for tiles of up to 32 rows, 7/8 for 64-row ones (whose partials
    cost twice the bytes). A weight this small streams at the memory's rate only from every
    SM at once, and a column tile narrowed instead would have each program read all of the
    rows' K (from L2) for a sliver of the weight. Measured on H100 with 24 cold weights in a
    CUDA graph: 2048 x 4096 at 8 rows 10.1 -> 6.4 us (4 parts), at 64 rows 10.3 -> 8.9 (2),
    at 200 rows 20.2 -> 15.1; 6144 x 4096 at 8 rows 13.8 -> 12.3; 5120 x 2048 at 64 rows
    level (8.8, unsplit). Past DECODE_GEMM_ROWS rows
    128 x 128 tiles (down to 16 columns to fill the device), unsplit. More stages in flight
    along a long K."""
    if m > DECODE_GEMM_ROWS:
        for block_n in (128, 64, 32, 16):
            if _cdiv(m, 128) * _cdiv(n, block_n) >= programs:
                break
        return 128, block_n, 3, 1
    block_m, block_n, want = _decode_tile(m, programs)
    tiles = _cdiv(m, block_m) * _cdiv(n, block_n)
    steps = _cdiv(k, block_k)
    split = 1
    while (tiles * split < want and split < MAX_SPLIT
           and steps >= 2 * split * MIN_PART_STEPS):
        split *= 2
    return block_m, block_n, 5 if k >= 4096 else 4, split


def _decode_tile(m: int, programs: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, the programs K is split to reach) of m <= DECODE_GEMM_ROWS rows."""
    block_m = min(64, max(16, _pow2(m)))
    block_n = 32 if m <= 64 else 64
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
