"""The one-sided all-to-all's slot tables, stores and sums (kernels/moe/exchange.py): the torch
formulation against the layout's rules, and the Triton kernels against it under Triton's
interpreter, with the peers' windows emulated by CPU tensors of one process (their addresses
stand in for the symmetric memory's peer pointers)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from interpreter import run_interpreted
from moeserve.kernels.moe import exchange_torch as T


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(0, 20), st.integers(1, 4), st.integers(1, 3),
       st.integers(0, 2**31 - 1))
def test_each_row_gets_one_slot_per_rank_that_owns_one_of_its_experts(p, m, k, per_rank, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, p * per_rank, (m, k), generator=g, dtype=torch.int32)
    r = m + int(torch.randint(0, 3, (1,), generator=g))
    slots = torch.empty(m, p, dtype=torch.int32)
    sources = torch.empty(p, r, dtype=torch.int32)
    T.route_slots(ids, slots, sources, per_rank)
    for q in range(p):
        goes = [i for i in range(m) if any(0 <= e < p * per_rank and e // per_rank == q
                                            for e in ids[i].tolist())]
        # row order, slots 0.. on each destination, then empty slots
        assert sources[q].tolist() == goes + [-1] * (r - len(goes))
        for s, i in enumerate(goes):
            assert slots[i, q] == s
        assert all(slots[i, q] == -1 for i in range(m) if i not in goes)

    x = torch.randn(m, 5, generator=g)
    w = torch.rand(m, k, generator=g)
    rows, rids, rw, none = T.rows_for(x, ids, w, sources, per_rank)
    assert none is None  # no scales without fp8 rows
    for q in range(p):
        for s in range(r):
            i = int(sources[q, s])
            if i < 0:  # an empty slot: ids -1, nothing computed from it
                assert (rids[q, s] == -1).all()
                continue
            assert torch.equal(rows[q, s], x[i]) and torch.equal(rw[q, s], w[i])
            want = [e if e >= 0 and e // per_rank == q else -1 for e in ids[i].tolist()]
            assert rids[q, s].tolist() == want  # only the destination's own experts


def test_sum_back_adds_in_rank_order_in_fp32():
    g = torch.Generator().manual_seed(1)
    p, r, m, h, rank = 3, 4, 5, 8, 1
    back = torch.randn(p * r, h, generator=g).to(torch.bfloat16)
    y = torch.randn(p * r, h, generator=g).to(torch.bfloat16)
    slots = torch.tensor([[0, -1, 2], [1, 0, -1], [-1, -1, -1], [2, 1, 0], [3, 3, 3]],
                         dtype=torch.int32)
    out = torch.empty(m, h, dtype=torch.float32)
    T.sum_back(back, y, slots, out, rank)
    for i in range(m):
        want = torch.zeros(h)
        for q in range(p):
            if slots[i, q] >= 0:  # this rank's own results come from its expert outputs
                want = want + (y if q == rank else back)[q * r + slots[i, q]].float()
        assert torch.equal(out[i], want)


KERNELS = r"""
import torch
from moeserve.kernels.moe import exchange as E, exchange_torch as T

torch.manual_seed(0)
P, M, K, H, PER = 3, 11, 4, 40, 4
ids = torch.randint(-1, P * PER, (M, K), dtype=torch.int32)
ids[0] = -1  # routes nowhere
ids[1] = 5  # duplicate ids: one slot on rank 1
R = M + 2  # the step's slots per pair exceed this rank's rows
slots_a, sources_a = torch.empty(M, P, dtype=torch.int32), torch.empty(P, R, dtype=torch.int32)
slots_b, sources_b = slots_a.clone(), sources_a.clone()
E.route_slots(ids, slots_a, sources_a, PER)
T.route_slots(ids, slots_b, sources_b, PER)
assert torch.equal(slots_a, slots_b) and torch.equal(sources_a, sources_b)
# in blocks of 4 rows (slots): each block's slots follow the blocks before it; the empty
# slots past the rows' blocks marked too
for block in (4, 8):
    slots_c, sources_c = torch.full_like(slots_a, 9), torch.full_like(sources_a, 9)
    counts = torch.full((P * 4,), -7, dtype=torch.int32)  # the plan's record: room to spare
    E.route_slots(ids, slots_c, sources_c, PER, counts, block=block)
    assert torch.equal(slots_c, slots_b) and torch.equal(sources_c, sources_b), block
    nb = -(-M // block)  # each block's rows for each rank, [P, nb] at the front
    goes = torch.stack([((ids >= 0) & (ids // PER == q)).any(1) for q in range(P)])
    want = torch.stack([goes[:, b * block:(b + 1) * block].sum(1) for b in range(nb)], 1)
    assert torch.equal(counts[:P * nb].view(P, nb), want.to(torch.int32)), block
# one block of 6 rows and two blocks of slots: the second marks its slots empty
few = ids[:6].contiguous()
for impl in (E, T):
    got = torch.full((6, P), 9, dtype=torch.int32), torch.full((P, R), 9, dtype=torch.int32)
    impl.route_slots(few, *got, PER, **({"block": 8} if impl is E else {}))
    if impl is E:
        slots_d, sources_d = got
assert torch.equal(slots_d, got[0]) and torch.equal(sources_d, got[1])

# dispatch from rank 1 into three windows, stale bytes in them first
x, w, rank, n = torch.randn(M, H, dtype=torch.bfloat16), torch.rand(M, K), 1, P * R
windows = [torch.full((n * (H * 2 + 8 * K),), 7, dtype=torch.uint8) for _ in range(P)]
E.push_rows(x, ids, w, sources_a, torch.tensor([t.data_ptr() for t in windows]), rank, PER)
rows, rids, rw, _ = T.rows_for(x, ids, w, sources_b, PER)
for q, flat in enumerate(windows):
    xq = flat[: n * H * 2].view(torch.bfloat16).view(P, R, H)[rank]
    iq = flat[n * H * 2: n * (H * 2 + 4 * K)].view(torch.int32).view(P, R, K)[rank]
    wq = flat[n * (H * 2 + 4 * K):].view(torch.float32).view(P, R, K)[rank]
    filled = sources_b[q] >= 0
    assert torch.equal(iq, rids[q])  # empty slots too: their ids are -1
    assert torch.equal(xq[filled], rows[q][filled]) and torch.equal(wq[filled], rw[q][filled])
    other = flat[: n * H * 2].view(torch.bfloat16).view(P, R, H)[(rank + 1) % P]
    assert (other.view(torch.uint8) == 7).all()  # another source's rows are not touched

# the one-launch path of a decode step writes the same bytes and the same slots
windows_small = [torch.full_like(t, 7) for t in windows]
slots_small = torch.full_like(slots_a, 9)
E.dispatch_small(x, ids, w, slots_small, torch.tensor([t.data_ptr() for t in windows_small]),
                 rank, R, PER)
assert torch.equal(slots_small, slots_a)
assert all(torch.equal(a, b) for a, b in zip(windows, windows_small))

# fp8 rows: their bytes, then their float32 scales, then the ids and weights (both paths)
G = 3
xq = (torch.randn(M, H) * 8).to(torch.float8_e4m3fn)
xs = torch.rand(M, G) + 0.5
n8 = n * (H + 4 * G + 8 * K)
scales_at, ids_at, weights_at = T.window_offsets(P, R, H, K, 1, G)
qrows, qids, qw, qscales = T.rows_for(xq, ids, w, sources_b, PER, xs)
assert qrows.dtype == torch.uint8 and qscales.shape == (P, R, G)
for launch in ("push_rows", "dispatch_small"):
    win8 = [torch.full((n8,), 7, dtype=torch.uint8) for _ in range(P)]
    ptrs = torch.tensor([t.data_ptr() for t in win8])
    if launch == "push_rows":
        E.push_rows(xq, ids, w, sources_a, ptrs, rank, PER, xs)
    else:
        E.dispatch_small(xq, ids, w, torch.empty_like(slots_a), ptrs, rank, R, PER, xs)
    for q, flat in enumerate(win8):
        filled = sources_b[q] >= 0
        got_x = flat[:scales_at].view(P, R, H)[rank]
        got_s = flat[scales_at:ids_at].view(torch.float32).view(P, R, G)[rank]
        got_i = flat[ids_at:weights_at].view(torch.int32).view(P, R, K)[rank]
        got_w = flat[weights_at:].view(torch.float32).view(P, R, K)[rank]
        assert torch.equal(got_i, qids[q])
        assert torch.equal(got_x[filled], qrows[q][filled])
        assert torch.equal(got_s[filled], qscales[q][filled])
        assert torch.equal(got_w[filled], qw[q][filled])
        assert torch.equal(got_x[filled].view(torch.float8_e4m3fn).float(),
                           xq[sources_b[q][filled].long()].float())

# combine from rank 1: filled slots go back to their sources, nothing else is written
y = torch.randn(n, H, dtype=torch.bfloat16)
backs = [torch.zeros(n, H, dtype=torch.bfloat16) for _ in range(P)]
E.push_back(y, rids.reshape(n, K).contiguous(), torch.tensor([b.data_ptr() for b in backs]),
            rank, P)
for q in range(P):
    got, fill = backs[q][rank * R: rank * R + R], (rids[q] >= 0).any(dim=1)
    if q == rank:  # its own results stay in y
        fill = torch.zeros_like(fill)
    assert torch.equal(got[fill], y[q * R: q * R + R][fill]) and (got[~fill] == 0).all()
    assert (backs[q][: rank * R] == 0).all() and (backs[q][rank * R + R:] == 0).all()

# the push of the slots' top-k sums from their pair rows (float32: the interpreter rounds bf16
# its own way): this rank's ids in its window (others -1, some slots empty), each filled
# slot's sum in k order to its source, this rank's own into `own`; nothing else is written
first = rank * PER
win_ids = torch.randint(-1, P * PER, (n, K), dtype=torch.int32)
win_ids = torch.where((win_ids >= first) & (win_ids < first + PER), win_ids, -1)
win_ids[::3] = -1  # empty slots
pairs = torch.randn(n * K, H)
backs2, own = [torch.zeros(n, H) for _ in range(P)], torch.zeros(n, H)
E.push_back_sums(pairs, win_ids, first, PER, own, torch.tensor([b.data_ptr() for b in backs2]),
                 rank, P)
sums = torch.zeros(n, H)
for j in range(K):  # topk_sum's order
    sums = sums + torch.where((win_ids[:, j:j + 1] >= 0), pairs.view(n, K, H)[:, j], 0.0)
fill = (win_ids >= 0).any(dim=1)
for q in range(P):
    block = slice(q * R, q * R + R)
    to = own[block] if q == rank else backs2[q][rank * R: rank * R + R]
    assert torch.equal(to[fill[block]], sums[block][fill[block]]), q
    assert (to[~fill[block]] == 0).all()
    rest = torch.cat([backs2[q][: rank * R], backs2[q][rank * R + R:]])
    assert (rest == 0).all() and (q != rank or (backs2[q] == 0).all())
assert (own[: rank * R] == 0).all() and (own[rank * R + R:] == 0).all()

# the interpreter rounds bf16 stores its own way: compare the fp32 sums
back = torch.randn(n, H, dtype=torch.bfloat16)
out_a, out_b = torch.empty(M, H), torch.empty(M, H)
E.sum_back(back, y, slots_a, out_a, rank)
T.sum_back(back, y, slots_b, out_b, rank)
assert torch.equal(out_a, out_b)
print("interpreter ok")
"""


def test_triton_kernels_store_what_the_torch_layout_says():
    run_interpreted(KERNELS)


@pytest.mark.gpu
@pytest.mark.parametrize("p", [2, 4])
def test_route_slots_of_prefill_sized_steps_on_the_gpu(p):
    """Past one block of rows the counts come from their own launch: the slots of 3000 and
    8192 rows (Qwen3-30B-A3B's routing: 128 experts, top 8) and of a step whose slots
    outnumber its rows equal the torch layout's."""
    from moeserve.kernels.moe import exchange as E

    g = torch.Generator(device="cuda").manual_seed(p)
    for m, r in ((3000, 3000), (8192, 8192), (1500, 5000)):
        ids = torch.rand(m, 128, generator=g, device="cuda").topk(8, dim=1).indices
        ids = ids.to(torch.int32)
        got = (torch.full((m, p), 9, dtype=torch.int32, device="cuda"),
               torch.full((p, r), 9, dtype=torch.int32, device="cuda"))
        want = (torch.empty_like(got[0]), torch.empty_like(got[1]))
        E.route_slots(ids, *got, 128 // p)
        T.route_slots(ids, *want, 128 // p)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (m, r)
