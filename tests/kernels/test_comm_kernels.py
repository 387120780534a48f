"""The one-shot collectives' kernels (kernels/comm/one_shot.py) under Triton's interpreter, with
the peers' windows emulated by CPU tensors of one process (their addresses stand in for the
symmetric memory's peer pointers): the interpreter cannot wait for a peer, so every rank runs
its first phase, then every rank its second (on a GPU one launch does both, with barriers
between). The all-gather against the concatenation the NCCL path returns, the reduce-scatter
and the all-reduce against the fp32 sum in rank order, bit for bit."""

from __future__ import annotations

from interpreter import run_interpreted

KERNELS = r"""
import torch
from moeserve.kernels.comm import one_shot as O
from moeserve.parallel.collectives import block_offsets
from moeserve.parallel.symm_comm import _bytes

NO_PADS = torch.zeros(8, dtype=torch.int64)  # the barriers are off under the interpreter


def windows(p, nbytes):
    wins = [torch.full((nbytes + 64,), 7, dtype=torch.uint8) for _ in range(p)]
    return wins, torch.tensor([w.data_ptr() for w in wins])


def gather(blocks):
    # every rank pushes, then every rank copies its window out: what each rank gets
    p, row = len(blocks), blocks[0].element_size() * int(torch.tensor(blocks[0].shape[1:]).prod())
    sizes = [b.shape[0] for b in blocks]
    total = sum(sizes) * row
    wins, peers = windows(p, total)
    outs = [torch.full((total,), 5, dtype=torch.uint8) for _ in range(p)]
    for r, off in enumerate(block_offsets(sizes)):
        O.gather(_bytes(blocks[r]), outs[r], peers, NO_PADS, r, off * row, copy=False,
                 sync=False)
        if r == 0:  # a rank stores its own rows into every window, and nothing else
            untouched = torch.ones(total + 64, dtype=torch.bool)
            untouched[:sizes[0] * row] = False
            assert all((w[untouched] == 7).all() for w in wins)
    for r in range(p):
        O.gather(_bytes(blocks[r])[:0], outs[r], peers, NO_PADS, r, 0, push=False, sync=False)
    shape = (sum(sizes), *blocks[0].shape[1:])
    return [o.view(blocks[0].dtype).view(shape) for o in outs]


torch.manual_seed(0)
# uneven sizes with a zero-row rank; rows of 16-byte multiples (whole vectors), of odd byte
# counts (ranks whose offsets allow different vector widths), enough rows for several programs
for sizes, shape, dtype in [([5, 0, 7], (40,), torch.bfloat16),
                            ([3, 2], (5,), torch.uint8),
                            ([1, 1, 1, 1], (6,), torch.float16),
                            ([300, 0, 211, 97], (48,), torch.float32),
                            ([0, 9, 4], (3, 2), torch.int16)]:
    blocks = [(torch.randn(s, *shape) * 50).to(dtype) for s in sizes]
    want = torch.cat(blocks)  # what the NCCL path's all_gather_uneven returns
    for got in gather(blocks):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (sizes, dtype)


def reduce_scatter(ys, sizes, dtype):
    p, row = len(ys), int(torch.tensor(ys[0].shape[1:]).prod())
    wins, peers = windows(p, ys[0].numel() * ys[0].element_size())
    outs = [torch.full((s, *ys[0].shape[1:]), 9.0, dtype=dtype) for s in sizes]
    for r, off in enumerate(block_offsets(sizes)):
        O.reduce(ys[r].view(-1), outs[r].view(-1), peers, NO_PADS, r, off * row, add=False,
                 sync=False)
    for r, off in enumerate(block_offsets(sizes)):
        O.reduce(ys[r].view(-1), outs[r].view(-1), peers, NO_PADS, r, off * row, stage=False,
                 sync=False)
    return outs


def rank_order_sum(ys):
    acc = ys[0].float()
    for y in ys[1:]:
        acc = acc + y.float()
    return acc


# the interpreter's own bf16 rounding is not the GPU's: bf16 goes through the GPU tests
for sizes, width, dtype in [([4, 0, 6], 24, torch.float32), ([2, 3], 24, torch.float16),
                            ([700, 13, 0, 300], 24, torch.float32), ([0, 0, 5], 24, torch.float16),
                            ([3, 4, 2], 5, torch.float16)]:
    n = sum(sizes)
    ys = [torch.randn(n, width).to(dtype) for _ in sizes]
    want = rank_order_sum(ys).to(dtype)
    for r, (got, off) in enumerate(zip(reduce_scatter(ys, sizes, dtype), block_offsets(sizes))):
        assert got.shape == (sizes[r], width)
        assert torch.equal(got, want[off:off + sizes[r]]), (sizes, dtype, r)

# the all-reduce: every rank keeps every row, summed in place (out is y itself)
for p, n, dtype in [(2, 3, torch.float16), (3, 400, torch.float32)]:
    ys = [torch.randn(n, 16).to(dtype) for _ in range(p)]
    want = rank_order_sum(ys).to(dtype)
    wins, peers = windows(p, n * 16 * ys[0].element_size())
    for r in range(p):
        O.reduce(ys[r].view(-1), ys[r].view(-1), peers, NO_PADS, r, 0, add=False, sync=False)
    for r in range(p):
        O.reduce(ys[r].view(-1), ys[r].view(-1), peers, NO_PADS, r, 0, stage=False,
                 sync=False)
    assert all(torch.equal(y, want) for y in ys)
print("interpreter ok")
"""


def test_one_shot_kernels_gather_and_sum_what_the_collectives_do():
    run_interpreted(KERNELS)


def test_the_grid_counts_bytes_so_every_rank_has_the_same():
    from moeserve.kernels.comm import one_shot as O

    # ranks may move their rows in vectors of different widths: the grid is the same
    assert O.programs(1) == 1 and O.programs(O.CHUNK_BYTES) == 1
    assert O.programs(O.CHUNK_BYTES + 1) == 2
    assert O.programs(10**9) == O.MAX_PROGRAMS
    # 16 bytes a vector where every offset and address allows it
    assert O._vec(2, 0, 8, 64, 1024) == 8 and O._vec(2, 4, 8, 64) == 4
    assert O._vec(1, 3, 16) == 1 and O._vec(4, 2, 4) == 2
