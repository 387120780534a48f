"""Triton kernels for latent attention (MLA) over the paged latent cache, in the absorbed form
(imported only on the GPU path and by the interpreter tests).

Legend: B requests, T new tokens, N query heads (local), C kv_lora_rank, R rope dims.

With kv_b_proj's key half absorbed into the query (q_lat = q_nope @ W_UK, [T, N, C]) and its
value half applied after attention (o = o_lat @ W_UV^T), every head attends over the same
cached rows [latent (C) | k_pe (R)]: multi-query attention with keys of C + R dims and values
of C dims, the values being the keys' first C dims. So each cached row is read once for all
the heads a program holds, and nothing is expanded per head.

    score(row r, key s) = q_lat[r] . latent[s] + q_pe[r] . k_pe[s]     (two tl.dots)
    o_lat[r]           = softmax over s of the scores @ latent

A program's rows are (token, head) pairs, token-major: BLOCK_T tokens x BLOCK_H heads. A key
is read through the request table (slot = req_to_token[row, position]) as in
attention_kernels.py, so any page size works and every length comes from device tensors.

decode   one token per request; program (b, head block, split) writes a partial output and
         its log-sum-exp per row, and attention_kernels.decode_combine_kernel combines the
         splits. The grid depends only on (B, heads, splits): graph-capturable.
extend   program (b, head block, block of BLOCK_T new tokens), causal over [0, last query of
         the block]; the key blocks wholly before the block's first query take no mask.

Softmax in base 2 with the scale folded into log2(e) * scaling, as in attention_kernels.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moeserve.kernels.attention.kernels import (_dot, extend_request, online_softmax,
                                               softmax_start, split_range, store_decode)
from moeserve.kernels.launch.pdl import pdl_gate


@triton.jit
def _attend_latent(q_lat, q_pe, Cache, ReqToToken, row, stride_rt, stride_cs, k_pos, n_mask,
                   visible, offs_c, c_mask, offs_r, r_mask, m_i, l_i, acc, scale_log2,
                   KV_RANK: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr):
    """Fold one block of cached rows (positions k_pos of request-table row `row`) into the
    online softmax of the program's rows. MASKED=False: every key is in range and visible to
    every row (n_mask and visible are not read)."""
    if MASKED:
        slot = tl.load(ReqToToken + row * stride_rt + k_pos, mask=n_mask, other=0).to(tl.int64)
        lat = tl.load(Cache + slot[:, None] * stride_cs + offs_c[None, :],
                      mask=n_mask[:, None] & c_mask[None, :], other=0.0)
        pe = tl.load(Cache + slot[:, None] * stride_cs + KV_RANK + offs_r[None, :],
                     mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    else:
        slot = tl.load(ReqToToken + row * stride_rt + k_pos).to(tl.int64)
        lat = tl.load(Cache + slot[:, None] * stride_cs + offs_c[None, :],
                      mask=c_mask[None, :], other=0.0)
        pe = tl.load(Cache + slot[:, None] * stride_cs + KV_RANK + offs_r[None, :],
                     mask=r_mask[None, :], other=0.0)
    qk = (_dot(q_lat, tl.trans(lat), IEEE) + _dot(q_pe, tl.trans(pe), IEEE)) * scale_log2
    m_new, alpha, p, l_i = online_softmax(qk, visible, m_i, l_i, MASKED)
    acc = acc * alpha[:, None] + _dot(p.to(lat.dtype), lat, IEEE)
    return m_new, l_i, acc


@triton.jit
def _load_queries(QL, QR, tok, heads, rows_mask, offs_c, c_mask, offs_r, r_mask,
                  stride_lt, stride_lh, stride_pt, stride_ph, dtype):
    """The rows' absorbed queries [rows, BLOCK_C] and rope queries [rows, BLOCK_R]."""
    q_lat = tl.load(QL + tok[:, None] * stride_lt + heads[:, None] * stride_lh + offs_c[None, :],
                    mask=rows_mask[:, None] & c_mask[None, :], other=0.0)
    q_pe = tl.load(QR + tok[:, None] * stride_pt + heads[:, None] * stride_ph + offs_r[None, :],
                   mask=rows_mask[:, None] & r_mask[None, :], other=0.0)
    return q_lat.to(dtype), q_pe.to(dtype)


@triton.jit
def mla_decode_kernel(
        QL, QR, Cache, ReqToToken, ReqRows, SeqLens, PartO, PartLse, Out,
        stride_lt, stride_lh, stride_pt, stride_ph, stride_cs, stride_rt,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh2, stride_xt, stride_xh,
        scale_log2, num_heads, num_splits,
        KV_RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr):
    """The latent form of kernels/attention/kernels.decode_partial_kernel: a program takes
    BLOCK_H heads of one request over one split of its keys; DIRECT as there."""
    pdl_gate(PDL)
    b = tl.program_id(0)
    hblk = tl.program_id(1)
    split = tl.program_id(2)
    _, start, end = split_range(SeqLens, b, split, num_splits, BLOCK_N)
    row = tl.load(ReqRows + b).to(tl.int64)

    heads = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    c_mask = offs_c < KV_RANK
    r_mask = offs_r < ROPE
    tok = tl.full([BLOCK_H], 0, tl.int64) + b.to(tl.int64)
    q_lat, q_pe = _load_queries(QL, QR, tok, heads, h_mask, offs_c, c_mask, offs_r, r_mask,
                                stride_lt, stride_lh, stride_pt, stride_ph,
                                Cache.dtype.element_ty)

    m_i, l_i, acc = softmax_start(BLOCK_H, BLOCK_C)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        m_i, l_i, acc = _attend_latent(q_lat, q_pe, Cache, ReqToToken, row, stride_rt,
                                       stride_cs, pos, n_mask, n_mask[None, :], offs_c, c_mask,
                                       offs_r, r_mask, m_i, l_i, acc, scale_log2,
                                       KV_RANK, IEEE, True)

    store_decode(PartO, PartLse, Out, b, split, heads, h_mask, offs_c, c_mask, m_i, l_i, acc,
                 end > start, stride_ob, stride_oh, stride_os, stride_lb, stride_lh2, stride_xt,
                 stride_xh, DIRECT)


@triton.jit
def mla_extend_kernel(
        QL, QR, Cache, Out, ReqToToken, ReqRows, PrefixLens, ExtendLens, QStarts,
        stride_lt, stride_lh, stride_pt, stride_ph, stride_cs, stride_rt,
        stride_xt, stride_xh, scale_log2, num_heads,
        KV_RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    ext, prefix, q0, row = extend_request(ExtendLens, PrefixLens, QStarts, ReqRows)
    hblk = tl.program_id(1)
    tblk = tl.program_id(2)
    if tblk * BLOCK_T >= ext:
        return

    # rows: (token, head) pairs, token-major
    offs_row = tl.arange(0, BLOCK_T * BLOCK_H)
    t_in = tblk * BLOCK_T + offs_row // BLOCK_H
    heads = hblk * BLOCK_H + offs_row % BLOCK_H
    rows_mask = (t_in < ext) & (heads < num_heads)
    tok = q0 + t_in
    q_pos = prefix + t_in
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    c_mask = offs_c < KV_RANK
    r_mask = offs_r < ROPE
    q_lat, q_pe = _load_queries(QL, QR, tok, heads, rows_mask, offs_c, c_mask, offs_r, r_mask,
                                stride_lt, stride_lh, stride_pt, stride_ph,
                                Cache.dtype.element_ty)

    m_i, l_i, acc = softmax_start(BLOCK_T * BLOCK_H, BLOCK_C)
    first = (prefix + tblk * BLOCK_T) // BLOCK_N * BLOCK_N  # keys before it: seen by every row
    for n0 in range(0, first, BLOCK_N):
        m_i, l_i, acc = _attend_latent(q_lat, q_pe, Cache, ReqToToken, row, stride_rt,
                                       stride_cs, n0 + offs_n, None, None, offs_c, c_mask,
                                       offs_r, r_mask, m_i, l_i, acc, scale_log2,
                                       KV_RANK, IEEE, False)
    hi = tl.minimum(prefix + (tblk + 1) * BLOCK_T, prefix + ext)
    for n0 in range(first, hi, BLOCK_N):
        k_pos = n0 + offs_n
        n_mask = k_pos < hi
        visible = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _attend_latent(q_lat, q_pe, Cache, ReqToToken, row, stride_rt,
                                       stride_cs, k_pos, n_mask, visible, offs_c, c_mask,
                                       offs_r, r_mask, m_i, l_i, acc, scale_log2,
                                       KV_RANK, IEEE, True)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + tok[:, None] * stride_xt + heads[:, None] * stride_xh + offs_c[None, :],
             out.to(Out.dtype.element_ty), mask=rows_mask[:, None] & c_mask[None, :])


# --- before attention: the latent's norm and the rope, stored (one launch a step) ------------

@triton.jit
def _mla_prep_kernel(Q, KV, NormW, Pos, InvFreq, Loc, Cache, QOut,
                     stride_qt, stride_qh, stride_kvt, stride_cs, num_heads, eps, factor,
                     NOPE: tl.constexpr, KV_RANK: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr,
                     BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr):
    """Program (token t, block of BLOCK_H heads): q_out[t, heads] = [q_nope | rope(q_pe)];
    head block 0 also writes the token's cache row [RMSNorm(latent) | rope(k_pe)]. The rope
    reads the pairs (x[2i], x[2i + 1]) (INTERLEAVED, DeepSeek's layout) or (x[i], x[i + HALF])
    and writes [rotated firsts | rotated seconds], as layers/mla.py's torch path does."""
    pdl_gate(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_f = tl.arange(0, BLOCK_F)
    f_mask = offs_f < HALF
    inv = tl.load(InvFreq + offs_f, mask=f_mask, other=0.0)
    angle = tl.load(Pos + t).to(tl.float32) * inv
    # cos/sin rounded to the activations' dtype, as the torch path multiplies in that dtype
    c = (tl.cos(angle) * factor).to(QOut.dtype.element_ty).to(tl.float32)
    s = (tl.sin(angle) * factor).to(QOut.dtype.element_ty).to(tl.float32)
    if INTERLEAVED:
        i1 = 2 * offs_f
        i2 = 2 * offs_f + 1
    else:
        i1 = offs_f
        i2 = offs_f + HALF

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_p = tl.arange(0, BLOCK_P)
    src = Q + t * stride_qt + heads[:, None] * stride_qh
    dst = QOut + (t * num_heads + heads[:, None]) * (NOPE + 2 * HALF)
    p_mask = h_mask[:, None] & (offs_p < NOPE)[None, :]
    tl.store(dst + offs_p[None, :], tl.load(src + offs_p[None, :], mask=p_mask), mask=p_mask)
    fm = h_mask[:, None] & f_mask[None, :]
    x1 = tl.load(src + NOPE + i1[None, :], mask=fm, other=0.0).to(tl.float32)
    x2 = tl.load(src + NOPE + i2[None, :], mask=fm, other=0.0).to(tl.float32)
    tl.store(dst + NOPE + offs_f[None, :],
             (x1 * c[None, :] - x2 * s[None, :]).to(QOut.dtype.element_ty), mask=fm)
    tl.store(dst + NOPE + HALF + offs_f[None, :],
             (x2 * c[None, :] + x1 * s[None, :]).to(QOut.dtype.element_ty), mask=fm)

    if hb == 0:
        row = Cache + tl.load(Loc + t).to(tl.int64) * stride_cs
        offs_c = tl.arange(0, BLOCK_C)
        c_mask = offs_c < KV_RANK
        x = tl.load(KV + t * stride_kvt + offs_c, mask=c_mask, other=0.0).to(tl.float32)
        y = (x * tl.rsqrt(tl.sum(x * x, 0) / KV_RANK + eps)).to(KV.dtype.element_ty)
        w = tl.load(NormW + offs_c, mask=c_mask, other=0.0).to(tl.float32)
        latent = (w * y.to(tl.float32)).to(KV.dtype.element_ty)  # RMSNorm's rounding
        tl.store(row + offs_c, latent.to(Cache.dtype.element_ty), mask=c_mask)
        k1 = tl.load(KV + t * stride_kvt + KV_RANK + i1, mask=f_mask, other=0.0).to(tl.float32)
        k2 = tl.load(KV + t * stride_kvt + KV_RANK + i2, mask=f_mask, other=0.0).to(tl.float32)
        o1 = (k1 * c - k2 * s).to(QOut.dtype.element_ty)
        o2 = (k2 * c + k1 * s).to(QOut.dtype.element_ty)
        tl.store(row + KV_RANK + offs_f, o1.to(Cache.dtype.element_ty), mask=f_mask)
        tl.store(row + KV_RANK + HALF + offs_f, o2.to(Cache.dtype.element_ty), mask=f_mask)


MLA_PREP_HEADS = 16  # heads of one program of the prep kernel


def mla_prep(positions_T, q_TNQ, kv_TW, norm_weight, eps: float, inv_freq, factor: float,
             loc_T, cache_SW, nope: int, interleaved: bool):
    """Latent attention's work between the projections and the attention, in one launch:
    the new tokens' cache rows [RMSNorm(latent) | rope(k_pe)] written at loc_T, and the
    queries [q_nope | rope(q_pe)] returned as a new [T, N, Q] tensor. q_TNQ: q_proj's output
    per head; kv_TW: kv_a_proj_with_mqa's [latent | k_pe] per token."""
    import torch

    from moeserve.kernels.launch.pdl import pdl_args

    t, n, qd = q_TNQ.shape
    rank = norm_weight.shape[0]
    half = (qd - nope) // 2
    assert q_TNQ.stride(-1) == 1 and kv_TW.stride(-1) == 1 and kv_TW.shape[1] == rank + 2 * half
    out = torch.empty(t, n, qd, dtype=q_TNQ.dtype, device=q_TNQ.device)
    if t == 0:
        return out
    block_h = min(MLA_PREP_HEADS, triton.next_power_of_2(n))
    _mla_prep_kernel[(t, triton.cdiv(n, block_h))](
        q_TNQ, kv_TW, norm_weight, positions_T, inv_freq, loc_T, cache_SW, out,
        q_TNQ.stride(0), q_TNQ.stride(1), kv_TW.stride(0), cache_SW.stride(0), n, eps, factor,
        NOPE=nope, KV_RANK=rank, HALF=half, BLOCK_P=triton.next_power_of_2(nope),
        BLOCK_C=triton.next_power_of_2(rank), BLOCK_F=triton.next_power_of_2(half),
        BLOCK_H=block_h, INTERLEAVED=interleaved, num_warps=4, **pdl_args(q_TNQ.device))
    return out


# --- kv_b_proj's two halves at a few tokens (decode) ------------------------------------------
# torch.bmm's cuBLAS kernels take no part in the PDL chain: at batch 1 each costs a whole
# launch and ramp (about 3.4 us on the H200 for 2 MB of weights). These GEMVs load their weight
# tile before the PDL gate and loop over the few tokens with it held in registers.

@triton.jit(do_not_specialize=["T"])
def _head_gemv_kernel(X, W, Y, T, I, J, stride_xn, stride_xt, stride_wn, stride_wi, stride_wj,
                      stride_yn, stride_yt, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
                      PDL: tl.constexpr):
    """y[n, t, j] = sum over i of x[n, t, i] W[n, i, j]; program (head n, block of BLOCK_J
    output dims) holds all I rows of its tile of W[n] (a reduction over the tile's rows, either
    of W's dims contiguous: a stride of 1 is specialised) and loops over the T tokens."""
    n = tl.program_id(0)
    offs_i = tl.arange(0, BLOCK_I)
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    i_mask, j_mask = offs_i < I, offs_j < J
    w = tl.load(W + n * stride_wn + offs_i[:, None] * stride_wi + offs_j[None, :] * stride_wj,
                mask=i_mask[:, None] & j_mask[None, :], other=0.0).to(tl.float32)
    pdl_gate(PDL)
    for t in range(T):
        x = tl.load(X + n * stride_xn + t * stride_xt + offs_i, mask=i_mask,
                    other=0.0).to(tl.float32)
        y = tl.sum(w * x[:, None], 0)
        tl.store(Y + n * stride_yn + t * stride_yt + offs_j, y.to(Y.dtype.element_ty),
                 mask=j_mask)


HEAD_GEMV_TILE = 8192  # weight elements a program of the GEMVs holds (fp32 registers)


def head_gemv(x_NTI, w_NIJ, y_NTJ):
    """y_NTJ[n] = x_NTI[n] @ w_NIJ[n] for every head n (torch.bmm's product), written into
    y_NTJ and returned, for a few tokens T; x's and y's last dims contiguous, w any strides."""
    from moeserve.kernels.launch.pdl import pdl_args

    n, t, i = x_NTI.shape
    j = w_NIJ.shape[2]
    assert x_NTI.stride(-1) == 1 and y_NTJ.stride(-1) == 1 and y_NTJ.shape == (n, t, j)
    if t and n:
        block_i = triton.next_power_of_2(i)
        block_j = max(16, min(triton.next_power_of_2(j), HEAD_GEMV_TILE // block_i))
        _head_gemv_kernel[(n, triton.cdiv(j, block_j))](
            x_NTI, w_NIJ, y_NTJ, t, i, j, x_NTI.stride(0), x_NTI.stride(1), w_NIJ.stride(0),
            w_NIJ.stride(1), w_NIJ.stride(2), y_NTJ.stride(0), y_NTJ.stride(1),
            BLOCK_I=block_i, BLOCK_J=block_j, num_warps=4, **pdl_args(x_NTI.device))
    return y_NTJ


def q_absorb(q_nope_TNP, w_uk_NPC):
    """[N, T, C] = per head q_nope [T, P] @ W_UK [P, C]."""
    import torch

    t, n, _ = q_nope_TNP.shape
    out = torch.empty(n, t, w_uk_NPC.shape[2], dtype=q_nope_TNP.dtype, device=q_nope_TNP.device)
    return head_gemv(q_nope_TNP.transpose(0, 1), w_uk_NPC, out)


def o_unabsorb(o_lat_NTC, w_uv_NVC):
    """[T, N, V] (contiguous) = per head o_lat [T, C] @ W_UV [V, C]^T."""
    import torch

    n, t, _ = o_lat_NTC.shape
    out = torch.empty(t, n, w_uv_NVC.shape[1], dtype=o_lat_NTC.dtype, device=o_lat_NTC.device)
    head_gemv(o_lat_NTC, w_uv_NVC.transpose(1, 2), out.transpose(0, 1))
    return out
