"""Small fused Triton kernels for the GPU decode path (imported only on CUDA, through
kernels/ops.py): one launch where the torch formulation takes five to fifteen.

  rms_norm         RMSNorm over the last dim of [R, D] or [T, N, D] rows (strided views of a
                   fused projection are read in place); fp32 statistics, as transformers
  add_rms_norm     the residual add and the RMSNorm after it: (RMSNorm(x + r), x + r), the
                   sum rounded to the model dtype before the norm reads it, as in torch
  topk_add_rms_norm  the same, x the top-k sum of the experts' pair rows (the MoE block's
                   last pass, left to this launch: layers/pending.TopkRows)
  rotary           neox-style rope of q [T, N, D] and k [T, K, D] in one launch, cos/sin made
                   from positions and inv_freq in fp32 (no [T, D] cos/sin tensors), with
                   Qwen3's per-head q/k RMSNorm before it when given its weights; a token's
                   heads are split over several programs when the step has few tokens; with
                   `kv_cache` it also writes the rotated k and v into their KV-cache slots
                   (the store_kv below, without its own launch)
  store_kv         the new tokens' K and V into their KV-cache slots in one launch
  act_and_mul      a gated MLP's act(gate) * up from its fused [R, 2 I] projection, in fp32
                   with one rounding, to a contiguous [R, I]
  shared_gate_add  Qwen2-MoE's gated shared expert added to the routed output:
                   y + sigmoid(x . w) * shared, rounded as the four torch ops round
  unpack_decode_inputs  the head of a decode graph: its staged (token, position, request
                   row) rows into the model's inputs, each placeholder token -(j + 1) read
                   from the tokens of the step before

(The router's kernels are in kernels/moe/router.py.)
A decode step of a 48-layer model launches each of them 48 to 192 times; at batch 1 the
launches, not the bytes, are the cost, and a CUDA graph only removes their host side.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moeserve.kernels.elementwise.act import ACT_CODES, _act
from moeserve.kernels.fp8.gemm import e4m3_codes, group_scale
from moeserve.kernels.launch.pdl import pdl_args, pdl_gate


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


@triton.jit
def _rms_norm_kernel(X, W, Y, stride_xa, stride_xb, nb, D, eps, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_gate(PDL)
    row = tl.program_id(0)
    a = (row // nb).to(tl.int64)
    b = row % nb
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(X + a * stride_xa + b * stride_xb + offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / D
    y = (x * tl.rsqrt(var + eps)).to(X.dtype.element_ty)  # normalised in the input dtype,
    w = tl.load(W + offs, mask=mask, other=0.0)  # then times the weight (transformers' order)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(Y + row.to(tl.int64) * D + offs, out.to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] (2 or 3 dims, last dim contiguous) -> a contiguous tensor."""
    d = x.shape[-1]
    if x.dim() == 2:
        nb, stride_b = 1, 0
    else:
        assert x.dim() == 3
        nb, stride_b = x.shape[1], x.stride(1)
    assert x.stride(-1) == 1 and weight.shape == (d,)
    out = torch.empty(x.shape, dtype=torch.result_type(x, weight), device=x.device)
    rows = x.shape[0] * nb
    if rows:
        block = _pow2(d)
        _rms_norm_kernel[(rows,)](x, weight, out, x.stride(0), stride_b, nb, d, eps,
                                  BLOCK_D=block, num_warps=max(1, min(8, block // 256)),
                                  **pdl_args(x.device))
    return out


@triton.jit
def store_sum_and_norm(t, S, Y, W, row, D, offs, mask, eps):
    """Row `row` of [R, D] S and Y: the float32 sum t rounded to S's dtype (as torch's add
    rounds it) into S, and its RMSNorm times W into Y, normalised in S's dtype, then times
    the weight (transformers' order): add_rms_norm's arithmetic, for every kernel that ends
    in it. Returns the row stored in Y."""
    s = t.to(S.dtype.element_ty)
    tl.store(S + row * D + offs, s, mask=mask)
    s = s.to(tl.float32)
    var = tl.sum(s * s, 0) / D
    y = (s * tl.rsqrt(var + eps)).to(S.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + row * D + offs, out, mask=mask)
    return out


@triton.jit
def store_row_groups(v, QY, QS, row, D, offs, mask, GROUP: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """Row `row` (values v [BLOCK_D], D of them real; D and BLOCK_D multiples of GROUP)
    quantized per GROUP columns into QY [R, D] (float8_e4m3fn) and QS [R, D / GROUP]
    (float32): the codes and scales fp8.gemm.quantize_groups gives the row, so that an fp8
    projection of the norm's output takes them without a quantizer launch."""
    g = tl.reshape(v.to(tl.float32), [BLOCK_D // GROUP, GROUP])
    scale = group_scale(tl.max(tl.abs(g), 1))
    codes = tl.reshape(e4m3_codes(g, scale[:, None]), [BLOCK_D])
    tl.store(QY + row * D + offs, codes.to(QY.dtype.element_ty), mask=mask)
    gs = tl.arange(0, BLOCK_D // GROUP)
    tl.store(QS + row * (D // GROUP) + gs, scale, mask=gs < D // GROUP)


@triton.jit
def _add_rms_norm_kernel(X, R, W, Y, S, QY, QS, stride_x, stride_r, D, eps,
                         BLOCK_D: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    out = store_sum_and_norm(x + r, S, Y, W, row, D, offs, mask, eps)
    if QUANT:
        store_row_groups(out, QY, QS, row, D, offs, mask, GROUP, BLOCK_D)


QuantOut = tuple[torch.Tensor, torch.Tensor]  # fp8 [R, D] and float32 [R, D / group]


def quant_args(quant_out: Optional[QuantOut], rows: int, d: int, out: torch.Tensor) -> dict:
    """The norm kernels' quantized-output arguments: quant_out's tensors, checked, and its
    group (16-bit rows only); stand-ins (QUANT off) without it."""
    if quant_out is None:
        return {"QY": out, "QS": out, "QUANT": False, "GROUP": 1}
    if out.element_size() != 2:
        # compiled with the quantizer, a float32 row's sum of squares came out an ulp apart
        # from the launch without it (H200): the norm's rows must be the same either way
        raise ValueError(f"the norm quantizes 16-bit rows only, not {out.dtype}: quantize "
                         "them with quantize_groups")
    qy, qs = quant_out
    group = d // qs.shape[1]
    assert qy.shape == (rows, d) and qy.is_contiguous() and qs.is_contiguous()
    assert qs.shape == (rows, d // group) and d % group == 0 and group == _pow2(group)
    assert _pow2(d) % group == 0
    return {"QY": qy, "QS": qs, "QUANT": True, "GROUP": group}


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 quant_out: Optional[QuantOut] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) of [R, D] rows (last dim contiguous) in one
    launch; both contiguous. quant_out: the norm's rows also quantized there per D / its
    second dim columns (store_row_groups)."""
    rows, d = x.shape
    assert residual.shape == x.shape and x.stride(-1) == 1 and residual.stride(-1) == 1
    assert weight.shape == (d,)
    total = torch.empty(x.shape, dtype=torch.result_type(x, residual), device=x.device)
    out = torch.empty(x.shape, dtype=torch.result_type(total, weight), device=x.device)
    q = quant_args(quant_out, rows, d, out)
    if rows:
        block = _pow2(d)
        _add_rms_norm_kernel[(rows,)](x, residual, weight, out, total, q["QY"], q["QS"],
                                      x.stride(0), residual.stride(0), d, eps, BLOCK_D=block,
                                      QUANT=q["QUANT"], GROUP=q["GROUP"],
                                      num_warps=max(1, min(8, block // 256)),
                                      **pdl_args(x.device))
    return out, total


@triton.jit(do_not_specialize=["first_expert", "num_local"])
def _topk_add_rms_norm_kernel(Y, IDS, X, W, OUT, S, QY, QS, stride_x, D, first_expert,
                              num_local, eps, TOP_K: tl.constexpr, BLOCK_D: tl.constexpr,
                              QUANT: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr):
    # row n: its TOP_K pair rows of Y summed in fp32 in k order, those of other ranks'
    # experts as zeros, rounded to Y's dtype (moe/fused_moe.topk_sum); plus X's row (rounded),
    # stored; its RMSNorm times W (add_rms_norm)
    pdl_gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        # the row is loaded whatever its expert (every pair has one), so that its load need
        # not wait for the id's; a pair of another rank's expert then counts as 0
        v = tl.load(Y + (row * TOP_K + k) * D + offs, mask=mask, other=0.0).to(tl.float32)
        local = tl.load(IDS + row * TOP_K + k) - first_expert
        mine = (local >= 0) & (local < num_local)  # -1 is never mine: first_expert >= 0
        acc += tl.where(mine, v, 0.0)
    y = acc.to(Y.dtype.element_ty).to(tl.float32)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    out = store_sum_and_norm(y + x, S, OUT, W, row, D, offs, mask, eps)
    if QUANT:
        store_row_groups(out, QY, QS, row, D, offs, mask, GROUP, BLOCK_D)


def topk_add_rms_norm(y_PH: torch.Tensor, topk_ids: torch.Tensor, first_expert: int,
                      num_local: int, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      quant_out: Optional[QuantOut] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm(y, residual) for y the top-k sum of y_PH [N * k, H] (contiguous: pair
    (n, j) at row n k + j; topk_ids [N, k] int32, the pairs of experts outside
    [first_expert, first_expert + num_local) counted as zeros): the sum's bits as
    moe/fused_moe.topk_sum rounds it, in the norm's launch (quant_out as add_rms_norm's)."""
    n, k = topk_ids.shape
    d = y_PH.shape[1]
    assert y_PH.shape == (n * k, d) and y_PH.is_contiguous() and topk_ids.is_contiguous()
    assert residual.shape == (n, d) and residual.stride(-1) == 1 and weight.shape == (d,)
    total = torch.empty(n, d, dtype=torch.result_type(y_PH, residual), device=y_PH.device)
    out = torch.empty(n, d, dtype=torch.result_type(total, weight), device=y_PH.device)
    q = quant_args(quant_out, n, d, out)
    if n:
        block = _pow2(d)
        _topk_add_rms_norm_kernel[(n,)](y_PH, topk_ids, residual, weight, out, total, q["QY"],
                                        q["QS"], residual.stride(0), d, first_expert,
                                        num_local, eps, TOP_K=k, BLOCK_D=block,
                                        QUANT=q["QUANT"], GROUP=q["GROUP"],
                                        num_warps=max(1, min(8, block // 256)),
                                        **pdl_args(y_PH.device))
    return out, total


@triton.jit
def _rope_heads(X, Out, W, Cache, t, h0, stride_t, stride_h, n, c, s, eps, HALF: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, HAS_NORM: tl.constexpr,
                STORE: tl.constexpr):
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_f = tl.arange(0, BLOCK_F)
    mask = (offs_h[:, None] < n) & (offs_f[None, :] < HALF)
    src = X + t * stride_t + offs_h[:, None] * stride_h + offs_f[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # per-head RMSNorm first (Qwen3's q/k norm), rounded as the torch module
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        w1 = tl.load(W + offs_f, mask=offs_f < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(W + HALF + offs_f, mask=offs_f < HALF, other=0.0).to(tl.float32)
        y1 = (x1 * r[:, None]).to(Out.dtype.element_ty).to(tl.float32)
        y2 = (x2 * r[:, None]).to(Out.dtype.element_ty).to(tl.float32)
        x1 = (w1[None, :] * y1).to(Out.dtype.element_ty).to(tl.float32)
        x2 = (w2[None, :] * y2).to(Out.dtype.element_ty).to(tl.float32)
    o1 = (x1 * c[None, :] - x2 * s[None, :]).to(Out.dtype.element_ty)
    o2 = (x2 * c[None, :] + x1 * s[None, :]).to(Out.dtype.element_ty)
    head = offs_h[:, None] * (2 * HALF) + offs_f[None, :]
    tl.store(Out + t * n * (2 * HALF) + head, o1, mask=mask)
    tl.store(Out + t * n * (2 * HALF) + head + HALF, o2, mask=mask)
    if STORE:  # Cache: this token's slot row [n, 2 HALF]; the k output cast as store_kv does
        tl.store(Cache + head, o1.to(Cache.dtype.element_ty), mask=mask)
        tl.store(Cache + head + HALF, o2.to(Cache.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Pos, InvFreq, Q, K, QO, KO, QW, KW, Loc, V, Cache, stride_qt, stride_qh,
                 stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, v_offset, nq, nk,
                 factor, eps, HALF: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_gate(PDL)
    # program (token t, head block b): q heads [b BLOCK_Q, (b + 1) BLOCK_Q) and k heads
    # [b BLOCK_K, (b + 1) BLOCK_K), masked where a block runs past the heads; with STORE_KV
    # also those k heads, rotated, and the same v heads into the token's KV-cache slot
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    offs_f = tl.arange(0, BLOCK_F)
    inv = tl.load(InvFreq + offs_f, mask=offs_f < HALF, other=0.0)
    angle = tl.load(Pos + t).to(tl.float32) * inv
    # cos/sin rounded to the activations' dtype, as the torch path multiplies in that dtype
    c = (tl.cos(angle) * factor).to(QO.dtype.element_ty).to(tl.float32)
    s = (tl.sin(angle) * factor).to(QO.dtype.element_ty).to(tl.float32)
    _rope_heads(Q, QO, QW, Cache, t, b * BLOCK_Q, stride_qt, stride_qh, nq, c, s, eps, HALF,
                BLOCK_Q, BLOCK_F, HAS_NORM, False)
    k_row = Cache
    if STORE_KV:
        k_row = Cache + tl.load(Loc + t).to(tl.int64) * stride_cs
    _rope_heads(K, KO, KW, k_row, t, b * BLOCK_K, stride_kt, stride_kh, nk, c, s, eps, HALF,
                BLOCK_K, BLOCK_F, HAS_NORM, STORE_KV)
    if STORE_KV:  # v as it is, cast to the cache dtype
        offs_h = b * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (offs_h[:, None] < nk) & (offs_f[None, :] < HALF)
        src = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_f[None, :]
        dst = k_row + v_offset + offs_h[:, None] * (2 * HALF) + offs_f[None, :]
        v1 = tl.load(src, mask=mask)
        v2 = tl.load(src + HALF, mask=mask)
        tl.store(dst, v1.to(Cache.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, v2.to(Cache.dtype.element_ty), mask=mask)


ROPE_HEADS_PER_PROGRAM = 4  # q heads of one program when a step has few tokens
ROPE_PROGRAMS = 512  # head blocks are added until a step has about this many programs


def rope_head_blocks(t: int, nq: int, nk: int) -> int:
    """How many head blocks split each token's heads: enough programs for the SMs of a small
    step (batch-1 decode: one per ROPE_HEADS_PER_PROGRAM q heads), one for a large one. A
    power of two, so that the steps of a power-of-two token count (the runner's startup
    warm-up) meet every block shape the kernel is compiled for."""
    blocks = max(1, min(triton.cdiv(max(nq, nk), ROPE_HEADS_PER_PROGRAM),
                        triton.cdiv(ROPE_PROGRAMS, max(1, t))))
    return 1 << (blocks.bit_length() - 1)


def kv_cache_offset(k_cache: torch.Tensor, v_cache: torch.Tensor) -> Optional[int]:
    """Elements from k_cache to v_cache when they are contiguous [S, K, D] views of one
    buffer, the layout the KV stores write (slot s, head h at s K D + h D); else None."""
    ok = (k_cache.dim() == 3 and k_cache.is_contiguous() and v_cache.is_contiguous()
          and v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
          and (v_cache.data_ptr() - k_cache.data_ptr()) % k_cache.element_size() == 0)
    return (v_cache.data_ptr() - k_cache.data_ptr()) // k_cache.element_size() if ok else None


def rotary_stores_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc_T: torch.Tensor,
                     k_TKD: torch.Tensor, v_TKD: torch.Tensor) -> bool:
    """Whether rotary(..., kv_cache=(k_cache, v_cache, loc_T, v_TKD)) takes this layout: the
    caches as store_kv takes them, one slot per token, v [T, K, D] with unit stride in D."""
    t, heads, d = k_TKD.shape
    return (kv_cache_offset(k_cache, v_cache) is not None
            and tuple(k_cache.shape[1:]) == (heads, d) and v_TKD.shape == k_TKD.shape
            and v_TKD.stride(-1) == 1 and loc_T.shape == (t,)
            and loc_T.device == k_cache.device == v_TKD.device)


def rotary(positions_T: torch.Tensor, q_TND: torch.Tensor, k_TKD: torch.Tensor,
           inv_freq: torch.Tensor, factor: float, q_norm_w: Optional[torch.Tensor] = None,
           k_norm_w: Optional[torch.Tensor] = None, eps: float = 0.0,
           head_blocks: Optional[int] = None,
           kv_cache: Optional[tuple[torch.Tensor, ...]] = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rope of q and k at positions (neox halves), after a per-head RMSNorm of each when
    their weights are given; returns new contiguous tensors. Each token's heads are split
    into `head_blocks` programs (rope_head_blocks by default; 1: one program per token).

    kv_cache = (k_cache, v_cache, loc_T, v_TKD): also k_cache[loc] = the returned k and
    v_cache[loc] = v, cast to the cache dtype, as store_kv writes them, in the same launch;
    the layout must be one rotary_stores_kv accepts."""
    t, nq, d = q_TND.shape
    nk = k_TKD.shape[1]
    half = inv_freq.shape[0]
    assert d == 2 * half and k_TKD.shape[2] == d
    assert q_TND.stride(-1) == 1 and k_TKD.stride(-1) == 1 and q_TND.dtype == k_TKD.dtype
    has_norm = q_norm_w is not None
    assert has_norm == (k_norm_w is not None)
    qo, ko = torch.empty(q_TND.shape, dtype=q_TND.dtype, device=q_TND.device), \
        torch.empty(k_TKD.shape, dtype=k_TKD.dtype, device=k_TKD.device)
    if kv_cache is not None:
        k_cache, v_cache, loc_T, v_TKD = kv_cache
        assert rotary_stores_kv(k_cache, v_cache, loc_T, k_TKD, v_TKD), "KV layout"
        v_offset, v_strides = kv_cache_offset(k_cache, v_cache), v_TKD.stride()[:2]
    else:  # unused pointers and strides (STORE_KV=False compiles their uses away)
        k_cache, loc_T, v_TKD, v_offset, v_strides = ko, positions_T, k_TKD, 0, (0, 0)
    if t:
        blocks = head_blocks or rope_head_blocks(t, nq, nk)
        block_q, block_k = _pow2(triton.cdiv(nq, blocks)), _pow2(triton.cdiv(nk, blocks))
        blocks = max(triton.cdiv(nq, block_q), triton.cdiv(nk, block_k))
        block_f = _pow2(half)
        _rope_kernel[(t, blocks)](positions_T, inv_freq, q_TND, k_TKD, qo, ko,
                                  q_norm_w if has_norm else inv_freq,
                                  k_norm_w if has_norm else inv_freq, loc_T, v_TKD, k_cache,
                                  q_TND.stride(0), q_TND.stride(1), k_TKD.stride(0),
                                  k_TKD.stride(1), v_strides[0], v_strides[1],
                                  k_cache.stride(0), v_offset, nq, nk, factor, eps, HALF=half,
                                  BLOCK_F=block_f, BLOCK_Q=block_q, BLOCK_K=block_k,
                                  HAS_NORM=has_norm, STORE_KV=kv_cache is not None,
                                  num_warps=max(1, min(4, block_q * block_f // 128)),
                                  **pdl_args(q_TND.device))
    return qo, ko


@triton.jit
def _store_kv_kernel(Loc, K, V, Cache, stride_kt, stride_vt, stride_cs, v_offset,
                     WIDTH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_gate(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < WIDTH
    k = tl.load(K + t * stride_kt + offs, mask=mask)
    v = tl.load(V + t * stride_vt + offs, mask=mask)
    tl.store(Cache + slot * stride_cs + offs, k.to(Cache.dtype.element_ty), mask=mask)
    tl.store(Cache + v_offset + slot * stride_cs + offs, v.to(Cache.dtype.element_ty),
             mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc_T: torch.Tensor,
             k_TKD: torch.Tensor, v_TKD: torch.Tensor) -> bool:
    """k_cache[loc] = k, v_cache[loc] = v in one launch; the caches are [S, K, D] views of
    one buffer. False (nothing written) when the layout does not fit."""
    if k_TKD.dim() != 3 or v_TKD.shape != k_TKD.shape or k_cache.dim() != 3:
        return False
    t, heads, d = k_TKD.shape
    width = heads * d

    def rows_contiguous(x: torch.Tensor) -> bool:  # each row's [K, D] is one run
        return x.stride(2) == 1 and (heads == 1 or x.stride(1) == d)

    v_offset = kv_cache_offset(k_cache, v_cache)
    ok = (v_offset is not None and rows_contiguous(k_TKD) and rows_contiguous(v_TKD)
          and k_cache.shape[1] * k_cache.shape[2] == width)
    if not ok:
        return False
    if t:
        _store_kv_kernel[(t,)](loc_T, k_TKD, v_TKD, k_cache, k_TKD.stride(0), v_TKD.stride(0),
                               k_cache.stride(0), v_offset, WIDTH=width, BLOCK=_pow2(width),
                               num_warps=4, **pdl_args(k_TKD.device))
    return True


@triton.jit
def _act_and_mul_kernel(X, Y, stride_x, inter, ACT: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * inter + offs, (_act(g, ACT) * u).to(Y.dtype.element_ty), mask=mask)


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate_up[:, :I]) * gate_up[:, I:] of [R, 2 I] rows (last dim contiguous) -> [R, I];
    `act` is a kernel activation (kernels/elementwise/act.py: silu, gelu, gelu_tanh)."""
    rows, two_i = gate_up.shape
    assert gate_up.stride(-1) == 1 and two_i % 2 == 0
    inter = two_i // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, _pow2(inter))
        _act_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), inter, ACT=ACT_CODES[act], BLOCK=block,
            num_warps=4, **pdl_args(gate_up.device))
    return out


@triton.jit
def _gated_add_kernel(Y, X, W, S, Out, stride_y, stride_x, stride_s, H,
                      BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """One row: out = y + sigmoid(x . w) * s, each step rounded to the model dtype as the
    torch ops round it (the linear's output, the sigmoid, the product, the sum)."""
    pdl_gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    dot = tl.zeros([BLOCK_H], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        mask = h0 + offs < H
        x = tl.load(X + row * stride_x + h0 + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + h0 + offs, mask=mask, other=0.0).to(tl.float32)
        dot += x * w
    dt = Out.dtype.element_ty
    gate = tl.sigmoid(tl.sum(dot, 0).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    for h0 in range(0, H, BLOCK_H):
        mask = h0 + offs < H
        sv = tl.load(S + row * stride_s + h0 + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + row * stride_y + h0 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + row * H + h0 + offs, (y + (gate * sv).to(dt).to(tl.float32)).to(dt),
                 mask=mask)


def shared_gate_add(y_MH: torch.Tensor, x_MH: torch.Tensor, gate_w_H: torch.Tensor,
                    shared_MH: torch.Tensor) -> Optional[torch.Tensor]:
    """y + sigmoid(x . gate_w) * shared, a new [M, H] tensor: Qwen2-MoE's gated shared expert
    added to the routed experts' output in one launch, where torch takes four (a GEMV of one
    output, the sigmoid, the product, the sum). None for mixed dtypes or strided rows."""
    m, hidden = y_MH.shape
    if not (y_MH.dtype == x_MH.dtype == gate_w_H.dtype == shared_MH.dtype
            and y_MH.stride(-1) == x_MH.stride(-1) == shared_MH.stride(-1) == 1
            and gate_w_H.is_contiguous() and gate_w_H.numel() == x_MH.shape[1] == hidden):
        return None  # the caller's torch ops
    out = torch.empty(m, hidden, dtype=y_MH.dtype, device=y_MH.device)
    if m:
        _gated_add_kernel[(m,)](y_MH, x_MH, gate_w_H, shared_MH, out, y_MH.stride(0),
                                x_MH.stride(0), shared_MH.stride(0), hidden,
                                BLOCK_H=min(4096, _pow2(hidden)), num_warps=4,
                                **pdl_args(y_MH.device))
    return out


@triton.jit
def _unpack_kernel(Staging, Next, Ids, Pos, Prefix, Seq, Rows, bs, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < bs
    tok = tl.load(Staging + offs * 3, mask=mask, other=0)
    pos = tl.load(Staging + offs * 3 + 1, mask=mask, other=0)
    row = tl.load(Staging + offs * 3 + 2, mask=mask, other=0)
    future = tl.load(Next + tl.maximum(-1 - tok, 0), mask=mask & (tok < 0), other=0)
    tl.store(Ids + offs, tl.where(tok < 0, future, tok), mask=mask)
    tl.store(Pos + offs, pos, mask=mask)
    tl.store(Prefix + offs, pos.to(Prefix.dtype.element_ty), mask=mask)
    tl.store(Seq + offs, (pos + 1).to(Seq.dtype.element_ty), mask=mask)
    tl.store(Rows + offs, row, mask=mask)


def unpack_decode_inputs(staging: torch.Tensor, next_tokens: torch.Tensor,
                         input_ids: torch.Tensor, positions: torch.Tensor,
                         prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                         req_pool_indices: torch.Tensor) -> None:
    """Rows [0, bs) of staging [bs_max, 3] (int64 token, position, request row) into the
    inputs: input_ids (placeholders resolved from next_tokens), positions, prefix_lens =
    position, seq_lens = position + 1, req_pool_indices. One launch for what torch does in
    ten."""
    bs = input_ids.shape[0]
    assert staging.is_contiguous() and staging.shape[1] == 3 and staging.shape[0] >= bs
    block = min(1024, _pow2(bs))
    _unpack_kernel[(triton.cdiv(bs, block),)](staging, next_tokens, input_ids, positions,
                                              prefix_lens, seq_lens, req_pool_indices, bs,
                                              BLOCK=block, num_warps=4)
