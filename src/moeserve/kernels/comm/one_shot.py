"""One-shot collectives on symmetric memory: one launch each, the peers' barriers inside it.

Every rank of the axis owns a window (a symmetric buffer) that every peer can load from and
store into; PEERS holds each rank's window address, PADS each rank's signal pad (torch's
symmetric memory gives both). A collective works on the full tensor of the step, flat: the
all-gather's output, the reduction's input (every rank passes the same `total`). Its elements
are cut into chunks of CHUNK_BYTES, and program b of every rank owns the same chunks b, b + G,
b + 2G, ... (G programs, the same on every rank: `programs`). So program b's barrier with
program b of each peer is all that orders the chunks it touches, and no barrier spans the grid.

    gather   PUSH: this rank's elements [lo, hi) of the gathered tensor into every rank's
             window, at the same offsets; barrier; COPY: this rank's window, now the whole
             gathered tensor, into OUT; barrier
    reduce   STAGE: this rank's full contribution into its own window; barrier; SUM: elements
             [lo, hi) from every rank's window, added in fp32 in rank order (the same bits on
             every rank and every run), into OUT; barrier

The closing barrier is what makes consecutive collectives safe on one window: a rank leaves a
collective only when every peer has read what it needed from this rank's window (reduce) or
copied out what was stored into its own (gather), so the next collective's stores land on
nothing anyone still reads. Entering needs no barrier: the previous one's closing barrier was it.

The barrier is torch's blockwise signal-pad protocol: program b sets slot [b P + rank] of each
peer's pad from 0 to 1 (release, system scope: this program's earlier stores, every thread's,
are visible to the peer first), then waits for slot [b P + p] of its own pad to be 1 from each
peer p and resets it (acquire). A slot holds one signal; every collective sets and clears each
slot it uses once, so collectives of different grids (and torch's own one-shot all-reduce, the
same protocol) follow each other on one window.

Elements move in vectors of VEC (16 bytes where every offset and address allows it, else
fewer), each in one access; a rank picks its VEC alone, since chunks count bytes whatever the
VEC. PUSH / COPY / STAGE / SUM / SYNC split the phases for Triton's interpreter, which runs
one program at a time and cannot wait for a peer: the tests run every rank's first phase,
then every rank's second, with the windows of all ranks in one process. On a GPU all are on.
Legend: P ranks of the axis, G programs, VECS vectors a chunk; in the kernels lo / hi (this
rank's part) and total (all of it) count vectors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 8192  # what one program moves per step of its loop; programs own whole chunks
MAX_PROGRAMS = 32  # below the SM count of every GPU this runs on: all programs resident at once
NUM_WARPS = 4


def programs(nbytes: int) -> int:
    """G for a collective over a full tensor of nbytes: the same on every rank."""
    return max(1, min(MAX_PROGRAMS, triton.cdiv(nbytes, CHUNK_BYTES)))


@triton.jit
def _sync_peers(PADS, rank, P: tl.constexpr):
    """This program and program of the same index on every peer meet; the stores each made
    before are visible to the others after."""
    tl.debug_barrier()  # every thread's stores come before the release
    slot = tl.program_id(0) * P
    for p in tl.static_range(P):
        if p != rank:
            pad = tl.cast(tl.load(PADS + p), tl.pointer_type(tl.int32))
            while tl.atomic_cas(pad + slot + rank, 0, 1, sem="release", scope="sys") != 0:
                pass
    mine = tl.cast(tl.load(PADS + rank), tl.pointer_type(tl.int32))
    for p in tl.static_range(P):
        if p != rank:
            while tl.atomic_cas(mine + slot + p, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()  # every thread's loads come after the acquire


@triton.jit
def _first_chunk(lo, VECS: tl.constexpr):
    """Where this program's chunks start to meet [lo, ...) (in vectors): the first chunk at or
    after the one holding vector lo that this program owns."""
    g = tl.num_programs(0)
    first = lo // VECS
    return (first + (tl.program_id(0) - first % g + g) % g) * VECS


@triton.jit
def _chunk(s, VECS: tl.constexpr, VEC: tl.constexpr):
    """The vectors [s, s + VECS) of a chunk, and their elements as [VECS, VEC] offsets: a mask
    on the vector index is the same over a vector, so each vector moves in one access."""
    vecs = s + tl.arange(0, VECS)
    return vecs, vecs[:, None] * VEC + tl.arange(0, VEC)[None, :]


@triton.jit
def _copy(SRC, DST, total, VECS: tl.constexpr, VEC: tl.constexpr, CACHE: tl.constexpr):
    """DST[:total vectors] = SRC[...], this program's chunks of it."""
    for s in range(tl.program_id(0) * VECS, total, tl.num_programs(0) * VECS):
        vecs, offs = _chunk(s, VECS, VEC)
        live = (vecs < total)[:, None]
        tl.store(DST + offs, tl.load(SRC + offs, mask=live, cache_modifier=CACHE), mask=live)


@triton.jit
def _window(PTRS, p, T: tl.constexpr):
    """Rank p's window as a pointer to T (symmetric buffers are aligned far beyond 16 B)."""
    return tl.multiple_of(tl.cast(tl.load(PTRS + p), tl.pointer_type(T)), 16)


@triton.jit(do_not_specialize=["lo", "hi", "total", "rank"])
def _gather_kernel(X, OUT, PEERS, PADS, lo, hi, total, rank, P: tl.constexpr,
                   VECS: tl.constexpr, VEC: tl.constexpr, PUSH: tl.constexpr,
                   COPY: tl.constexpr, SYNC: tl.constexpr):
    step = tl.num_programs(0) * VECS
    T = OUT.dtype.element_ty
    if PUSH:
        for s in range(_first_chunk(lo, VECS), hi, step):
            vecs, offs = _chunk(s, VECS, VEC)
            live = ((vecs >= lo) & (vecs < hi))[:, None]
            v = tl.load(X + (offs - lo * VEC), mask=live)
            for p in tl.static_range(P):
                tl.store(_window(PEERS, p, T) + offs, v, mask=live)
    if SYNC:
        _sync_peers(PADS, rank, P)
    if COPY:  # (.cg: the peers wrote the window, so it is read past this SM's L1)
        _copy(_window(PEERS, rank, T), OUT, total, VECS, VEC, ".cg")
    if SYNC:
        _sync_peers(PADS, rank, P)


@triton.jit(do_not_specialize=["lo", "hi", "total", "rank"])
def _reduce_kernel(Y, OUT, PEERS, PADS, lo, hi, total, rank, P: tl.constexpr,
                   VECS: tl.constexpr, VEC: tl.constexpr, STAGE: tl.constexpr,
                   SUM: tl.constexpr, SYNC: tl.constexpr):
    step = tl.num_programs(0) * VECS
    T = Y.dtype.element_ty
    if STAGE:
        _copy(Y, _window(PEERS, rank, T), total, VECS, VEC, "")
    if SYNC:
        _sync_peers(PADS, rank, P)
    if SUM:
        for s in range(_first_chunk(lo, VECS), hi, step):
            vecs, offs = _chunk(s, VECS, VEC)
            live = ((vecs >= lo) & (vecs < hi))[:, None]
            acc = tl.load(_window(PEERS, 0, T) + offs, mask=live, other=0.0,
                          cache_modifier=".cg").to(tl.float32)
            for p in tl.static_range(1, P):  # rank order
                acc += tl.load(_window(PEERS, p, T) + offs, mask=live, other=0.0,
                               cache_modifier=".cg").to(tl.float32)
            tl.store(OUT + (offs - lo * VEC), acc.to(OUT.dtype.element_ty), mask=live)
    if SYNC:
        _sync_peers(PADS, rank, P)


def _vec(elem_bytes: int, *counts: int) -> int:
    """Elements a vector: 16 bytes' worth where every count (of elements) and address is a
    multiple of it, else fewer."""
    return next(v for v in (16 // elem_bytes, 8 // elem_bytes, 4 // elem_bytes,
                            2 // elem_bytes, 1) if v >= 1 and all(c % v == 0 for c in counts))


def gather(x: torch.Tensor, out: torch.Tensor, peer_ptrs: torch.Tensor,
           signal_ptrs: torch.Tensor, rank: int, lo: int, *, push: bool = True,
           copy: bool = True, sync: bool = True) -> None:
    """out [total] = every rank's x, each at its own offset; x: this rank's elements
    [lo, lo + len(x)). Flat, contiguous, one dtype (any: the bytes of the rows). Every
    window holds at least out's bytes."""
    total, n, e = out.numel(), x.numel(), out.element_size()
    assert x.dtype == out.dtype and x.is_contiguous() and out.is_contiguous()
    assert 0 <= lo and lo + n <= total and total * e < 2**31
    src = x if n else out  # a rank with no rows reads nothing; no empty pointer
    vec = _vec(e, lo, n, total, src.data_ptr() // e, out.data_ptr() // e)
    _gather_kernel[(programs(total * e),)](
        src, out, peer_ptrs, signal_ptrs, lo // vec, (lo + n) // vec, total // vec, rank,
        P=peer_ptrs.numel(), VECS=CHUNK_BYTES // e // vec, VEC=vec, PUSH=push, COPY=copy,
        SYNC=sync, num_warps=NUM_WARPS)


def reduce(y: torch.Tensor, out: torch.Tensor, peer_ptrs: torch.Tensor,
           signal_ptrs: torch.Tensor, rank: int, lo: int, *, stage: bool = True,
           add: bool = True, sync: bool = True) -> None:
    """out [n] = elements [lo, lo + n) of y summed over the ranks, in fp32 in rank order; y:
    this rank's [total] (flat, contiguous, a float dtype; out may be y itself with lo = 0: the
    all-reduce). Every window holds at least y's bytes."""
    total, n, e = y.numel(), out.numel(), y.element_size()
    assert y.dtype == out.dtype and y.is_contiguous() and out.is_contiguous()
    assert 0 <= lo and lo + n <= total and total * e < 2**31
    dst = out if n else y  # a rank that keeps no rows writes nothing
    vec = _vec(e, lo, n, total, y.data_ptr() // e, dst.data_ptr() // e)
    _reduce_kernel[(programs(total * e),)](
        y, dst, peer_ptrs, signal_ptrs, lo // vec, (lo + n) // vec, total // vec, rank,
        P=peer_ptrs.numel(), VECS=CHUNK_BYTES // e // vec, VEC=vec, STAGE=stage, SUM=add,
        SYNC=sync, num_warps=NUM_WARPS)
