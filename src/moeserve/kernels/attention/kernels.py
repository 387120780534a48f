"""Triton kernels for GQA attention over the paged KV cache (imported only on the GPU path).

Legend: B requests, T new tokens, N query heads, K KV heads, G = N / K heads per KV head,
D head dim, S splits of a decode request's keys.

Every key is found through the request table: slot = req_to_token[row, position], and the
K (V) row of KV head h is k_cache[slot, h, :]. This serves any page size (a page is a run of
consecutive slots) and needs no per-step page table.

decode   one query token per request. Flash-decoding: program (b, kv head, split) scores the G
         query heads of one KV head against its split of the keys (one tl.dot of [G, D] x
         [D, BLOCK_N] per block, so each K/V row is read once for the whole group), and writes
         a partial output with its log-sum-exp; a second kernel combines the S partials
         (program (b, head, block of BLOCK_D dims): latent attention's 512-dim rows take
         several). With one split (DIRECT: batches that fill the GPU) the first kernel writes
         the output itself and no combine runs. The grid depends only on (B, K, S): lengths
         are read from device tensors inside the kernel, so a CUDA graph captured for a
         bucket of B serves any lengths.
extend   new tokens after a cached prefix. Program (b, head, block of BLOCK_M new tokens) runs
         an online softmax over positions [window start, last query of the block], causal.
         Without a window (SPLIT), the key blocks wholly before the block's first query take
         no mask; only the blocks on the diagonal do.

Softmax runs in base 2 (exp2) with the scale folded into log2(e) * scaling; masked scores are
-inf and the running max starts at a finite -1e20, so fully masked blocks add exactly zero.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.kernels.fp8.gemm import e4m3_codes, group_scale
from moeserve.kernels.launch.pdl import pdl_gate

NEG_INIT = tl.constexpr(-1.0e20)  # a global a kernel reads must be a constexpr


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def softmax_start(ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """The running max, sum and output of an online softmax over no keys yet."""
    return (tl.full([ROWS], NEG_INIT, tl.float32), tl.zeros([ROWS], tl.float32),
            tl.zeros([ROWS, WIDTH], tl.float32))


@triton.jit
def online_softmax(qk, visible, m_i, l_i, MASKED: tl.constexpr):
    """One block of base-2 scores [rows, BLOCK_N] into the running max and sum: (new max, the
    factor that rescales what was accumulated, the block's weights, new sum). MASKED: scores
    outside `visible` count as -inf."""
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend_keys(q, Kc, Vc, ReqToToken, row, stride_rt, stride_ks, stride_kh, stride_vs,
                 stride_vh, kvh, k_pos, n_mask, visible, offs_d, d_mask, m_i, l_i, acc,
                 scale_log2, IEEE: tl.constexpr, MASKED: tl.constexpr = True):
    """Fold one block of keys into the online softmax of q's rows: the keys at positions k_pos
    of request table row `row` (n_mask: inside the range), scores kept where `visible`
    ([rows, BLOCK_N], or [1, BLOCK_N] for all rows). MASKED=False: every key of the block is
    in range and visible to every row, and d_mask is all true (n_mask, visible and d_mask
    are not read)."""
    if MASKED:
        slot = tl.load(ReqToToken + row * stride_rt + k_pos, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(Kc + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
    else:
        slot = tl.load(ReqToToken + row * stride_rt + k_pos).to(tl.int64)
        k = tl.load(Kc + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :])
    qk = _dot(q, tl.trans(k), IEEE) * scale_log2
    m_new, alpha, p, l_i = online_softmax(qk, visible, m_i, l_i, MASKED)
    if MASKED:
        v = tl.load(Vc + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
    else:
        v = tl.load(Vc + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :])
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def split_range(SeqLens, b, split, num_splits, BLOCK_N: tl.constexpr):
    """(seq_len, start, end): request b's length and the keys [start, end) of its split, the
    keys cut into num_splits runs of whole BLOCK_N blocks (a split past them is empty)."""
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    return seq_len, start, tl.minimum(start + per_split, seq_len)


@triton.jit
def store_partial(PartO, PartLse, b, split, heads, h_mask, offs_d, d_mask, m_i, l_i, acc,
                  has_keys, stride_ob, stride_oh, stride_os, stride_lb, stride_lh):
    """A split's normalised output [heads, D] and its log-sum-exp per head. A split past the
    keys (a short request in a graph of many splits) writes only its lse, -inf: the combine
    reads no output of such a split."""
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    base_o = PartO + b.to(tl.int64) * stride_ob + split * stride_os
    tl.store(base_o + heads[:, None] * stride_oh + offs_d[None, :], out,
             mask=h_mask[:, None] & d_mask[None, :] & has_keys)
    tl.store(PartLse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def store_decode(PartO, PartLse, Out, b, split, heads, h_mask, offs_d, d_mask, m_i, l_i, acc,
                 has_keys, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_xt,
                 stride_xh, DIRECT: tl.constexpr):
    """A decode program's result. DIRECT (one split): the normalised output is the
    attention's, written to Out in its dtype (what the combine would make of one split);
    else the split's partial (store_partial)."""
    if DIRECT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + b.to(tl.int64) * stride_xt + heads[:, None] * stride_xh
                 + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=h_mask[:, None] & d_mask[None, :])
    else:
        store_partial(PartO, PartLse, b, split, heads, h_mask, offs_d, d_mask, m_i, l_i, acc,
                      has_keys, stride_ob, stride_oh, stride_os, stride_lb, stride_lh)


@triton.jit
def decode_partial_kernel(
        Q, Kc, Vc, ReqToToken, ReqRows, SeqLens, PartO, PartLse, Out,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rt,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_xt, stride_xh,
        scale_log2, window, num_splits,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        DIRECT: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """DIRECT (one split, num_splits == 1): the program's normalised output is the
    attention's, written to Out in its dtype (what the combine would make of one split) and
    no partial is stored. EARLY: the next kernel may be placed before this one waits at its
    gate (kernels/launch/pdl.py; nothing is read before it)."""
    pdl_gate(PDL, EARLY)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, start, end = split_range(SeqLens, b, split, num_splits, BLOCK_N)
    row = tl.load(ReqRows + b).to(tl.int64)
    start = tl.maximum(start, seq_len - window)  # the query sits at seq_len - 1

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(Q + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(Kc.dtype.element_ty)

    m_i, l_i, acc = softmax_start(BLOCK_G, BLOCK_D)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        m_i, l_i, acc = _attend_keys(q, Kc, Vc, ReqToToken, row, stride_rt, stride_ks,
                                     stride_kh, stride_vs, stride_vh, kvh, pos, n_mask,
                                     n_mask[None, :], offs_d, d_mask, m_i, l_i, acc,
                                     scale_log2, IEEE)

    store_decode(PartO, PartLse, Out, b, split, heads, g_mask, offs_d, d_mask, m_i, l_i, acc,
                 end > start, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_xt,
                 stride_xh, DIRECT)


@triton.jit
def decode_combine_kernel(
        PartO, PartLse, Out, QOut, QScale, stride_ob, stride_oh, stride_os, stride_lb,
        stride_lh, stride_xt, stride_xh, stride_qt, stride_st, num_splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
        QUANT: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """QUANT (a head a quantization group: BLOCK_D == HEAD_DIM): the output, as rounded to
    Out's dtype, also quantized per head into QOut [T, N D] (float8_e4m3fn) and QScale
    [T, N] (float32), the codes and scales fp8.gemm.quantize_groups would give Out's rows
    with groups of HEAD_DIM, for an fp8 output projection to take without a quantizer
    launch."""
    pdl_gate(PDL, EARLY)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)  # a third grid axis: D blocks
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(PartLse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    live = s_mask & (lse > float("-inf"))  # splits that saw keys
    o = tl.load(PartO + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os
                + offs_d[None, :], mask=live[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0).to(Out.dtype.element_ty)
    tl.store(Out + b * stride_xt + h * stride_xh + offs_d, out, mask=d_mask)
    if QUANT:
        vals = out.to(tl.float32)
        scale = group_scale(tl.max(tl.abs(vals), 0))
        codes = e4m3_codes(vals, scale)
        tl.store(QOut + b * stride_qt + h * HEAD_DIM + offs_d,
                 codes.to(QOut.dtype.element_ty), mask=d_mask)
        tl.store(QScale + b * stride_st + h, scale)


@triton.jit
def extend_request(ExtendLens, PrefixLens, QStarts, ReqRows):
    """(new tokens, cached prefix, first query row, request-table row) of this program's
    request (axis 0 of an extend grid)."""
    b = tl.program_id(0)
    return (tl.load(ExtendLens + b).to(tl.int32), tl.load(PrefixLens + b).to(tl.int32),
            tl.load(QStarts + b).to(tl.int64), tl.load(ReqRows + b).to(tl.int64))


@triton.jit
def extend_kernel(
        Q, Kc, Vc, Out, ReqToToken, ReqRows, PrefixLens, ExtendLens, QStarts,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rt,
        stride_xt, stride_xh, scale_log2, window,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        SPLIT: tl.constexpr):
    ext, prefix, q0, row = extend_request(ExtendLens, PrefixLens, QStarts, ReqRows)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    if mblk * BLOCK_M >= ext:
        return
    kvh = h // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < ext
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix + offs_m
    q = tl.load(Q + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(Kc.dtype.element_ty)

    hi = tl.minimum(prefix + (mblk + 1) * BLOCK_M, prefix + ext)  # keys [lo, hi)
    lo = tl.maximum(prefix + mblk * BLOCK_M - window + 1, 0)
    m_i, l_i, acc = softmax_start(BLOCK_M, BLOCK_D)
    if SPLIT:  # no window, BLOCK_D == HEAD_DIM: the blocks before the first query need no mask
        first = (prefix + mblk * BLOCK_M) // BLOCK_N * BLOCK_N
        for n0 in range(0, first, BLOCK_N):
            m_i, l_i, acc = _attend_keys(q, Kc, Vc, ReqToToken, row, stride_rt, stride_ks,
                                         stride_kh, stride_vs, stride_vh, kvh, n0 + offs_n,
                                         None, None, offs_d, None, m_i, l_i, acc, scale_log2,
                                         IEEE, MASKED=False)
        lo = first
    for n0 in range(lo, hi, BLOCK_N):
        k_pos = n0 + offs_n
        n_mask = k_pos < hi
        visible = (n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
                   & (k_pos[None, :] > q_pos[:, None] - window))
        m_i, l_i, acc = _attend_keys(q, Kc, Vc, ReqToToken, row, stride_rt, stride_ks,
                                     stride_kh, stride_vs, stride_vh, kvh, k_pos, n_mask,
                                     visible, offs_d, d_mask, m_i, l_i, acc, scale_log2, IEEE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + (q0 + offs_m)[:, None] * stride_xt + h * stride_xh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
