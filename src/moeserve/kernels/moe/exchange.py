"""The one-sided all-to-all's kernels: each rank stores its tokens straight into its peers'
symmetric windows, and the peers store their results straight back (moe/dispatch/nvlink.py
runs them; exchange_torch.py is the same layout in torch, for CPUs and as the tests' reference).

Legend: M this rank's rows, K top-k, P ranks of the EP axis, R slots per (source, destination)
pair in this step (the same on every rank), H hidden, E_r experts per rank.

Window layout of one step (every rank derives it from P, R, H, K alone;
exchange_torch.window_offsets):
    recv window   x [P R, H] (dtype), then with fp8 rows their float32 scales [P R, G] (one per
                  group of columns; the rows are quantized once, before the stores), then ids
                  [P R, K] int32, then weights [P R, K] float32; rows [q R, q R + R) are source
                  rank q's slots
    combine window  y [P R, H] (dtype); rows [p R, p R + R) are what rank p computed for this
                  rank's slots on p
Ids a destination does not own arrive as -1, and so do the ids of slots nobody filled: the
expert runner skips them, and so reads the windows in place.

    route_slots   [blocks, P] programs: per destination p, a prefix sum over the rows that
                  have an expert on p gives each (row, p) its slot; slots_MP and sources_PR
                  record it (past one block of rows, a launch before counts the blocks)
    push_rows     [R P] programs: slot s of destination p stores its row (hidden states once,
                  however many of its experts p owns) and its masked ids and weights into p
    dispatch_small  both in one launch for at most SMALL_M rows: each program finds its
                  slot's row by its own prefix sum (decode steps)
    push_back     [R P] programs on the expert rank: a filled slot's result goes back to
                  [this rank, slot] of its source's combine window (another rank's slots only)
Grids run destinations fastest, so a rank's local stores and its stores over the link
interleave instead of following one another.
    sum_back      [M] programs: a row's results from every rank, summed in fp32 in rank order
                  (its own rank's straight from the expert outputs)
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moeserve.kernels.moe.configs import ROUTE_BLOCK
from moeserve.kernels.moe.exchange_torch import window_offsets

SMALL_M = 128  # up to this many rows, dispatch_small routes and stores in one launch
COPY_BLOCK = 1024  # hidden elements per iteration of a row copy


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


@triton.jit
def _goes_to(IDS, rows, live, stride_ids, p, experts_per_rank, K: tl.constexpr,
             KP: tl.constexpr):
    """1 for each of `rows` (where live) that has an expert on rank p, else 0."""
    ks = tl.arange(0, KP)
    ids = tl.load(IDS + rows[:, None] * stride_ids + ks[None, :],
                  mask=live[:, None] & (ks[None, :] < K), other=-1)
    return tl.max(((ids >= 0) & (ids // experts_per_rank == p)).to(tl.int32), axis=1)


@triton.jit
def _route_count_kernel(IDS, COUNTS, M, stride_ids, experts_per_rank, NB,
                        K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    # program (block b, destination p): how many of the block's rows go to p
    b = tl.program_id(0)
    p = tl.program_id(1)
    rows = b * BLOCK + tl.arange(0, BLOCK)
    goes = _goes_to(IDS, rows, rows < M, stride_ids, p, experts_per_rank, K, KP)
    tl.store(COUNTS + p * NB + b, tl.sum(goes, axis=0))


@triton.jit
def _route_slots_kernel(IDS, COUNTS, SLOTS, SOURCES, M, R, stride_ids, experts_per_rank, NB,
                        P: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                        NBP: tl.constexpr, BLOCK: tl.constexpr):
    # program (block b, destination p): its block's rows' slots on p, after the rows of the
    # blocks before it (the counts; with one block of rows, none), and slots [b BLOCK,
    # (b + 1) BLOCK) past the filled ones marked empty
    b = tl.program_id(0)
    p = tl.program_id(1)
    rows = b * BLOCK + tl.arange(0, BLOCK)
    live = rows < M
    goes = _goes_to(IDS, rows, live, stride_ids, p, experts_per_rank, K, KP)
    if NBP == 1:  # the rows' one block: its own count (a slot block past it, whose slots
        # are all past the rows, counts none and marks them all empty)
        used = tl.sum(goes, axis=0)
        before = used * 0
    else:
        nb = tl.arange(0, NBP)
        counts = tl.load(COUNTS + p * NB + nb, mask=nb < NB, other=0)
        used = tl.sum(counts, axis=0)
        before = tl.sum(tl.where(nb < b, counts, 0), axis=0)
    slot = before + tl.cumsum(goes, axis=0) - 1
    tl.store(SLOTS + rows * P + p, tl.where(goes > 0, slot, -1), mask=live)
    tl.store(SOURCES + p * R + slot, rows, mask=live & (goes > 0))
    s = b * BLOCK + tl.arange(0, BLOCK)  # the slots nobody fills carry no row
    tl.store(SOURCES + p * R + s, -1, mask=(s >= used) & (s < R))


def route_slots(ids_MK: torch.Tensor, slots_MP: torch.Tensor, sources_PR: torch.Tensor,
                experts_per_rank: int, counts: Optional[torch.Tensor] = None,
                block: int = ROUTE_BLOCK) -> None:
    """slots_MP[m, p]: row m's slot on rank p, -1 where none of its experts is on p;
    sources_PR[p, s]: the row in slot s of rank p, -1 for an empty slot. A program per
    `block` rows (or slots) and destination; past one block of rows, a launch before counts
    each block's rows per destination into `counts` (the plan's a2a.route_counts, at least
    P x blocks int32; a new tensor without it), so that no program reads more than its block
    (one program scanning every block took 27 us at 8192 rows on H100, bound by what one SM
    reads)."""
    m, k = ids_MK.shape
    p, r = sources_PR.shape
    assert slots_MP.shape == (m, p) and slots_MP.is_contiguous() and sources_PR.is_contiguous()
    assert ids_MK.stride(1) == 1 and ids_MK.dtype == torch.int32
    nb = triton.cdiv(m, block)
    args = (ids_MK.stride(0), experts_per_rank, nb)
    if nb <= 1:
        counts = slots_MP  # (a stand-in: one block of rows reads no counts)
    else:
        if counts is None:
            counts = torch.empty(p, nb, dtype=torch.int32, device=ids_MK.device)
        assert counts.dtype == torch.int32 and counts.is_contiguous() and counts.numel() >= p * nb
        _route_count_kernel[(nb, p)](ids_MK, counts, m, *args, K=k, KP=_pow2(k), BLOCK=block,
                                     num_warps=8)
    _route_slots_kernel[(triton.cdiv(max(m, r, 1), block), p)](
        ids_MK, counts, slots_MP, sources_PR, m, r, *args, P=p, K=k, KP=_pow2(k),
        NBP=1 if nb <= 1 else _pow2(nb), BLOCK=block, num_warps=8)


@triton.jit
def _store_slot(X, XS, IDS, WEIGHTS, PEERS, src, p, s, rank, R, H, stride_x, stride_xs,
                stride_ids, stride_w, scales_at, ids_at, weights_at, experts_per_rank,
                K: tl.constexpr, KP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                BLOCK: tl.constexpr):
    """Slot s of destination p: row src (-1: an empty slot) stored into p's recv window, and
    its G scales (fp8 rows; G = 0: none)."""
    window = tl.load(PEERS + p)  # peer p's recv window, a byte address
    slot = (rank * R + s).to(tl.int64)
    ks = tl.arange(0, KP)
    kmask = ks < K
    ids = tl.load(IDS + src * stride_ids + ks, mask=kmask & (src >= 0), other=-1)
    ids = tl.where((ids >= 0) & (ids // experts_per_rank == p), ids, -1)
    w = tl.load(WEIGHTS + src * stride_w + ks, mask=kmask & (src >= 0), other=0.0)
    dst_ids = tl.cast(window + ids_at, tl.pointer_type(tl.int32))
    dst_w = tl.cast(window + weights_at, tl.pointer_type(tl.float32))
    tl.store(dst_ids + slot * K + ks, ids, mask=kmask)
    tl.store(dst_w + slot * K + ks, w, mask=kmask)
    if src >= 0:
        dst_x = tl.cast(window, tl.pointer_type(X.dtype.element_ty)) + slot * H
        row = X + src.to(tl.int64) * stride_x
        for c in range(0, H, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            tl.store(dst_x + offs, tl.load(row + offs, mask=offs < H), mask=offs < H)
        if G > 0:
            gs = tl.arange(0, GP)
            dst_s = tl.cast(window + scales_at, tl.pointer_type(tl.float32)) + slot * G
            scale = tl.load(XS + src.to(tl.int64) * stride_xs + gs, mask=gs < G)
            tl.store(dst_s + gs, scale, mask=gs < G)


@triton.jit
def _push_rows_kernel(X, XS, IDS, WEIGHTS, SOURCES, PEERS, rank, R, H, stride_x, stride_xs,
                      stride_ids, stride_w, scales_at, ids_at, weights_at, experts_per_rank,
                      P: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, G: tl.constexpr,
                      GP: tl.constexpr, BLOCK: tl.constexpr):
    # destinations vary fastest, so local and peer stores interleave over the grid
    pid = tl.program_id(0)
    p = pid % P
    s = pid // P
    src = tl.load(SOURCES + p * R + s)
    _store_slot(X, XS, IDS, WEIGHTS, PEERS, src, p, s, rank, R, H, stride_x, stride_xs,
                stride_ids, stride_w, scales_at, ids_at, weights_at, experts_per_rank, K, KP,
                G, GP, BLOCK)


@triton.jit
def _dispatch_small_kernel(X, XS, IDS, WEIGHTS, SLOTS, PEERS, M, rank, R, H, stride_x,
                           stride_xs, stride_ids, stride_w, scales_at, ids_at, weights_at,
                           experts_per_rank, P: tl.constexpr, K: tl.constexpr,
                           KP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                           MB: tl.constexpr, BLOCK: tl.constexpr):
    # route_slots and push_rows in one launch: each program redoes the prefix sum of its
    # destination over all M rows (at most SMALL_M) and finds the row of its slot
    pid = tl.program_id(0)
    p = pid % P
    s = pid // P
    rows = tl.arange(0, MB)
    ks = tl.arange(0, KP)
    live = rows < M
    ids = tl.load(IDS + rows[:, None] * stride_ids + ks[None, :],
                  mask=live[:, None] & (ks[None, :] < K), other=-1)
    goes = tl.max(((ids >= 0) & (ids // experts_per_rank == p)).to(tl.int32), axis=1)
    slot = tl.where(goes > 0, tl.cumsum(goes, axis=0) - 1, -1)
    if s < M:  # row s's slot on p
        tl.store(SLOTS + s * P + p, tl.sum(tl.where(rows == s, slot, 0), axis=0))
    here = slot == s
    src = tl.where(tl.sum(here.to(tl.int32), axis=0) > 0,
                   tl.sum(tl.where(here, rows, 0), axis=0), -1)
    _store_slot(X, XS, IDS, WEIGHTS, PEERS, src, p, s, rank, R, H, stride_x, stride_xs,
                stride_ids, stride_w, scales_at, ids_at, weights_at, experts_per_rank, K, KP,
                G, GP, BLOCK)


def _row_args(x_MH: torch.Tensor, x_scale_MG: Optional[torch.Tensor], p: int, r: int, k: int
              ) -> tuple[torch.Tensor, torch.Tensor, int, dict[str, int]]:
    """(rows, scales, their row stride, the window's offsets and G): fp8 rows are stored as
    their bytes, and their scales after the rows; without scales G is 0 (rows stand in for
    the scales' pointer, never read)."""
    h = x_MH.shape[1]
    assert x_MH.stride(1) == 1
    if x_MH.element_size() == 1:
        assert x_scale_MG is not None, "fp8 rows travel with their scales"
        x_MH = x_MH.view(torch.uint8)
    g = 0
    if x_scale_MG is not None:
        assert x_scale_MG.dtype == torch.float32 and x_scale_MG.stride(1) == 1
        g = x_scale_MG.shape[1]
    scales_at, ids_at, weights_at = window_offsets(p, r, h, k, x_MH.element_size(), g)
    xs = x_MH if x_scale_MG is None else x_scale_MG
    return x_MH, xs, xs.stride(0), dict(scales_at=scales_at, ids_at=ids_at,
                                        weights_at=weights_at, G=g, GP=_pow2(g))


def dispatch_small(x_MH: torch.Tensor, ids_MK: torch.Tensor, weights_MK: torch.Tensor,
                   slots_MP: torch.Tensor, peer_ptrs: torch.Tensor, rank: int, r: int,
                   experts_per_rank: int, x_scale_MG: Optional[torch.Tensor] = None) -> None:
    """route_slots + push_rows in one launch, for at most SMALL_M rows (decode steps)."""
    m, h = x_MH.shape
    p, k = slots_MP.shape[1], ids_MK.shape[1]
    assert m <= SMALL_M and r >= m and slots_MP.is_contiguous()
    assert ids_MK.stride(1) == 1 and weights_MK.stride(1) == 1
    if r == 0:
        return
    x, xs, stride_xs, at = _row_args(x_MH, x_scale_MG, p, r, k)
    _dispatch_small_kernel[(p * r,)](x, xs, ids_MK, weights_MK, slots_MP, peer_ptrs, m, rank,
                                     r, h, x.stride(0), stride_xs, ids_MK.stride(0),
                                     weights_MK.stride(0), experts_per_rank=experts_per_rank,
                                     P=p, K=k, KP=_pow2(k), MB=_pow2(m),
                                     BLOCK=min(COPY_BLOCK, _pow2(h)), **at)


def push_rows(x_MH: torch.Tensor, ids_MK: torch.Tensor, weights_MK: torch.Tensor,
              sources_PR: torch.Tensor, peer_ptrs: torch.Tensor, rank: int,
              experts_per_rank: int, x_scale_MG: Optional[torch.Tensor] = None) -> None:
    """Every filled slot's row (and its scales, for fp8 rows) into its destination's recv
    window, every empty slot's ids as -1 (see the module's window layout)."""
    p, r = sources_PR.shape
    m, h = x_MH.shape
    k = ids_MK.shape[1]
    if r == 0:
        return
    assert ids_MK.stride(1) == 1 and weights_MK.stride(1) == 1
    assert weights_MK.dtype == torch.float32 and ids_MK.dtype == torch.int32
    x, xs, stride_xs, at = _row_args(x_MH, x_scale_MG, p, r, k)
    _push_rows_kernel[(p * r,)](x, xs, ids_MK, weights_MK, sources_PR, peer_ptrs, rank, r, h,
                                x.stride(0), stride_xs, ids_MK.stride(0), weights_MK.stride(0),
                                experts_per_rank=experts_per_rank, P=p, K=k, KP=_pow2(k),
                                BLOCK=min(COPY_BLOCK, _pow2(h)), **at)


@triton.jit
def _push_back_kernel(Y, IDS, PEERS, OWN, rank, R, H, stride_y, first_expert, num_local,
                      P: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                      SUM_K: tl.constexpr):
    pid = tl.program_id(0)  # destinations fastest, as in push_rows
    p = pid % P
    s = pid // P
    row = p * R + s
    ks = tl.arange(0, KP)
    ids = tl.load(IDS + row * K + ks, mask=ks < K, other=-1)
    filled = tl.max(ids, axis=0) >= 0  # some id here is this rank's
    if SUM_K:
        # Y holds the slots' pair rows [P R K, H]: each filled slot's top-k sum (topk_sum's
        # bits: in fp32 in k order, other ranks' pairs as 0, rounded once), another rank's
        # into its combine window, this rank's own into OWN, where sum_back reads them
        if filled:
            at = (rank * R + s).to(tl.int64) * H
            if p == rank:
                dst = OWN + row.to(tl.int64) * H
            else:
                dst = tl.cast(tl.load(PEERS + p), tl.pointer_type(OWN.dtype.element_ty)) + at
            for c in range(0, H, BLOCK):
                offs = c + tl.arange(0, BLOCK)
                acc = tl.zeros((BLOCK,), dtype=tl.float32)
                for k in tl.static_range(K):
                    v = tl.load(Y + (row * K + k).to(tl.int64) * stride_y + offs,
                                mask=offs < H, other=0.0)
                    local = tl.load(IDS + row * K + k) - first_expert
                    mine = (local >= 0) & (local < num_local)
                    acc += tl.where(mine, v.to(tl.float32), 0.0)
                tl.store(dst + offs, acc.to(OWN.dtype.element_ty), mask=offs < H)
    elif filled & (p != rank):
        # another rank's slot: this rank's own results stay where they are, sum_back reads
        # them from Y
        window = tl.load(PEERS + p)
        dst = tl.cast(window, tl.pointer_type(Y.dtype.element_ty)) + (rank * R + s).to(
            tl.int64) * H
        src = Y + row.to(tl.int64) * stride_y
        for c in range(0, H, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(src + offs, mask=offs < H), mask=offs < H)


def push_back(y_NH: torch.Tensor, ids_NK: torch.Tensor, peer_ptrs: torch.Tensor,
              rank: int, peers: int) -> None:
    """Each filled slot's result row (y_NH: [P R, H], the rows of the recv window) into
    [rank, slot] of its source's combine window."""
    n, h = y_NH.shape
    k = ids_NK.shape[1]
    if n == 0:
        return
    assert n % peers == 0 and ids_NK.is_contiguous() and y_NH.stride(1) == 1
    _push_back_kernel[(n,)](y_NH, ids_NK, peer_ptrs, y_NH, rank, n // peers, h, y_NH.stride(0),
                            0, 0, P=peers, K=k, KP=_pow2(k), BLOCK=min(COPY_BLOCK, _pow2(h)),
                            SUM_K=False)


def push_back_sums(rows_PH: torch.Tensor, ids_NK: torch.Tensor, first_expert: int,
                   num_local: int, own_NH: torch.Tensor, peer_ptrs: torch.Tensor, rank: int,
                   peers: int) -> None:
    """push_back of the slots' top-k sums, taken in the same launch from their pair rows
    (rows_PH [P R K, H], pair (n, k) at row n K + k; a pair whose expert is outside
    [first_expert, first_expert + num_local) counts as 0, as fused_moe.topk_sum sums them):
    another rank's filled slots into [rank, slot] of its combine window, this rank's own
    into their rows of own_NH [P R, H] (sum_back's y_NH); no [P R, H] sum is written
    first."""
    n, k = ids_NK.shape
    h = own_NH.shape[1]
    if n == 0:
        return
    assert n % peers == 0 and ids_NK.is_contiguous() and own_NH.is_contiguous()
    assert rows_PH.shape == (n * k, h) and rows_PH.stride(1) == 1 and own_NH.shape[0] == n
    _push_back_kernel[(n,)](rows_PH, ids_NK, peer_ptrs, own_NH, rank, n // peers, h,
                            rows_PH.stride(0), first_expert, num_local, P=peers, K=k,
                            KP=_pow2(k), BLOCK=min(COPY_BLOCK, _pow2(h)), SUM_K=True)


@triton.jit
def _sum_back_kernel(BACK, Y, SLOTS, OUT, rank, R, H, stride_y, stride_out, P: tl.constexpr,
                     BLOCK: tl.constexpr):
    m = tl.program_id(0)
    hb = tl.program_id(1)
    offs = hb * BLOCK + tl.arange(0, BLOCK)
    live = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for q in tl.static_range(P):  # rank order: the same bits on every run
        s = tl.load(SLOTS + m * P + q)
        if s >= 0:
            if q == rank:  # this rank's own results: where its experts wrote them
                row = Y + (q * R + s).to(tl.int64) * stride_y
            else:
                row = BACK + (q * R + s).to(tl.int64) * H
            acc += tl.load(row + offs, mask=live, other=0.0).to(tl.float32)
    tl.store(OUT + m.to(tl.int64) * stride_out + offs, acc.to(OUT.dtype.element_ty), mask=live)


def sum_back(back_NH: torch.Tensor, y_NH: torch.Tensor, slots_MP: torch.Tensor,
             out_MH: torch.Tensor, rank: int) -> None:
    """out[m] = the sum over ranks q, in order, of row q R + slots[m, q] where that slot
    exists: of back_NH (this rank's combine window as [P R, H]) for another rank's results,
    of y_NH (this rank's expert outputs) for its own."""
    m, p = slots_MP.shape
    if m == 0:
        return
    h = out_MH.shape[1]
    assert back_NH.is_contiguous() and slots_MP.is_contiguous() and out_MH.stride(1) == 1
    assert y_NH.shape == back_NH.shape and y_NH.stride(1) == 1
    block = min(COPY_BLOCK, _pow2(h))
    _sum_back_kernel[(m, triton.cdiv(h, block))](back_NH, y_NH, slots_MP, out_MH, rank,
                                                  back_NH.shape[0] // p, h, y_NH.stride(0),
                                                  out_MH.stride(0), P=p, BLOCK=block)
