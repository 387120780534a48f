"""The "triton" latent attention (layers/mla_triton.py) against the torch MLA backend, on a GPU.

Prompts, then chunks after a cached prefix, then decode steps, over one latent pool; page
sizes 1 and 16; DeepSeek-V2-Lite's dims (16 heads, latent 512, rope 64, nope 128, values 128)
and small odd ones (heads not a multiple of 16, rope dims below a tl.dot's 16); bf16 and fp32.
The decode is also captured in a CUDA graph for a bucket and replayed with other lengths and
padded rows (dummy request row, dummy slot). tests/layers/test_mla_interpreter.py runs run_case on
the CPU.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from moeserve.batch.buffers import AttentionPartials
from moeserve.kernels.attention.tiles import ATTENTION_TILES
from moeserve.layers.attention_triton import TritonAttentionBackend
from moeserve.layers.backends import create_attention_backend
from moeserve.layers.backends import mla_backend_for
from moeserve.config.spec import MLASpec
from moeserve.batch.kv_cache import MLAKVCachePool, ReqToTokenPool
from moeserve.testing.deepseek_engine import CASES, ENGINE_FLAGS, greedy_requests, write_config
from attention_cases import compare_phases, rel_err, replay_decode_graph
from spies import spy

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
LITE = (16, 512, 64, 128, 128)  # DeepSeek-V2-Lite: heads, kv_lora_rank, rope, nope, value


def fake_layer(n: int, c: int, r: int, p: int, v: int, dtype: torch.dtype, device,
               gen: torch.Generator, layer_id: int = 1) -> SimpleNamespace:
    """What an MLA backend reads of MLAttention: dims, local heads, kv_b_proj, the scale."""
    w = (torch.randn(n * (p + v), c, generator=gen) * c ** -0.5).to(device, dtype)
    return SimpleNamespace(mla=MLASpec(None, c, p, r, v), heads_local=n, layer_id=layer_id,
                           kv_b_proj=SimpleNamespace(weight=w), scaling=(p + r) ** -0.5)


def prep_errors(device: str, dtype: torch.dtype, interleaved: bool, heads: int = 20,
                tokens: int = 7) -> tuple[float, float]:
    """mla_kernels.mla_prep against MLAttention's torch formulation (_prep) on the same
    inputs: (error of the queries, error of the cache rows written)."""
    from moeserve.layers.mla import MLAttention
    from moeserve.kernels.mla.kernels import mla_prep
    from moeserve.layers.rotary import RotaryEmbedding
    from moeserve.config.presets import PRESETS
    from moeserve.config.spec import spec_from_hf_config
    from moeserve.parallel.groups import single_process_state

    cfg = dict(PRESETS["deepseek-v2-lite"], hidden_size=64, num_attention_heads=heads,
               kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12)
    spec = spec_from_hf_config(cfg, name="prep")
    rotary = RotaryEmbedding(8, spec.rope_theta, spec.rope_scaling_dict,
                             spec.max_position_embeddings)
    layer = MLAttention(spec, single_process_state(), 0, dtype, rotary, None,
                        interleaved_rope=interleaved).to(device)
    gen = torch.Generator().manual_seed(heads + interleaved)
    layer.kv_a_layernorm.weight.copy_(torch.rand(32, generator=gen) + 0.5)
    q = torch.randn(tokens, heads, 16, generator=gen).to(device, dtype)
    kv = torch.randn(tokens, 40, generator=gen).to(device, dtype)
    positions = torch.tensor([0, 5, 17, 100, 1000, 4095, 3][:tokens], device=device)
    loc = torch.tensor([3, 9, 4, 12, 7, 8, 1][:tokens], device=device)
    rows = []
    for fast in (False, True):
        pool = MLAKVCachePool(1, 16, 32, 8, dtype, device)
        if fast:
            got = mla_prep(positions, q, kv, layer.kv_a_layernorm.weight, 1e-6,
                           rotary.inv_freq(torch.device(device)), rotary.attention_factor, loc,
                           pool.latent_cache(0), 8, interleaved)
        else:
            fb = SimpleNamespace(kv_pool=pool, out_cache_loc=loc)
            got = layer._prep(positions, q, kv, fb)
        rows.append((got, pool.latent_cache(0)))
    (q_ref, cache_ref), (q_got, cache_got) = rows
    return rel_err(q_got, q_ref), rel_err(cache_got, cache_ref)


def backends(tiles=ATTENTION_TILES) -> tuple:
    """(triton MLA backend with `tiles`, torch MLA backend), through the same lookup the model
    uses."""
    return (mla_backend_for(TritonAttentionBackend(tiles)),
            mla_backend_for(create_attention_backend("torch")))


def run_case(device: str, dtype: torch.dtype, page_size: int, dims: tuple, lens, split,
             seed: int = 0, partials: tuple = (), tiles=ATTENTION_TILES) -> list[float]:
    """Errors of the triton MLA backend (with `tiles`) against torch for: prompts, chunks after
    a prefix, and three decode steps, all requests of a forward batched together; with
    `partials` (part_o, part_lse), the decode partials come from them, as from the plan's
    buffers."""
    n, c, r, p, v = dims
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens) + 8
    pool = MLAKVCachePool(2, (total // page_size + len(lens) + 2) * page_size, c, r, dtype,
                          device, page_size=page_size)
    rows = ReqToTokenPool(len(lens) + 1, max(lens) + 4, device)
    req_rows = [rows.alloc() for _ in lens]
    layer = fake_layer(n, c, r, p, v, dtype, device, gen)
    fast, ref = backends(tiles)
    if partials:
        fast.bind_partials(AttentionPartials(part_o=partials[0], part_lse=partials[1]))
    seqs = [(torch.randn(s, n, p + r, generator=gen).to(device, dtype),
             torch.randn(s, c, generator=gen).to(device, dtype),
             torch.randn(s, r, generator=gen).to(device, dtype)) for s in lens]

    def attend(fb, parts):
        q, latent, k_pe = parts
        pool.set_latent(layer.layer_id, fb.out_cache_loc, latent, k_pe)
        got, want = fast.forward(q, layer, fb), ref.forward(q, layer, fb)
        assert got.shape == want.shape == (q.shape[0], n, v)
        return got, want

    return compare_phases(lens, split, req_rows, rows, pool, seqs, attend)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dims", [LITE, (20, 64, 4, 8, 12), (4, 16, 8, 8, 8)])
def test_triton_mla_matches_torch(dtype, page_size, dims):
    lens = [70, 4, 203, 129, 9]  # whole length of each request (prompt + decode)
    split = [33, 0, 140, 64, 1]  # first chunk (the second one runs after this prefix)
    errors = run_case("cuda", dtype, page_size, dims, lens, split)
    assert max(errors) < TOL[dtype], errors


def head_gemv_errors(device: str, dtype: torch.dtype) -> list[float]:
    """mla_kernels.q_absorb / o_unabsorb against torch.bmm in fp64, for 1..8 tokens, dims
    below, at and past a power of two, and strided views (q_nope inside [q_nope | q_pe], the
    halves of kv_b_proj's weight) as the backend passes them."""
    from moeserve.kernels.mla.kernels import o_unabsorb, q_absorb

    errors = []
    gen = torch.Generator().manual_seed(3)
    for t, (n, c, r, p, v) in [(1, LITE), (3, (20, 64, 4, 8, 12)), (8, (3, 40, 8, 24, 20))]:
        w = torch.randn(n, p + v, c, generator=gen).to(device, dtype)
        q = torch.randn(t, n, p + r, generator=gen).to(device, dtype)
        o_lat = torch.randn(n, t, c, generator=gen).to(device, dtype)
        got_q = q_absorb(q[..., :p], w[:, :p])
        want_q = torch.bmm(q[..., :p].transpose(0, 1).double(), w[:, :p].double())
        got_o = o_unabsorb(o_lat, w[:, p:])
        want_o = torch.bmm(o_lat.double(), w[:, p:].transpose(1, 2).double()).transpose(0, 1)
        assert got_q.shape == want_q.shape and got_o.shape == want_o.shape
        errors += [rel_err(got_q, want_q), rel_err(got_o, want_o)]
    return errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_gemvs_are_the_batched_gemms(dtype):
    errors = head_gemv_errors("cuda", dtype)
    assert max(errors) < TOL[dtype], errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads", [20, 3])
def test_mla_prep_kernel_matches_the_torch_formulation(dtype, interleaved, heads):
    q_err, cache_err = prep_errors("cuda", dtype, interleaved, heads)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert q_err < tol and cache_err < tol, (q_err, cache_err)


def test_triton_mla_long_context_decode_matches_torch(monkeypatch):
    """Contexts past many key blocks per split (2 requests, so 64+ splits each); the fresh
    prompts (past MLA_SDPA_MIN_EXTEND) go through SDPA in the expanded form, the chunks after
    them through the kernel."""
    import moeserve.layers.mla_triton as MT

    calls = spy(monkeypatch, MT, "mla_sdpa", lambda *a: a[4])
    chunk = ATTENTION_TILES.mla_sdpa_min_extend // 2  # after the prefix: the kernel's
    errors = run_case("cuda", torch.bfloat16, 16, LITE, [2000 + chunk, 1700], [2000, 1690])
    assert max(errors) < TOL[torch.bfloat16], errors
    assert calls == [[(0, 0, 2000, 0), (1, 2000, 1690, 0)]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threshold", [1, 50])
def test_requests_through_sdpa_match_torch(monkeypatch, dtype, threshold):
    """With the threshold at 1 token every request of an extend takes SDPA, fresh (padded to
    the bucket) or after a prefix (mask aligned to the last key); at 50 the long ones do and
    the kernel takes the others in the same step. bf16 only: fp32 stays on the kernel. Odd
    dims (v wider than q) included."""
    import moeserve.layers.mla_triton as MT

    calls = spy(monkeypatch, MT, "mla_sdpa", lambda *a: a[4])
    tiles = dataclasses.replace(ATTENTION_TILES, mla_sdpa_min_extend=threshold)
    for dims in (LITE, (20, 64, 4, 8, 16)):
        errors = run_case("cuda", dtype, 16, dims, [70, 4, 203, 129, 9], [33, 0, 140, 64, 1],
                          tiles=tiles)
        assert max(errors) < TOL[dtype], errors
    # first step: new [33, 0, 140, 64, 1], no prefix; second: new [34, 1, 60, 62, 5] after
    # the first's; (batch index, first row, new, prefix)
    first = [(0, 0, 33, 0), (2, 33, 140, 0), (3, 173, 64, 0), (4, 237, 1, 0)]
    second = [(0, 0, 34, 33), (1, 34, 1, 0), (2, 35, 60, 140), (3, 95, 62, 64), (4, 157, 5, 1)]
    picked = [[r for r in step if r[2] >= threshold] for step in (first, second)]
    want = picked * 2 if dtype == torch.bfloat16 else []
    assert calls == want


def test_mla_sdpa_warm_up_runs_every_padded_length(monkeypatch):
    import moeserve.layers.attention_triton as AT

    tl = ATTENTION_TILES
    seen = spy(monkeypatch, AT.F, "scaled_dot_product_attention", lambda q, *a: q.shape[2:])
    fast, _ = backends()
    layer = fake_layer(*LITE, torch.bfloat16, "cuda", torch.Generator())
    top = tl.mla_sdpa_min_extend + 2 * tl.sdpa_bucket + 1
    lengths = fast.warm_up(layer, top, torch.bfloat16, torch.device("cuda"))
    want = [tl.sdpa_length(tl.mla_sdpa_min_extend) + i * tl.sdpa_bucket for i in range(4)]
    assert lengths == want and seen == [(x, 192) for x in want]
    assert fast.warm_up(layer, top, torch.float32, torch.device("cuda")) == []


@pytest.mark.parametrize("bucket,lens", [(8, [700, 33, 1000, 5, 256]), (2, [700]), (1, [33])])
def test_triton_mla_decode_replays_in_a_cuda_graph(bucket, lens):
    """Captured once for a bucket with short lengths, replayed with longer lengths, real rows
    and padded rows (request row 0, slot 0): the real rows match torch. Buckets of 1 and 2
    take kv_b_proj's halves by the GEMVs (mla_head_gemv_max_tokens), 8 by torch.bmm."""
    assert 2 <= ATTENTION_TILES.mla_head_gemv_max_tokens < 8
    replay_mla_decode(bucket, lens, ATTENTION_TILES)


def replay_mla_decode(bucket: int, lens: list[int], tiles) -> None:
    torch.manual_seed(1)
    dev, dtype = "cuda", torch.bfloat16
    n, c, r, p, v = LITE
    pool = MLAKVCachePool(2, 4096, c, r, dtype, dev, page_size=16)
    rows = ReqToTokenPool(bucket + 1, 1024, dev)
    pool.kv_LSW.normal_()
    layer = fake_layer(n, c, r, p, v, dtype, dev, torch.Generator().manual_seed(2))
    fast, ref = backends(tiles)

    q = torch.randn(bucket, n, p + r, device=dev, dtype=dtype)
    out, plain = replay_decode_graph(rows, pool, bucket, q, lambda fb: fast.forward(q, layer, fb),
                                     lens)
    want = ref.forward(q[:len(lens)], layer, plain)
    assert torch.isfinite(out).all()
    assert rel_err(out[:len(lens)], want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_split_mla_decode_writes_the_output_itself(monkeypatch, dtype):
    """Batches that fill the GPU without splitting their keys: the latent decode kernel writes
    the attention's output and no combine runs (also replayed in a CUDA graph)."""
    import moeserve.kernels.attention.kernels as AK

    one = dataclasses.replace(ATTENTION_TILES, max_splits=1)
    monkeypatch.setattr(AK, "decode_combine_kernel", None)  # a launch of it would fail
    errors = run_case("cuda", dtype, 16, LITE, [70, 4, 203, 129, 9], [33, 0, 140, 64, 1],
                      tiles=one)
    assert max(errors) < TOL[dtype], errors
    replay_mla_decode(8, [700, 33, 1000, 5, 256], one)


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_engine_with_graphs_gives_the_torch_backend_tokens(monkeypatch, tmp_path, case):
    """A small DeepSeek (V2-Lite's latent dims, 2 layers, dummy fp32 weights; a V2 and a V3)
    through the Engine: the triton MLA backend with decode and prefill graphs, with the
    overlap schedule and without it (every step's tokens then go through the host), and
    eagerly, gives the greedy tokens of the torch MLA backend. The graph runs without the
    overlap schedule hold model_runner.copy_to_host to its contract: its event is recorded
    after the copies of the sampled tokens, so the host never reads a step's tokens early."""
    from moeserve.runtime.cuda_graph import DecodeGraphRunner
    from moeserve.runtime.engine import Engine
    from moeserve.runtime.prefill_graph import PrefillGraphRunner

    write_config(tmp_path, case)
    buckets = spy(monkeypatch, DecodeGraphRunner, "replay", lambda self, batch, bs: bs)
    sizes = spy(monkeypatch, PrefillGraphRunner, "replay", lambda self, fb, size: size)
    prompts, params = greedy_requests()
    results = {}
    for backend, graphs, overlap in (("torch", False, True), ("triton", True, True),
                                     ("triton", True, False), ("triton", False, True)):
        buckets.clear()
        sizes.clear()
        with Engine(str(tmp_path), attention_backend=backend, disable_cuda_graph=not graphs,
                    disable_piecewise_cuda_graph=not graphs,
                    **dict(ENGINE_FLAGS, disable_overlap_schedule=not overlap)) as engine:
            out = engine.generate(input_ids=prompts, sampling_params=params)
        assert all(o["error"] is None for o in out), out
        results[backend, graphs, overlap] = [o["token_ids"] for o in out]
        assert bool(buckets) == graphs and bool(sizes) == graphs, (buckets, sizes)
    reference = results.pop(("torch", False, True))
    assert [len(t) for t in reference] == [p["max_new_tokens"] for p in params]
    assert all(tokens == reference for tokens in results.values()), results
