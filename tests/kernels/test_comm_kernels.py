"""The one-shot collectives' kernels (kernels/comm/one_shot.py) under Triton's interpreter, with
the peers' windows and signal pads emulated by CPU tensors of one process (their addresses
stand in for the symmetric memory's pointers): the interpreter cannot wait for a peer, so
every rank runs its first phase, then every rank its second (on a GPU one launch does both,
with the signals or barriers between). The all-gather against the concatenation the NCCL path
returns, the reduce-scatter and the all-reduce against the fp32 sum in rank order, bit for
bit; the pushing collectives store into the half of each window that their call's epoch
picks, alternating call by call, and touch nothing else."""

from __future__ import annotations

from interpreter import run_interpreted

KERNELS = r"""
import torch
from moeserve.kernels.comm import layout as L, one_shot as O
from moeserve.parallel.collectives import block_offsets
from moeserve.parallel.symm_comm import _bytes

NO_PADS = torch.zeros(8, dtype=torch.int64)  # the reduce-scatter's barriers are off here


class Ranks:
    # p ranks' windows (window_bytes(most, p) each, filled with 7) and signal pads

    def __init__(self, p, most):
        self.p, self.nbytes = p, L.window_bytes(most, p)
        self.wins = [torch.full((self.nbytes,), 7, dtype=torch.uint8) for _ in range(p)]
        self.peers = torch.tensor([w.data_ptr() for w in self.wins])
        self.pad = [torch.zeros(L.pad_slots(p), dtype=torch.int32) for _ in range(p)]
        self.pads = torch.tensor([t.data_ptr() for t in self.pad])

    def epoch(self, r):  # rank r's epoch, and its count of programs that finished the call
        return (int(self.pad[r][O.MAX_PROGRAMS * self.p + r]),
                int(self.pad[r][(O.MAX_PROGRAMS + 1) * self.p + r]))

    def touched_outside(self, r, lo, hi):  # whether any byte of window r outside [lo, hi) moved
        moved = self.wins[r] != 7
        return bool(moved[:lo].any() or moved[hi:].any())


def gather(ranks, blocks):
    # every rank pushes, then every rank copies its window out: what each rank gets
    p, row = len(blocks), blocks[0].element_size() * int(torch.tensor(blocks[0].shape[1:]).prod())
    sizes = [b.shape[0] for b in blocks]
    total = sum(sizes) * row
    outs = [torch.full((total,), 5, dtype=torch.uint8) for _ in range(p)]
    epoch, _ = ranks.epoch(0)
    half = ranks.nbytes // 4 if epoch % 2 == 0 else 0  # this call's (epoch + 1) half
    for w in ranks.wins:
        w.fill_(7)
    for r, off in enumerate(block_offsets(sizes)):
        O.gather(_bytes(blocks[r]), outs[r], ranks.peers, ranks.pads, r, off * row,
                 ranks.nbytes, copy=False, sync=False)
        if r == 0:  # a rank stores its own rows into every window's half, and nothing else
            for w in range(p):
                assert not ranks.touched_outside(w, half, half + sizes[0] * row), (w, half)
    for r in range(p):
        O.gather(_bytes(blocks[r])[:0], outs[r], ranks.peers, ranks.pads, r, 0, ranks.nbytes,
                 push=False, sync=False)
        assert ranks.epoch(r) == (epoch + 1, 0)  # the last program counted the call
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
    ranks = Ranks(len(sizes), want.numel() * want.element_size())
    for call in range(2):  # the second call uses the other half of every window
        for got in gather(ranks, blocks):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (sizes, dtype)


def reduce_scatter(ys, sizes, dtype):
    p, row = len(ys), int(torch.tensor(ys[0].shape[1:]).prod())
    ranks = Ranks(p, ys[0].numel() * ys[0].element_size())  # (alive while the kernels run)
    peers = ranks.peers
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

# the all-reduce: every rank keeps every row, summed in place (out is y itself); each rank's
# tensor lands in its slot of every window's half; a gather between two all-reduces moves
# the epoch on, so the third call is in the first's half again
for p, n, dtype in [(2, 3, torch.float16), (3, 400, torch.float32)]:
    ranks = Ranks(p, n * 16 * 4)
    e = torch.tensor([], dtype=dtype).element_size()
    for call in range(3):
        if call == 1:
            gather(ranks, [torch.randn(2, 4) for _ in range(p)])
            continue
        ys = [torch.randn(n, 16).to(dtype) for _ in range(p)]
        want = rank_order_sum(ys).to(dtype)
        for w in ranks.wins:
            w.fill_(7)
        for r in range(p):
            O.all_reduce(ys[r].view(-1), ys[r].view(-1), ranks.peers, ranks.pads, r,
                         ranks.nbytes, add=False, sync=False)
        half = ranks.nbytes // 4  # epochs 1 and 3: odd, the second half (the gather's 2: the first)
        for w in range(p):  # every rank's slot of every window, nothing else
            assert not ranks.touched_outside(w, half, half + p * n * 16 * e), (p, call, w)
        for r in range(p):
            O.all_reduce(ys[r].view(-1), ys[r].view(-1), ranks.peers, ranks.pads, r,
                         ranks.nbytes, push=False, sync=False)
        assert all(torch.equal(y, want) for y in ys), (p, call)
        assert all(ranks.epoch(r) == (call + 1, 0) for r in range(p))

# the all-reduce with the residual add and RMSNorm after it: each rank's rows in its slot of
# every window's half (as the all-reduce), then the sum rounded to the dtype, plus x (the
# sum stored bit for bit as add_rms_norm's), normalised; 40 rows: programs of two rows
for p, n, d, dtype in [(2, 3, 48, torch.float16), (3, 40, 20, torch.float32)]:
    ranks = Ranks(p, n * d * 4)
    e = torch.tensor([], dtype=dtype).element_size()
    w = torch.rand(d) + 0.5
    for call in range(2):
        ys = [torch.randn(n, d).to(dtype) for _ in range(p)]
        x = torch.randn(n, d).to(dtype)
        total = (x.float() + rank_order_sum(ys).to(dtype).float()).to(dtype)
        t32 = total.float()
        normed = (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        want = (w * normed.float()).to(dtype)
        for win in ranks.wins:
            win.fill_(7)
        for r in range(p):
            O.all_reduce_add_norm(ys[r], x, w.to(dtype), 1e-6, ranks.peers, ranks.pads, r,
                                  ranks.nbytes, add=False, sync=False)
        half = 0 if call % 2 else ranks.nbytes // 4
        for win in range(p):
            assert not ranks.touched_outside(win, half, half + p * n * d * e), (p, call, win)
        for r in range(p):
            out, s = O.all_reduce_add_norm(ys[r], x, w.to(dtype), 1e-6, ranks.peers,
                                           ranks.pads, r, ranks.nbytes, push=False, sync=False)
            assert torch.equal(s, total), (p, call, r)
            assert torch.allclose(out.float(), want.float(), rtol=1e-3, atol=1e-3), (p, call)
        assert all(ranks.epoch(r) == (call + 1, 0) for r in range(p))

# the all-reduce + RMSNorm of 16-bit rows through the Lamport region: each rank's rows in its
# slot of every region's half (a -0.0 of its own sent as +0.0), nothing else of the window
# touched, the one-shot kernel's bits, every element read back to the sentinel, the calls
# alternating halves by the Lamport epoch
from moeserve.kernels.comm import lamport as LP

for p, n, d in [(2, 3, 48), (3, 40, 20)]:
    ranks = Ranks(p, n * d * 2)
    for win in ranks.wins:
        LP.fill_region(win)
    region, e = L.region_bytes(ranks.nbytes), 2
    w = (torch.rand(d) + 0.5).to(torch.float16)
    for call in range(3):
        ys = [torch.randn(n, d).to(torch.float16) for _ in range(p)]
        ys[0][0, :3] = -0.0
        x = torch.randn(n, d).to(torch.float16)
        for r in range(p):
            O.all_reduce_add_norm(ys[r], x, w, 1e-6, ranks.peers, ranks.pads, r, ranks.nbytes,
                                  add=False, sync=False)
        want = [O.all_reduce_add_norm(ys[r], x, w, 1e-6, ranks.peers, ranks.pads, r,
                                      ranks.nbytes, push=False, sync=False) for r in range(p)]
        before = [win[:region].clone() for win in ranks.wins]
        for r in range(p):
            LP.all_reduce_add_norm(ys[r], x, w, 1e-6, ranks.peers, ranks.pads, r, ranks.nbytes,
                                   add=False)
        half = 0 if call % 2 else region // 2  # epochs 1 and 3: the second half
        for win, old in zip(ranks.wins, before):
            assert torch.equal(win[:region], old)  # the pushing region untouched
            lam = win[region:]
            lo, hi = half, half + p * n * d * e
            assert (lam[:lo].view(torch.int16) == -32768).all(), (p, call)
            assert (lam[hi:].view(torch.int16) == -32768).all(), (p, call)
            got = lam[lo:hi].view(torch.float16).view(p, n, d)
            assert all(torch.equal(got[r], ys[r]) for r in range(p)), (p, call)
            assert (got[0, 0, :3].view(torch.int16) == 0).all()  # +0.0 for the sentinel
        for r in range(p):
            out, s = LP.all_reduce_add_norm(ys[r], x, w, 1e-6, ranks.peers, ranks.pads, r,
                                            ranks.nbytes, push=False)
            assert torch.equal(out, want[r][0]) and torch.equal(s, want[r][1]), (p, call, r)
            assert int(ranks.pad[r][(O.MAX_PROGRAMS + 2) * p + r]) == call + 1
            assert int(ranks.pad[r][(O.MAX_PROGRAMS + 3) * p + r]) == 0
        for win in ranks.wins:
            assert (win[region:].view(torch.int16) == -32768).all(), (p, call)
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
    # a window: two regions (pushing, Lamport) of two halves of P slots of the largest
    # collective; the pads hold the barriers' slots, then the pushing collectives' flags and
    # epochs
    from moeserve.kernels.comm import layout as L

    assert L.window_bytes(4096, 2) == 32768 and L.window_bytes(4096, 4) == 65536
    assert L.max_collective_bytes(32768, 2) == 4096 and L.region_bytes(32768) == 16384
    assert L.pad_slots(4) == 2 * O.MAX_PROGRAMS * 4
