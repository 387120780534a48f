"""The "triton" paged attention against the torch reference backend, on a GPU.

Prompts, then chunks after a cached prefix, then decode steps, over the same KV pool; page
sizes 1 and 16, GQA groups of 1, 4 and 8 (Qwen3-30B-A3B's 32 query / 4 KV heads of 128),
a sliding window, bf16 and fp32. The decode kernel is also captured in a CUDA graph for a
bucket and replayed with other lengths and padded rows (dummy request row, dummy slot).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moeserve.batch.buffers import AttentionPartials
from moeserve.kernels.attention.tiles import ATTENTION_TILES
from moeserve.layers.attention import PagedAttention
from moeserve.layers.attention_triton import TritonAttentionBackend
from moeserve.layers.backends import create_attention_backend
from moeserve.batch.kv_cache import KVCachePool, ReqToTokenPool
from moeserve.kernels.launch.choice import select_kernels, use_kernels
from attention_cases import compare_phases, rel_err, replay_decode_graph
from spies import spy

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def run_case(device: str, dtype: torch.dtype, page_size: int, n: int, kh: int, d: int,
             window, lens, split, seed: int = 0, partials: tuple = (),
             tiles=ATTENTION_TILES) -> list[float]:
    """Errors of the triton backend (with `tiles`) against torch for: prompts, chunks after a
    prefix, and three decode steps, all requests of a forward batched together; with
    `partials` (part_o, part_lse), the decode partials come from them, as from the plan's
    buffers."""
    gen = torch.Generator().manual_seed(seed)
    layers = 2
    total = sum(lens) + 8
    pool = KVCachePool(layers, (total // page_size + len(lens) + 2) * page_size, kh, d, dtype,
                       device, page_size=page_size)
    rows = ReqToTokenPool(len(lens) + 1, max(lens) + 4, device)
    req_rows = [rows.alloc() for _ in lens]
    fast = PagedAttention(1, n, kh, d, d ** -0.5, TritonAttentionBackend(tiles), window)
    if partials:
        fast.backend.bind_partials(AttentionPartials(part_o=partials[0],
                                                     part_lse=partials[1]))
    ref = create_attention_backend("torch")
    seqs = [tuple(torch.randn(s, h, d, generator=gen).to(device, dtype) for h in (n, kh, kh))
            for s in lens]

    def attend(fb, parts):
        q, k, v = parts
        got = fast(q, k, v, fb)  # writes the new K/V, then attends
        return got, ref.forward(q, fast, fb)

    return compare_phases(lens, split, req_rows, rows, pool, seqs, attend)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("n,kh,d,window", [(8, 2, 64, None), (32, 4, 128, None),
                                           (4, 4, 12, None), (8, 2, 64, 37)])
def test_triton_attention_matches_torch(dtype, page_size, n, kh, d, window):
    lens = [70, 4, 203, 129, 9]  # whole length of each request (prompt + decode)
    split = [33, 0, 140, 64, 1]  # first chunk (the second one runs after this prefix)
    errors = run_case("cuda", dtype, page_size, n, kh, d, window, lens, split)
    assert max(errors) < TOL[dtype], errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_split_decode_writes_the_output_itself(monkeypatch, dtype):
    """Batches that fill the GPU without splitting their keys: the decode kernel writes the
    attention's output and no combine runs (also replayed in a CUDA graph)."""
    import moeserve.kernels.attention.kernels as K

    one = dataclasses.replace(ATTENTION_TILES, max_splits=1)
    monkeypatch.setattr(K, "decode_combine_kernel", None)  # a launch of it would fail
    errors = run_case("cuda", dtype, 16, 32, 4, 128, None, [70, 4, 203, 129, 9],
                      [33, 0, 140, 64, 1], tiles=one)
    assert max(errors) < TOL[dtype], errors
    replay_decode(one)


@pytest.mark.parametrize("page_size", [1, 16])
def test_fresh_prompts_go_through_sdpa_and_match_torch(monkeypatch, page_size):
    """The first extend (no request has a cached prefix) goes through SDPA: with the
    threshold lowered to 1 token for short prompts, and at the shipped threshold for a long
    one. The chunk after a prefix and the decode steps take the kernels."""
    import moeserve.layers.attention_triton as AT

    calls = spy(monkeypatch, AT, "sdpa_fresh", lambda *a: a[5])
    long = ATTENTION_TILES.sdpa_min_extend + 40
    errors = run_case("cuda", torch.bfloat16, page_size, 32, 4, 128, None, [long + 20, 300],
                      [long, 290])
    assert max(errors) < TOL[torch.bfloat16], errors
    assert calls == [[(0, long), (long, 290)]]
    calls.clear()
    errors = run_case("cuda", torch.bfloat16, page_size, 32, 4, 128, None,
                      [70, 4, 203, 129, 9], [33, 0, 140, 64, 1],
                      tiles=dataclasses.replace(ATTENTION_TILES, sdpa_min_extend=1))
    assert max(errors) < TOL[torch.bfloat16], errors
    assert calls == [[(0, 33), (33, 140), (173, 64), (237, 1)]]
    calls.clear()  # a head dim that SDPA's flash kernels do not take stays on the kernel
    errors = run_case("cuda", torch.bfloat16, page_size, 4, 4, 12, None, [70, 9], [33, 1])
    assert max(errors) < TOL[torch.bfloat16], errors
    assert calls == []


def test_sdpa_warm_up_runs_every_padded_length(monkeypatch):
    """The startup runs SDPA once at each length a fresh prompt can be padded to (cuDNN builds
    a plan per length), and none for a backend config that never takes SDPA."""
    import moeserve.layers.attention_triton as AT

    tl = ATTENTION_TILES
    seen = spy(monkeypatch, AT.F, "scaled_dot_product_attention", lambda q, *a: q.shape[2])
    backend = create_attention_backend("triton")
    layer = PagedAttention(0, 32, 4, 128, 128 ** -0.5, backend)
    top = tl.sdpa_min_extend + 3 * tl.sdpa_bucket + 5
    lengths = backend.warm_up(layer, top, torch.bfloat16, torch.device("cuda"))
    want = [tl.sdpa_min_extend + i * tl.sdpa_bucket for i in range(5)]
    assert lengths == want and seen == want
    assert backend.warm_up(layer, tl.sdpa_min_extend - 1, torch.bfloat16,
                           torch.device("cuda")) == []
    assert backend.warm_up(layer, top, torch.float32, torch.device("cuda")) == []
    assert seen == want
    seen.clear()  # past sdpa_max_extend only the lengths up to it (longer ones take the kernel)
    short = TritonAttentionBackend(dataclasses.replace(
        tl, sdpa_max_extend=tl.sdpa_min_extend + tl.sdpa_bucket))
    layer = PagedAttention(0, 32, 4, 128, 128 ** -0.5, short)
    assert short.warm_up(layer, top, torch.bfloat16, torch.device("cuda")) == want[:2]
    assert seen == want[:2]


def test_triton_decode_replays_in_a_cuda_graph():
    """Captured once for a bucket of 8 rows with short lengths, replayed with longer lengths,
    5 real rows and 3 padded rows (request row 0, slot 0): the real rows match torch."""
    replay_decode(ATTENTION_TILES)


def replay_decode(tiles) -> None:
    torch.manual_seed(1)
    dev, dtype, n, kh, d, bucket = "cuda", torch.bfloat16, 32, 4, 128, 8
    pool = KVCachePool(1, 4096, kh, d, dtype, dev, page_size=16)
    rows = ReqToTokenPool(bucket + 1, 1024, dev)
    pool.kv_LSKD.normal_()
    layer = PagedAttention(0, n, kh, d, d ** -0.5, TritonAttentionBackend(tiles))

    q = torch.randn(bucket, n, d, device=dev, dtype=dtype)
    k_new, v_new = (torch.randn(bucket, kh, d, device=dev, dtype=dtype) for _ in range(2))
    out, plain = replay_decode_graph(rows, pool, bucket, q,
                                     lambda fb: layer(q, k_new, v_new, fb),
                                     [300, 1, 17, 1000, 64])
    want = create_attention_backend("torch").forward(q[:5], layer, plain)
    assert torch.isfinite(out).all()
    assert rel_err(out[:5], want) < TOL[dtype]


def test_batch_one_decode_places_the_projection_early_and_gives_plain_bits(monkeypatch):
    """At batch 1 the decode attention's kernels let the next kernel be placed before they
    wait (the tiles' early_place_max_batch; layers/pdl.pdl_gate's EARLY): captured in a
    CUDA graph with the output projection (the skinny GEMV, whose first weight tile is read
    before its gate) after it, the attention and the projection equal, bit for bit, the same
    two launched the plain way (PDL off), and the attention matches torch."""
    from moeserve.kernels.skinny.gemm import skinny_linear

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    assert ATTENTION_TILES.early_place_max_batch >= 1
    torch.manual_seed(2)
    dev, dtype, n, kh, d = "cuda", torch.bfloat16, 32, 4, 128
    pool = KVCachePool(1, 4096, kh, d, dtype, dev, page_size=16)
    rows = ReqToTokenPool(2, 1024, dev)
    pool.kv_LSKD.normal_()
    layer = PagedAttention(0, n, kh, d, d ** -0.5, create_attention_backend("triton"))
    w_o = (torch.randn(2048, n * d, device=dev) * (n * d) ** -0.5).to(dtype)
    q = torch.randn(1, n, d, device=dev, dtype=dtype)
    k_new, v_new = (torch.randn(1, kh, d, device=dev, dtype=dtype) for _ in range(2))

    def step(fb):
        o = layer(q, k_new, v_new, fb)
        return o, skinny_linear(o.reshape(1, n * d), w_o)

    (out, proj), plain = replay_decode_graph(rows, pool, 1, q, step, [700])
    with use_kernels(select_kernels(dev, pdl=False)):
        want_out, want_proj = step(plain)
    torch.cuda.synchronize()
    assert torch.equal(out, want_out) and torch.equal(proj, want_proj)
    ref = create_attention_backend("torch").forward(q, layer, plain)
    assert rel_err(out, ref) < TOL[dtype]


def check_quantized_output(device: str, dtype: torch.dtype) -> None:
    """A split decode asked for its output quantized (quant_out, as an fp8 o_proj takes it):
    the codes and scales equal fp8.gemm.quantize_groups of the output's rows, a head a group,
    bit for bit, and the output itself equals the call without it; a one-split decode and an
    extend do not offer it."""
    from moeserve.batch.forward_batch import ForwardBatch, ForwardMode
    from moeserve.kernels.fp8 import gemm

    torch.manual_seed(3)
    n, kh, d, ctx = 8, 2, 64, 300
    pool = KVCachePool(1, 1024, kh, d, dtype, device, page_size=16)
    pool.kv_LSKD.normal_()
    rows = ReqToTokenPool(3, 512, device)
    real = []
    for _ in range(2):
        r = rows.alloc()
        rows.write(r, 0, pool.alloc(ctx))
        real.append(r)
    slots = torch.tensor([int(rows.table[r, ctx - 1]) for r in real], device=device)
    fb = ForwardBatch.from_requests(ForwardMode.DECODE, [[0]] * 2, [ctx - 1] * 2, real, slots,
                                    rows.table, pool)
    layer = PagedAttention(0, n, kh, d, d ** -0.5, TritonAttentionBackend())
    q = torch.randn(2, n, d, device=device, dtype=dtype)
    assert layer.quantizes_output(q, fb, d) and not layer.quantizes_output(q, fb, 2 * d)
    plain = layer.backend.forward(q, layer, fb)
    codes = torch.empty(2, n * d, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty(2, n, dtype=torch.float32, device=device)
    out = layer.backend.forward(q, layer, fb, quant_out=(codes, scales))
    assert torch.equal(out, plain)
    want_codes, want_scales = gemm.quantize_groups(out.reshape(2, n * d), d)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    whole = dataclasses.replace(ATTENTION_TILES, gqa_whole_from=0.0)  # one split
    one = PagedAttention(0, n, kh, d, d ** -0.5, TritonAttentionBackend(whole))
    assert not one.quantizes_output(q, fb, d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_decode_quantizes_its_output_for_an_fp8_projection(dtype):
    check_quantized_output("cuda", dtype)
