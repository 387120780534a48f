"""One-shot collectives on symmetric memory: one launch each, synchronising with the peers inside.

Every rank of the axis owns a window (a symmetric buffer) that every peer can load from and
store into; PEERS holds each rank's window address, PADS each rank's signal pad (torch's
symmetric memory gives both). A collective works on the full tensor of the step, flat: the
all-gather's output, the reduction's input (every rank passes the same `total`). Its elements
are cut into chunks of CHUNK_BYTES, and program b of every rank owns the same chunks b, b + G,
b + 2G, ... (G programs, the same on every rank: `programs`). So program b's barrier with
program b of each peer is all that orders the chunks it touches, and no barrier spans the grid.

    gather      PUSH: this rank's elements [lo, hi) of the gathered tensor into every rank's
                window, at the same offsets; signal; COPY: this rank's window, now the whole
                gathered tensor, into OUT
    all_reduce  PUSH: this rank's whole tensor into slot [rank] of every rank's window;
                signal; SUM: every slot of this rank's window, added in fp32 in rank order
                (the same bits on every rank and every run), into OUT
    all_reduce_add_norm  the all-reduce of [R, D] rows, each program owning whole rows
                (rows b, b + G, ...: the same on every rank), then in its SUM phase the
                residual add and RMSNorm after it (elementwise/fused.add_rms_norm's
                arithmetic): one launch for the three, the sum never stored
    reduce      (the reduce-scatter) STAGE: this rank's full contribution into its own
                window; barrier; SUM: elements [lo, hi) from every rank's window, in fp32 in
                rank order, into OUT; barrier

The pushing collectives (gather, all_reduce) synchronise one way: program b stores, then sets
its flag on each peer to the call's epoch (release), then waits until each peer's flag on this
rank has reached that epoch (acquire) and reads its own window alone. Their stores go to one
of two halves of the window, by the epoch's parity, so a fast peer's next call stores into the
other half while this rank still reads; it can come round to this half again only after this
rank has signalled the call after, that is after this rank finished reading. A rank's epoch
counts its pushing calls (every rank makes the same ones): each program reads it when it
starts, and the last program of the grid to finish advances it.
The reduce-scatter keeps both barriers: the closing one is what lets the next collective
store into windows that peers read (a rank leaves only when every peer has read what it needed
from this rank's window), and it stages in the first half, which the pushing collectives reach
only a call later. The pushing collectives leave a peer reading only its own window, which a
barrier of the next reduce-scatter waits for.

Window layout (bytes, `window_bytes(max, P)`, kernels/comm/layout.py): the pushing region,
two halves of P x max each, then the Lamport region (kernels/comm/lamport.py), which nothing
here touches. The gather's tensor (at most max) sits at the start of a half, the all-reduce's
P slots of its tensor one after another (the all-reduce + norm's too), the reduce-scatter's
staged tensor at the start of the window.

The barrier is torch's blockwise signal-pad protocol: program b sets slot [b P + rank] of each
peer's pad from 0 to 1 (release, system scope: this program's earlier stores, every thread's,
are visible to the peer first), then waits for slot [b P + p] of its own pad to be 1 from each
peer p and resets it (acquire). A slot holds one signal; every collective sets and clears each
slot it uses once, so collectives of different grids (and torch's own one-shot all-reduce, the
same protocol) follow each other on one window.

The flags of the pushing collectives are the pad's slots [(MAX_PROGRAMS + b) P + p]
(`pad_slots`), past the barriers': the flag of peer p for program b. At p = rank (no peer
signals itself) slot b = 0 holds the rank's epoch and b = 1 the count of the grid's programs
that finished. Flags and epochs only grow (as int32, compared by their difference, so they
may wrap).

Elements move in vectors of VEC (16 bytes where every offset and address allows it, else
fewer), each in one access; a rank picks its VEC alone, since chunks count bytes whatever the
VEC. Each launches with PDL (kernels/launch/pdl.py) where the device has it on: its gate
comes first, before the epoch is read (the kernel before may be another collective), so the
kernel's launch hides behind the tail of the one before, and the next one's behind this one.
PUSH / COPY / STAGE / SUM / SYNC split the phases for Triton's interpreter, which runs
one program at a time and cannot wait for a peer: the tests run every rank's first phase,
then every rank's second, with the windows of all ranks in one process. On a GPU all are on.
Legend: P ranks of the axis, G programs, VECS vectors a chunk; in the kernels lo / hi (this
rank's part) and total (all of it) count vectors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.comm.layout import MAX_PROGRAMS, region_bytes
from moeserve.kernels.elementwise.fused import store_sum_and_norm
from moeserve.kernels.launch.pdl import pdl_args, pdl_gate

CHUNK_BYTES = 8192  # what one program moves per step of its loop; programs own whole chunks
NUM_WARPS = 4
_FLAGS = tl.constexpr(MAX_PROGRAMS)  # the kernels' name for it: where the flag slots start


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
def _epoch(PADS, rank, P: tl.constexpr, AT: tl.constexpr = 0):
    """This call's epoch: one past the last one's (this rank's count of the calls that keep
    theirs in own-pad slot (_FLAGS + AT) P + rank: the pushing collectives AT 0, the Lamport
    all-reduce 2)."""
    mine = tl.cast(tl.load(PADS + rank), tl.pointer_type(tl.int32))
    return tl.load(mine + (_FLAGS + AT) * P + rank) + 1


@triton.jit
def _this_call(PADS, rank, half, P: tl.constexpr):
    """A pushing call's epoch and where its half of every window starts (elements): by the
    epoch's parity."""
    epoch = _epoch(PADS, rank, P)
    return epoch, (epoch & 1) * half


@triton.jit
def _keep_epoch(PADS, rank, epoch, P: tl.constexpr, AT: tl.constexpr = 0):
    """The last program of the grid to get here records the call's epoch (every program
    read the previous one when it started); the count of programs that got here is in the
    slot after the epoch's."""
    tl.debug_barrier()
    mine = tl.cast(tl.load(PADS + rank), tl.pointer_type(tl.int32))
    done = tl.atomic_add(mine + (_FLAGS + AT + 1) * P + rank, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.store(mine + (_FLAGS + AT + 1) * P + rank, 0)
        tl.store(mine + (_FLAGS + AT) * P + rank, epoch)


@triton.jit
def _signal_peers(PADS, rank, epoch, P: tl.constexpr):
    """This program's stores are visible to each peer before its flag there reads `epoch`;
    then wait until every peer's flag here has reached `epoch`, and what it stored before
    is visible here."""
    tl.debug_barrier()  # every thread's stores come before the release
    slot = (_FLAGS + tl.program_id(0)) * P
    for p in tl.static_range(P):
        if p != rank:
            pad = tl.cast(tl.load(PADS + p), tl.pointer_type(tl.int32))
            tl.atomic_xchg(pad + slot + rank, epoch, sem="release", scope="sys")
    mine = tl.cast(tl.load(PADS + rank), tl.pointer_type(tl.int32))
    for p in tl.static_range(P):
        if p != rank:
            while tl.atomic_add(mine + slot + p, 0, sem="acquire", scope="sys") - epoch < 0:
                pass
    tl.debug_barrier()  # every thread's loads come after the acquire


@triton.jit
def _slots_sum(mine, offs, live, slot, P: tl.constexpr):
    """The P slots (`slot` elements apart) of this rank's window at offs, added in fp32 in
    rank order (.cg: the peers wrote them)."""
    acc = tl.load(mine + offs, mask=live, other=0.0, cache_modifier=".cg").to(tl.float32)
    for q in tl.static_range(1, P):
        acc += tl.load(mine + q * slot + offs, mask=live, other=0.0,
                       cache_modifier=".cg").to(tl.float32)
    return acc


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


@triton.jit
def _push(X, PEERS, lo, hi, at, P: tl.constexpr, VECS: tl.constexpr, VEC: tl.constexpr):
    """Vectors [lo, hi) of the flat tensor (X holds them from lo on) into every rank's window
    at element `at` + their offset: this program's chunks of them."""
    T = X.dtype.element_ty
    for s in range(_first_chunk(lo, VECS), hi, tl.num_programs(0) * VECS):
        vecs, offs = _chunk(s, VECS, VEC)
        live = ((vecs >= lo) & (vecs < hi))[:, None]
        v = tl.load(X + (offs - lo * VEC), mask=live)
        for p in tl.static_range(P):
            tl.store(_window(PEERS, p, T) + at + offs, v, mask=live)


@triton.jit(do_not_specialize=["lo", "hi", "total", "rank", "half"])
def _gather_kernel(X, OUT, PEERS, PADS, lo, hi, total, rank, half, P: tl.constexpr,
                   VECS: tl.constexpr, VEC: tl.constexpr, PUSH: tl.constexpr,
                   COPY: tl.constexpr, SYNC: tl.constexpr, PDL: tl.constexpr):
    pdl_gate(PDL)  # before the epoch too: the kernel before may be a collective
    T = OUT.dtype.element_ty
    epoch, at = _this_call(PADS, rank, half, P)
    if PUSH:
        _push(X, PEERS, lo, hi, at, P, VECS, VEC)
    if SYNC:
        _signal_peers(PADS, rank, epoch, P)
    if COPY:  # (.cg: the peers wrote the window, so it is read past this SM's L1)
        _copy(_window(PEERS, rank, T) + at, OUT, total, VECS, VEC, ".cg")
        _keep_epoch(PADS, rank, epoch, P)


@triton.jit(do_not_specialize=["total", "rank", "half"])
def _all_reduce_kernel(Y, OUT, PEERS, PADS, total, rank, half, P: tl.constexpr,
                       VECS: tl.constexpr, VEC: tl.constexpr, PUSH: tl.constexpr,
                       SUM: tl.constexpr, SYNC: tl.constexpr, PDL: tl.constexpr):
    pdl_gate(PDL)  # before the epoch too: the kernel before may be a collective
    step = tl.num_programs(0) * VECS
    T = Y.dtype.element_ty
    epoch, at = _this_call(PADS, rank, half, P)
    if PUSH:  # into slot [rank] of this call's half
        _push(Y, PEERS, 0, total, at + rank * total * VEC, P, VECS, VEC)
    if SYNC:
        _signal_peers(PADS, rank, epoch, P)
    if SUM:
        mine = _window(PEERS, rank, T) + at
        for s in range(tl.program_id(0) * VECS, total, step):
            vecs, offs = _chunk(s, VECS, VEC)
            live = (vecs < total)[:, None]
            acc = _slots_sum(mine, offs, live, total * VEC, P)
            tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=live)
        _keep_epoch(PADS, rank, epoch, P)


@triton.jit(do_not_specialize=["rows", "rank", "half"])
def _all_reduce_norm_kernel(Y, X, W, OUT, S, PEERS, PADS, rows, D, stride_x, rank, half, eps,
                            P: tl.constexpr, BLOCK_D: tl.constexpr, PUSH: tl.constexpr,
                            SUM: tl.constexpr, SYNC: tl.constexpr, PDL: tl.constexpr):
    # program b: rows b, b + G, ... of the [rows, D] tensors (Y contiguous); Y's rows summed
    # over the ranks (rounded to Y's dtype, as the all-reduce stores them), plus X's rows into
    # S (rounded, as add_rms_norm), and RMSNorm(S) times W into OUT
    pdl_gate(PDL)  # before the epoch too: the kernel before may be a collective
    T = Y.dtype.element_ty
    epoch, at = _this_call(PADS, rank, half, P)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    g = tl.num_programs(0)
    if PUSH:  # into slot [rank] of this call's half
        for row in range(tl.program_id(0), rows, g):
            v = tl.load(Y + row * D + offs, mask=mask)
            for p in tl.static_range(P):
                tl.store(_window(PEERS, p, T) + at + (rank * rows + row) * D + offs, v,
                         mask=mask)
    if SYNC:
        _signal_peers(PADS, rank, epoch, P)
    if SUM:
        mine = _window(PEERS, rank, T) + at
        for row in range(tl.program_id(0), rows, g):
            a = _slots_sum(mine + row * D, offs, mask, rows * D, P).to(T).to(tl.float32)
            x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
            store_sum_and_norm(x + a, S, OUT, W, row, D, offs, mask, eps)
        _keep_epoch(PADS, rank, epoch, P)


@triton.jit(do_not_specialize=["lo", "hi", "total", "rank"])
def _reduce_kernel(Y, OUT, PEERS, PADS, lo, hi, total, rank, P: tl.constexpr,
                   VECS: tl.constexpr, VEC: tl.constexpr, STAGE: tl.constexpr,
                   SUM: tl.constexpr, SYNC: tl.constexpr, PDL: tl.constexpr):
    pdl_gate(PDL)
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


def _half(window_nbytes: int, peers: int, total: int, e: int) -> int:
    """Elements of T in half the window's pushing region, checking that the pushing
    collective's `total` fits (window_bytes)."""
    half, rest = divmod(region_bytes(window_nbytes), 2)
    assert rest == 0 and half % e == 0 and peers * total * e <= half, \
        (window_nbytes, peers, total, e)
    return half // e


def gather(x: torch.Tensor, out: torch.Tensor, peer_ptrs: torch.Tensor,
           signal_ptrs: torch.Tensor, rank: int, lo: int, window_nbytes: int, *,
           push: bool = True, copy: bool = True, sync: bool = True) -> None:
    """out [total] = every rank's x, each at its own offset; x: this rank's elements
    [lo, lo + len(x)). Flat, contiguous, one dtype (any: the bytes of the rows). Every
    window has window_nbytes >= window_bytes(out's bytes, P)."""
    total, n, e = out.numel(), x.numel(), out.element_size()
    assert x.dtype == out.dtype and x.is_contiguous() and out.is_contiguous()
    assert 0 <= lo and lo + n <= total and total * e < 2**31
    p = peer_ptrs.numel()
    half = _half(window_nbytes, p, total, e)
    src = x if n else out  # a rank with no rows reads nothing; no empty pointer
    vec = _vec(e, lo, n, total, half, src.data_ptr() // e, out.data_ptr() // e)
    _gather_kernel[(programs(total * e),)](
        src, out, peer_ptrs, signal_ptrs, lo // vec, (lo + n) // vec, total // vec, rank,
        half, P=p, VECS=CHUNK_BYTES // e // vec, VEC=vec, PUSH=push, COPY=copy,
        SYNC=sync, num_warps=NUM_WARPS, **pdl_args(out.device))


def all_reduce(y: torch.Tensor, out: torch.Tensor, peer_ptrs: torch.Tensor,
               signal_ptrs: torch.Tensor, rank: int, window_nbytes: int, *,
               push: bool = True, add: bool = True, sync: bool = True) -> None:
    """out [total] = y summed over the ranks, in fp32 in rank order (flat, contiguous, a float
    dtype; out may be y itself). Every window has window_nbytes >= window_bytes(y's bytes, P)."""
    total, e = y.numel(), y.element_size()
    assert y.dtype == out.dtype and y.is_contiguous() and out.is_contiguous()
    assert out.numel() == total and total * e < 2**31
    p = peer_ptrs.numel()
    half = _half(window_nbytes, p, total, e)
    vec = _vec(e, total, half, y.data_ptr() // e, out.data_ptr() // e)
    _all_reduce_kernel[(programs(total * e),)](
        y, out, peer_ptrs, signal_ptrs, total // vec, rank, half, P=p,
        VECS=CHUNK_BYTES // e // vec, VEC=vec, PUSH=push, SUM=add, SYNC=sync,
        num_warps=NUM_WARPS, **pdl_args(out.device))


def all_reduce_add_norm(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        peer_ptrs: torch.Tensor, signal_ptrs: torch.Tensor, rank: int,
                        window_nbytes: int, *, push: bool = True, add: bool = True,
                        sync: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + a) x weight, x + a) for a = y [R, D] (contiguous, a float dtype) summed
    over the ranks in fp32 in rank order and rounded to y's dtype: the all-reduce, then
    elementwise/fused.add_rms_norm, bit for bit, in one launch. x: [R, D] rows of y's dtype,
    last dim contiguous. Every window has window_nbytes >= window_bytes(y's bytes, P)."""
    rows, d = y.shape
    e = y.element_size()
    assert y.is_contiguous() and x.shape == y.shape and x.dtype == y.dtype
    assert x.stride(-1) == 1 and weight.shape == (d,) and y.numel() * e < 2**31
    assert rows * x.stride(0) < 2**31
    p = peer_ptrs.numel()
    half = _half(window_nbytes, p, y.numel(), e)
    out, total, grid, launch = norm_launch(y, weight)
    if rows:
        _all_reduce_norm_kernel[grid](
            y, x, weight, out, total, peer_ptrs, signal_ptrs, rows, d, x.stride(0), rank,
            half, eps, P=p, PUSH=push, SUM=add, SYNC=sync, **launch)
    return out, total


def norm_launch(y: torch.Tensor, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[int], dict]:
    """(out, total, grid, launch keywords) of an all-reduce + RMSNorm kernel over rows y
    [R, D]: a program a row up to MAX_PROGRAMS, a block of the whole row."""
    total = torch.empty_like(y)
    out = torch.empty(y.shape, dtype=torch.result_type(total, weight), device=y.device)
    block = triton.next_power_of_2(y.shape[1])
    return out, total, (min(MAX_PROGRAMS, y.shape[0]),), dict(
        BLOCK_D=block, num_warps=max(1, min(8, block // 256)), **pdl_args(y.device))


def reduce(y: torch.Tensor, out: torch.Tensor, peer_ptrs: torch.Tensor,
           signal_ptrs: torch.Tensor, rank: int, lo: int, *, stage: bool = True,
           add: bool = True, sync: bool = True) -> None:
    """The reduce-scatter: out [n] = elements [lo, lo + n) of y summed over the ranks, in
    fp32 in rank order; y: this rank's [total] (flat, contiguous, a float dtype). Every window
    holds at least y's bytes."""
    total, n, e = y.numel(), out.numel(), y.element_size()
    assert y.dtype == out.dtype and y.is_contiguous() and out.is_contiguous()
    assert 0 <= lo and lo + n <= total and total * e < 2**31
    dst = out if n else y  # a rank that keeps no rows writes nothing
    vec = _vec(e, lo, n, total, y.data_ptr() // e, dst.data_ptr() // e)
    _reduce_kernel[(programs(total * e),)](
        y, dst, peer_ptrs, signal_ptrs, lo // vec, (lo + n) // vec, total // vec, rank,
        P=peer_ptrs.numel(), VECS=CHUNK_BYTES // e // vec, VEC=vec, STAGE=stage, SUM=add,
        SYNC=sync, num_warps=NUM_WARPS, **pdl_args(y.device))
