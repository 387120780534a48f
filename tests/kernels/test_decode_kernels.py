"""The decode-path kernels against their torch formulations: the skinny linear
(kernels/skinny/gemm.py), add + RMSNorm, the rope split over head blocks and the rope that
also stores K/V into the cache (kernels/elementwise/fused.py). The Triton kernels run on the CPU
under TRITON_INTERPRET=1 in a subprocess, in fp32 and fp16 (the interpreter's numpy bf16 does
not round to nearest even); tests/kernels/test_fused_kernels_gpu.py runs the same checks on a GPU in
bf16 and fp32.
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F

from interpreter import run_interpreted
from moeserve.layers.linear import ColumnParallelLinear, linear
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.moe.router import RoutingConfig, select_experts
from moeserve.parallel.groups import single_process_state

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton not installed")
# relative error allowed against an fp64 reference of the same (rounded) inputs
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-6}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def close_to_exact(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                   b: torch.Tensor | None, sum_ulps: float = 8) -> bool:
    """got = x @ w.T + b accumulated in fp32 and rounded once to got's dtype: each element
    within an ulp of the exact value, plus the fp32 summation error (sum_ulps 2^-24 of the sum
    of the terms' magnitudes: a few where the sums run in short chains and a tree, as in the
    FMA kernel; 2 K for one running sum of K terms whose adds may truncate, as tensor cores'
    do)."""
    x, w = x.double(), w.double()
    want = F.linear(x, w, None if b is None else b.double())
    terms = F.linear(x.abs(), w.abs(), None if b is None else b.double().abs())
    bound = torch.finfo(got.dtype).eps * want.abs() + 2 ** -24 * sum_ulps * terms
    return bool(((got.double() - want).abs() <= bound).all())


# --- checks shared with the interpreter script and the GPU tests ---------------------------

def check_skinny_linear(device: str, dtype: torch.dtype, n: int = 37, k: int = 200,
                        tiles=((8, 64, 4), (16, 64, 4, 2), None)) -> None:
    """The FMA kernel (a 3-tuple of tiles) and the MMA kernel (a 4-tuple): 1..4 rows, 6 (two
    FMA row groups), 16 and 19 (two MMA row groups), with and without bias, N and K off the
    block sizes; strided rows and a 3-dim x; bf16 inputs with an fp32 output (DeepSeek's
    router); a residual added in the same launch."""
    from moeserve.kernels.skinny.gemm import skinny_linear
    from moeserve.kernels.skinny.tiles import tiles_for

    def sum_ulps(m: int, tile) -> float:
        return 2 * k if tiles_for(m, n, k, tile).mma else 8

    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(19, k + 24, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype)
    for tile in tiles:
        # (the table's tiles for N = 37 are a router's, BLOCK_N 1: slow under the interpreter)
        rows = ((1, 6) if device == "cpu" else (1, 6, 19)) if tile is None else \
            (1, 3, 16, 19) if len(tile) == 4 else (1, 2, 3, 4, 6)
        for m in rows:
            x = wide[:m, 5:5 + k]  # rows with a stride, as a slice of a fused projection
            for bias in (None, b):
                y = skinny_linear(x, w, bias, tiles=tile)
                assert y.shape == (m, n) and y.dtype == dtype
                assert close_to_exact(y, x, w, bias, sum_ulps(m, tile)), \
                    (tile, m, bias is not None)
    x3 = torch.randn(2, 2, k, generator=gen).to(device, dtype)
    y3 = skinny_linear(x3, w, b)
    assert y3.shape == (2, 2, n)
    assert rel_err(y3, F.linear(x3.double(), w.double(), b.double())) < TOL[dtype]
    for m in (3, 6):  # the FMA and the MMA kernel by the table
        x = wide[:m, :k]
        y32 = skinny_linear(x, w, out_dtype=torch.float32)  # = F.linear(x.float(), w.float())
        assert y32.dtype == torch.float32
        assert rel_err(y32, F.linear(x.float(), w.float())) < 1e-6 * sum_ulps(m, None) / 8
    # a residual added in the epilogue, after the product's rounding: the same bits as the
    # product and then torch's +, in every row group (strided residual rows)
    for m, tile in ((1, None), (6, None), (3, (8, 64, 4)), (19, (8, 64, 4)),
                    (3, (16, 64, 4, 2)), (19, (16, 64, 4, 2))):
        x = wide[:m, 5:5 + k]
        res = torch.randn(m, n + 3, generator=gen).to(device, dtype)[:, :n]
        for bias in (None, b):
            got = skinny_linear(x, w, bias, tiles=tile, residual=res)
            assert torch.equal(got, skinny_linear(x, w, bias, tiles=tile) + res), \
                (m, tile, bias is not None)


def check_add_rms_norm(device: str, dtype: torch.dtype, d: int = 200) -> None:
    """The sum as torch rounds it; the norm as RMSNorm computes it from that sum."""
    from moeserve.kernels.elementwise.fused import add_rms_norm

    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(d, 1e-6, dtype).to(device)
    norm.weight.data = (1 + 0.3 * torch.rand(d, generator=gen)).to(device, dtype)
    for rows in (1, 3, 5):
        wide = torch.randn(rows, d + 8, generator=gen).to(device, dtype)
        x, a = wide[:, 8:], torch.randn(rows, d, generator=gen).to(device, dtype)
        out, total = add_rms_norm(x, a, norm.weight, norm.eps)
        want_total = x + a
        assert torch.equal(total, want_total)
        x32 = want_total.float()
        want = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True)
                                                + norm.eps)).to(dtype)
        assert out.dtype == want.dtype and rel_err(out, want) < TOL[dtype]
        # the statistics may be summed in another order: a rounding apart at most
        ulps = (8 if dtype == torch.float32 else 2) * torch.finfo(dtype).eps
        assert ((out.double() - want.double()).abs() <= ulps * want.double().abs()).all()
    check_quantized_norm(lambda q: add_rms_norm(x[:, :192], a[:, :192], norm.weight[:192],
                                                norm.eps, q))


def check_quantized_norm(norm_fn) -> None:
    """norm_fn(quant_out) -> (out, total): with quant_out (fp8 [R, D] and float32 [R, D / G],
    G = 64 and 32 here) the launch also stores quantize_groups' codes and scales of its out,
    bit for bit, and the same out and total as without it; float32 rows are refused."""
    from moeserve.kernels.fp8.gemm import quantize_groups

    out0, total0 = norm_fn(None)
    rows, d = out0.shape
    if out0.dtype == torch.float32:
        q = (torch.empty(rows, d, dtype=torch.float8_e4m3fn, device=out0.device),
             torch.empty(rows, d // 64, dtype=torch.float32, device=out0.device))
        with pytest.raises(ValueError, match="16-bit rows only"):
            norm_fn(q)
        return
    for group in (64, 32):
        q = (torch.empty(rows, d, dtype=torch.float8_e4m3fn, device=out0.device),
             torch.empty(rows, d // group, dtype=torch.float32, device=out0.device))
        out, total = norm_fn(q)
        assert torch.equal(out, out0) and torch.equal(total, total0)
        codes, scales = quantize_groups(out, group)
        assert torch.equal(q[0].view(torch.uint8), codes.view(torch.uint8)), group
        assert torch.equal(q[1], scales), group


def check_topk_add_rms_norm(device: str, dtype: torch.dtype, d: int = 200) -> None:
    """The MoE block's top-k sum done in the next norm's launch: the bits of topk_sum and
    then add_rms_norm; pairs of other ranks' experts and of -1 count as zeros."""
    from moeserve.kernels.elementwise.fused import add_rms_norm, topk_add_rms_norm
    from moeserve.kernels.moe.fused_moe import topk_sum

    gen = torch.Generator().manual_seed(2)
    w = (1 + 0.3 * torch.rand(d, generator=gen)).to(device, dtype)
    for n, k in ((1, 8), (5, 2), (3, 1)):
        ids = torch.randint(-1, 8, (n, k), generator=gen, dtype=torch.int32).to(device)
        y = torch.randn(n * k, d, generator=gen).to(device, dtype)
        res = torch.randn(n, d + 8, generator=gen).to(device, dtype)[:, 8:]
        out, total = topk_add_rms_norm(y, ids, 2, 3, res, w, 1e-6)  # experts 2..4 are here
        summed = topk_sum(y, ids, 2, 3)
        pairs = (y * ((ids >= 2) & (ids < 5)).view(-1, 1).to(dtype)).view(n, k, d).float()
        acc = pairs[:, 0]
        for j in range(1, k):  # in k order, in fp32
            acc = acc + pairs[:, j]
        assert torch.equal(summed, acc.to(dtype))
        want_out, want_total = add_rms_norm(summed, res, w, 1e-6)
        assert torch.equal(total, want_total) and torch.equal(out, want_out), (n, k)
    check_quantized_norm(lambda q: topk_add_rms_norm(y[:, :192].contiguous(), ids, 2, 3,
                                                     res[:, :192], w[:192], 1e-6, q))


def check_rope_head_blocks(device: str, dtype: torch.dtype, nq: int = 8, nk: int = 2,
                           d: int = 16, blocks=(1, 2, 3, 8, None)) -> None:
    """Any split of the heads gives the one-program-per-token result (blocks=1), with and
    without Qwen3's per-head q/k norm, and matches the torch path."""
    from moeserve.kernels.elementwise.fused import rotary

    gen = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(d, 1e6, {"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 64}, 256)
    inv_freq = rope._inv_freq_cpu.to(device)
    norms = [RMSNorm(d, 1e-6, dtype).to(device) for _ in range(2)]
    for n in norms:
        n.weight.data = (1 + 0.3 * torch.rand(d, generator=gen)).to(device, dtype)
    for t in (1, 3):
        pos = torch.randint(0, 256, (t,), generator=gen).to(device)
        qkv = torch.randn(t, (nq + 2 * nk) * d, generator=gen).to(device, dtype)
        q = qkv[:, : nq * d].view(t, nq, d)
        k = qkv[:, nq * d: (nq + nk) * d].view(t, nk, d)
        for with_norm in (False, True):
            extra = (norms[0].weight, norms[1].weight, 1e-6) if with_norm else ()
            one_q, one_k = rotary(pos, q, k, inv_freq, rope.attention_factor, *extra,
                                  head_blocks=1)
            for nb in blocks:
                got_q, got_k = rotary(pos, q, k, inv_freq, rope.attention_factor, *extra,
                                      head_blocks=nb)
                if device == "cpu":  # the same arithmetic per head, whatever the split
                    assert torch.equal(got_q, one_q) and torch.equal(got_k, one_k), nb
                else:  # a GPU may sum a head's squares in another order
                    assert rel_err(got_q, one_q) < TOL[dtype], nb
                    assert rel_err(got_k, one_k) < TOL[dtype], nb
            qn, kn = (norms[0](q), norms[1](k)) if with_norm else (q, k)
            cos, sin = rope.cos_sin(pos)
            cos, sin = cos[:, None].to(dtype), sin[:, None].to(dtype)
            half = d // 2
            rot = lambda x: torch.cat((-x[..., half:], x[..., :half]), -1)  # noqa: E731
            assert rel_err(one_q, qn * cos + rot(qn) * sin) < TOL[dtype]
            assert rel_err(one_k, kn * cos + rot(kn) * sin) < TOL[dtype]


def check_rope_store_kv(device: str, dtype: torch.dtype, nq: int = 8, nk: int = 2,
                       d: int = 16, blocks=(1, 2, 3, None), slots: int = 40) -> None:
    """The rope that writes k and v into their cache slots == the rope, then store_kv: the
    same q and k, bit-equal cache contents (slots in any order, the dummy slot 0 written by
    several padding rows, a cache in the model dtype and one in fp32)."""
    from moeserve.kernels.elementwise.fused import rotary, rotary_stores_kv, store_kv

    gen = torch.Generator().manual_seed(6)
    rope = RotaryEmbedding(d, 1e6, None, 4096)
    inv_freq = rope._inv_freq_cpu.to(device)
    qn, kn = ((1 + 0.3 * torch.rand(d, generator=gen)).to(device, dtype) for _ in range(2))
    for t, cache_dtype in ((1, dtype), (3, dtype), (5, torch.float32)):
        pos = torch.randint(0, 4096, (t,), generator=gen).to(device)
        qkv = torch.randn(t, (nq + 2 * nk) * d, generator=gen).to(device, dtype)
        q = qkv[:, : nq * d].view(t, nq, d)
        k = qkv[:, nq * d: (nq + nk) * d].view(t, nk, d)
        v = qkv[:, (nq + nk) * d:].view(t, nk, d)
        loc = torch.randperm(slots - 1, generator=gen)[:t] + 1
        if t == 5:
            loc[3:] = 0  # two padding rows of a graph bucket: both to the dummy slot
        loc = loc.to(device)
        cache0 = torch.randn(3, 2, slots, nk, d, generator=gen).to(device, cache_dtype)
        for with_norm in (False, True):
            extra = (qn, kn, 1e-6) if with_norm else ()
            for nb in blocks:
                want = cache0.clone()
                want_q, want_k = rotary(pos, q, k, inv_freq, 1.0, *extra, head_blocks=nb)
                assert store_kv(want[1, 0], want[1, 1], loc, want_k, v)
                got = cache0.clone()
                assert rotary_stores_kv(got[1, 0], got[1, 1], loc, k, v)
                got_q, got_k = rotary(pos, q, k, inv_freq, 1.0, *extra, head_blocks=nb,
                                      kv_cache=(got[1, 0], got[1, 1], loc, v))
                assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k), nb
                if t == 5:  # the dummy slot: whichever padding row wrote last
                    got[:, :, 0], want[:, :, 0] = 0, 0
                assert torch.equal(got, want), (t, with_norm, nb)
    cache = torch.zeros(2, slots, nk, d, device=device, dtype=dtype)
    k = torch.randn(2, nk, d, generator=gen).to(device, dtype)
    loc = torch.tensor([3, 4], device=device)
    assert not rotary_stores_kv(cache[0], cache[1], loc, k, k[:, :1])  # v of other heads
    assert not rotary_stores_kv(cache[0, :, :1], cache[1, :, :1], loc, k[:, :1], k[:, :1])
    assert not rotary_stores_kv(cache[0], cache[1], loc[:1], k, k)  # a slot per token


def check_act_and_mul(device: str, dtype: torch.dtype) -> None:
    """act(gate) * up of a fused [R, 2 I] projection (I not a power of two, a strided row
    view) against the torch activations in fp64."""
    from moeserve.kernels.elementwise.fused import act_and_mul
    from moeserve.layers.mlp import ACTIVATIONS, KERNEL_ACTS

    gen = torch.Generator().manual_seed(6)
    for rows, inter in [(1, 1408), (7, 40), (300, 2816)]:
        wide = (2 * torch.randn(rows, 2 * inter + 8, generator=gen)).to(device, dtype)
        gate_up = wide[:, : 2 * inter]  # rows of stride 2 I + 8
        for name in ("silu", "gelu", "gelu_pytorch_tanh"):
            g, u = gate_up[:, :inter].double(), gate_up[:, inter:].double()
            want = ACTIVATIONS[name](g) * u
            got = act_and_mul(gate_up, KERNEL_ACTS[name])
            assert got.shape == (rows, inter) and got.is_contiguous()
            assert rel_err(got, want) < TOL[dtype], (rows, inter, name)


def check_shared_gate_add(device: str, dtype: torch.dtype) -> None:
    """Qwen2-MoE's gated shared expert added in one launch against the torch ops it replaces
    (hidden 2048 in one slice, 5000 in two, part-full; x a strided row view); mixed dtypes are
    refused with None."""
    from moeserve.kernels.elementwise.fused import shared_gate_add

    gen = torch.Generator().manual_seed(8)
    for rows, hidden in [(1, 2048), (5, 5000)]:
        y, s = (torch.randn(rows, hidden, generator=gen).to(device, dtype) for _ in range(2))
        x = torch.randn(rows, hidden + 8, generator=gen).to(device, dtype)[:, :hidden]
        w = (torch.randn(1, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)
        want = y.double() + torch.sigmoid(x.double() @ w[0].double())[:, None] * s.double()
        got = shared_gate_add(y, x, w[0], s)
        assert got.shape == (rows, hidden) and got.dtype == dtype
        assert rel_err(got, want) < TOL[dtype], (rows, hidden)
        assert rel_err(got, y + torch.sigmoid(F.linear(x, w)) * s) < TOL[dtype]
    assert shared_gate_add(y, x, w[0], s.float() if dtype != torch.float32 else s.half()) is None


def check_unpack_decode_inputs(device: str) -> None:
    """The graph head's unpack against the torch formulation: placeholders read the step
    before's tokens, int32 lengths, rows past the batch untouched."""
    from moeserve.kernels.elementwise.fused import unpack_decode_inputs
    from moeserve.batch.forward_batch import resolve_futures

    gen = torch.Generator().manual_seed(8)
    for bs in (1, 5, 300):
        staging = torch.stack([torch.randint(0, 1000, (bs + 3,), generator=gen),
                               torch.randint(0, 4000, (bs + 3,), generator=gen),
                               torch.randint(0, 64, (bs + 3,), generator=gen)], 1)
        staging[::2, 0] = -1 - torch.randint(0, 7, (staging[::2].shape[0],), generator=gen)
        staging, nxt = staging.to(device), torch.arange(100, 107, device=device)
        ids, pos, rows = (torch.full((bs + 3,), -5, dtype=torch.int64, device=device)
                          for _ in range(3))
        prefix, seq = (torch.full((bs + 3,), -5, dtype=torch.int32, device=device)
                       for _ in range(2))
        unpack_decode_inputs(staging, nxt, ids[:bs], pos[:bs], prefix[:bs], seq[:bs],
                             rows[:bs])
        s = staging[:bs]
        assert torch.equal(ids[:bs], resolve_futures(s[:, 0], nxt))
        assert ids[:bs].min() >= 0 and torch.equal(pos[:bs], s[:, 1])
        assert torch.equal(prefix[:bs], s[:, 1].int()) and torch.equal(seq[:bs],
                                                                      s[:, 1].int() + 1)
        assert torch.equal(rows[:bs], s[:, 2])
        assert all(int(t[bs:].max()) == -5 for t in (ids, pos, rows, prefix, seq))


# --- the Triton kernels on the CPU --------------------------------------------------------

def check_topk_softmax(device: str) -> None:
    from moeserve.kernels.moe.router import topk_softmax

    gen = torch.Generator().manual_seed(2)
    # 11 rows: one a program; 90: the prefill tile of topk_tile, then each of the others, the
    # last program part-full, padding rows (num_valid) inside a program
    for (e, k, renorm, scale), (m, valid), tile in itertools.product(
            [(128, 8, True, 1.0), (60, 4, False, 2.5), (8, 2, True, 1.0)], [(11, 9), (90, 85)],
            [None, (32, 8), (16, 4), (4, 1)]):
        if tile and m < 90:
            continue
        cfg = RoutingConfig(e, k, "softmax", "greedy", 1, 1, renorm, scale)
        logits = torch.randn(m, e, generator=gen).to(device)
        want_ids, want_w = select_experts(logits, cfg, None, num_valid=valid)
        ids, w = topk_softmax(logits, k, renorm, scale, valid, tile=tile)
        assert (ids[valid:] == -1).all() and (w[valid:] == 0).all()
        for r in range(valid):  # same set of experts, same weight for each
            got = dict(zip(ids[r].tolist(), w[r].tolist()))
            ref = dict(zip(want_ids[r].tolist(), want_w[r].tolist()))
            assert got.keys() == ref.keys()
            assert max(abs(got[i] - ref[i]) for i in ref) < 1e-6
        ids, w16 = topk_softmax(logits, k, renorm, scale, m, torch.bfloat16)
        assert torch.equal(w16, w16.bfloat16().float())
    # the same launch quantizing the MoE's rows (one row a program): the quantizer's bits,
    # the top-k untouched; H not a multiple of the group, a row of zeros
    from moeserve.kernels.fp8 import gemm
    from moeserve.kernels.moe.router import quantizes_rows
    assert quantizes_rows(11, 128) and not quantizes_rows(90, 128)
    logits = torch.randn(11, 128, generator=gen).to(device)
    x = (torch.randn(11, 200, generator=gen) * 3).to(device)
    x[4] = 0
    q = torch.empty(16, 200, dtype=torch.float8_e4m3fn, device=device)
    sc = torch.empty(16, 4, device=device)
    ids, w = topk_softmax(logits, 8, True, 1.0, 9, quantize=(x, 64, q[:11], sc[:11]))
    want_q, want_s = gemm.quantize_groups(x, 64)
    assert torch.equal(q[:11].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(sc[:11], want_s)
    ids0, w0 = topk_softmax(logits, 8, True, 1.0, 9)
    assert torch.equal(ids, ids0) and torch.equal(w, w0)


def check_router_topk(device: str, dtype: torch.dtype) -> None:
    """router_topk(x, w) against the logits in fp64 (rounded to dtype where the model rounds
    them) and select_experts: the same experts, weights within the dtype's tolerance. A row
    may choose otherwise only among scores the logits' rounding cannot tell apart: each expert
    it takes has a reference logit within one rounding step of the reference's k-th (bf16
    logits tie in about a fifth of the rows of 128 experts; the kernel's fp32 sums run in
    another order). Weights are compared on the rows that choose the same experts."""
    from moeserve.kernels.moe.router import router_topk

    gen = torch.Generator().manual_seed(3)
    cases = [((128, 8, True, 1.0), (150, 140), 256, None),  # 3 programs, the last part-full
             ((60, 4, False, 2.5), (40, 40), 200, {"ROWS": 16, "BLOCK_H": 32}),  # H % 32 != 0
             ((8, 2, True, 1.0), (33, 20), 128, {"ROWS": 16})]  # E below the MMA's 16
    for (e, k, renorm, scale), (m, valid), h, tile in cases:
        for round_logits in (True, False):
            cfg = RoutingConfig(e, k, "softmax", "greedy", 1, 1, renorm, scale)
            x = torch.randn(m, h, generator=gen).to(dtype)
            w = (torch.randn(e, h, generator=gen) * h ** -0.5).to(dtype)
            logits = F.linear(x.double(), w.double())
            if round_logits:
                logits = logits.to(dtype).double()
            want_ids, want_w = select_experts(logits, cfg, None, num_valid=valid)
            round_to = dtype if round_logits else torch.float32
            ids, got_w = router_topk(x.to(device), w.to(device), k, renorm, scale, valid,
                                     round_logits, round_to, tile)
            ids, got_w = ids.cpu(), got_w.cpu()
            assert (ids[valid:] == -1).all() and (got_w[valid:] == 0).all()
            if round_to != torch.float32:
                assert torch.equal(got_w, got_w.to(round_to).float())
            tol = 1e-6 if dtype == torch.float32 else TOL[dtype]
            kth = logits[:valid].topk(k, 1).values[:, -1]
            step = torch.finfo(round_to if round_logits else torch.float32).eps
            slack = (kth.abs() * step).clamp_min(1e-6 if dtype == torch.float32 else 1e-4)
            for r in range(valid):
                got = dict(zip(ids[r].tolist(), got_w[r].tolist()))
                ref = dict(zip(want_ids[r].tolist(), want_w[r].tolist()))
                assert len(got) == k and all(0 <= i < e for i in got), (r, got)
                if got.keys() != ref.keys():
                    taken = logits[r, list(got)]
                    assert (taken >= kth[r] - slack[r]).all(), (r, sorted(got), sorted(ref))
                    continue
                assert max(abs(got[i] - ref[i]) for i in ref) <= tol * max(1.0, scale)


_INTERPRETER_SCRIPT = r"""
import torch
from test_decode_kernels import (check_act_and_mul, check_add_rms_norm, check_rope_head_blocks,
                                check_rope_store_kv, check_shared_gate_add,
                                check_router_topk, check_skinny_linear, check_topk_softmax,
                                check_topk_add_rms_norm, check_unpack_decode_inputs)

check_unpack_decode_inputs("cpu")
check_topk_softmax("cpu")
check_router_topk("cpu", torch.float32)
for dtype in (torch.float32, torch.float16):  # no bf16: numpy rounds it otherwise than a GPU
    check_skinny_linear("cpu", dtype)
    check_act_and_mul("cpu", dtype)
    check_shared_gate_add("cpu", dtype)
    check_add_rms_norm("cpu", dtype)
    check_topk_add_rms_norm("cpu", dtype)
    check_rope_head_blocks("cpu", dtype)
    check_rope_store_kv("cpu", dtype)
print("interpreter ok")
"""


@pytest.mark.timeout(200)
@needs_triton
def test_decode_kernels_under_the_interpreter():
    """The skinny linear, add + RMSNorm (also of a top-k sum), act-and-mul, gated
    shared-expert add, head-block
    rope, rope + KV store, top-k softmax, router GEMM + top-k and decode-graph unpack
    kernels on the CPU (TRITON_INTERPRET=1: numpy semantics)."""
    run_interpreted(_INTERPRETER_SCRIPT, timeout=180)


# --- the torch paths and the tile table ---------------------------------------------------

def test_topk_tile_follows_the_timings():
    """topk_softmax's tiles by rows and experts (kernels/moe/router.topk_tile): a row a warp at
    decode sizes; past them what the H200 timed fastest."""
    from moeserve.kernels.moe.router import TOPK_ONE_ROW_MAX, topk_tile

    assert topk_tile(TOPK_ONE_ROW_MAX, 128) == (1, 1)
    assert topk_tile(512, 128) == topk_tile(2048, 128) == (4, 1)
    assert topk_tile(4096, 128) == topk_tile(16384, 128) == (32, 8)
    assert topk_tile(16384, 64) == topk_tile(512, 60) == (4, 1)
    assert topk_tile(8192, 8) == (16, 4)


def test_add_forward_on_cpu_is_add_then_norm():
    torch.manual_seed(3)
    norm = RMSNorm(64, 1e-6, torch.bfloat16)
    norm.weight.data.uniform_(0.7, 1.3)
    x, a = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    out, total = norm.add_forward(x, a)
    assert torch.equal(total, x + a) and torch.equal(out, norm(x + a))


def test_linear_on_cpu_is_f_linear():
    torch.manual_seed(4)
    layer = ColumnParallelLinear(32, 24, bias=True, axis=single_process_state().attn_tp,
                                 dtype=torch.float32)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(2, 32)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert torch.equal(linear(x, layer.weight), F.linear(x, layer.weight))


def test_rope_with_a_kv_write_on_cpu_stores_through_the_pool():
    """The torch rope (no kernel) that is handed a layer's KV write leaves k and v in the
    cache as set_kv does; a CPU pool hands out no KV write, so the CPU path is unchanged."""
    from moeserve.layers.attention import PagedAttention
    from moeserve.layers.backends import create_attention_backend
    from moeserve.batch.forward_batch import ForwardBatch, ForwardMode
    from moeserve.batch.kv_cache import KVCachePool, KVWrite

    torch.manual_seed(5)
    rope = RotaryEmbedding(16, 1e6, None, 512)
    pos, loc = torch.tensor([5, 9, 300]), torch.tensor([7, 2, 11])
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    want_q, want_k = rope(pos, q, k)
    want = KVCachePool(2, 16, 2, 16, torch.bfloat16)
    want.set_kv(1, loc, want_k, v)
    pool = KVCachePool(2, 16, 2, 16, torch.bfloat16)
    got_q, got_k = rope(pos, q, k, None, KVWrite(pool, 1, loc, v))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(pool.kv_LSKD, want.kv_LSKD)
    attn = PagedAttention(1, 4, 2, 16, 0.25, create_attention_backend("torch"))
    fb = ForwardBatch(ForwardMode.DECODE, torch.zeros(3, dtype=torch.int64), pos, loc,
                      *(torch.zeros(3, dtype=torch.int64) for _ in range(4)),
                      torch.zeros(4, 512, dtype=torch.int32), pool)
    assert attn.kv_write(v, fb) is None and pool.fused_write(1, loc, v) is None


@needs_triton
def test_skinny_tiles_stay_within_the_register_budget():
    from moeserve.kernels.skinny.tiles import (MAX_ROWS, MMA_ROWS, TILE_BUDGET, beats_cublas,
                                              tiles_for)

    for m in (1, 2, 3, 4, 8, 16, 17, 100):
        for n, k in [(128, 2048), (2048, 4096), (5120, 2048), (1536, 2048), (37, 40)]:
            t = tiles_for(m, n, k)
            assert t.block_k & (t.block_k - 1) == 0 and 16 <= t.block_k < 2 * max(k, 16)
            if t.mma:  # MMA up to the table's rows only; 16 rows a program
                assert beats_cublas(m, n, k) and t.rows == MMA_ROWS and t.block_n >= 16
            else:
                assert t.rows == min(m, MAX_ROWS)
                assert t.rows * t.block_n * t.block_k <= TILE_BUDGET * 32 * t.warps \
                    or t.block_k == 16
    assert tiles_for(1, 5120, 2048, (32, 128, 8)) == (False, 1, 32, 128, 8, 1)
    assert tiles_for(4, 5120, 2048, (16, 1024, 4)) == (False, 4, 16, 128, 4, 1)
    assert tiles_for(1, 5120, 40, (64, 256, 4, 3)) == (True, MMA_ROWS, 64, 64, 4, 3)


def test_linear_takes_the_skinny_kernels_only_where_they_were_measured_faster():
    from moeserve.kernels.skinny.tiles import beats_cublas, tiles_for

    # FMA at 1 row, MMA to 16 (qkv); FMA to 2 rows, then MMA (o_proj); FMA to 16, then MMA
    # to 128 (router)
    for m, n, k, mma in [(1, 5120, 2048, False), (2, 5120, 2048, True),
                         (16, 5120, 2048, True), (2, 2048, 4096, False),
                         (3, 2048, 4096, True), (4, 128, 2048, False), (16, 128, 2048, False),
                         (17, 128, 2048, True), (128, 64, 2048, True)]:
        assert beats_cublas(m, n, k) and tiles_for(m, n, k).mma == mma, (m, n, k)
    assert not beats_cublas(0, 128, 2048) and not beats_cublas(129, 128, 2048)
    assert not beats_cublas(17, 5120, 2048)
    # past the table's rows: FMA row groups
    assert not tiles_for(129, 64, 2048).mma


def test_the_warm_up_rows_reach_every_skinny_kernel_variant():
    from moeserve.kernels.skinny.tiles import TILES, WARM_ROWS, tiles_for

    for n, k in [(e[0], min(e[1], 4096)) for e in TILES]:
        seen = {tiles_for(m, n, k) for m in WARM_ROWS}
        assert seen >= {tiles_for(m, n, k) for m in range(1, 129)}, (n, k)
