"""The "triton" latent attention kernels (kernels/mla/kernels.py) on the CPU under Triton's
interpreter, against the torch MLA backend, in fp32: the cases of tests/layers/test_mla_gpu.py
(prompts, a chunk after a prefix, decode steps; paged and not; heads below and past one
program's 16, rope dims below a tl.dot's 16; a decode batch of one split, which writes its
output without the combine; decode partials in planned buffers that clamp the splits); the
backend sending its long requests through SDPA (allowed on the CPU for the test) and the
others through the kernel in the same step; the prep kernel (latent norm, rope, cache store)
against MLAttention's torch formulation; and the GEMVs of kv_b_proj's two halves against
torch.bmm."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from interpreter import run_interpreted

SCRIPT = r"""
import torch
from test_mla_gpu import run_case
cases = [(torch.float32, 16, (4, 16, 8, 8, 8), [20, 37], [10, 20]),
         # prefixes past a key block: the unmasked key blocks before the diagonal; 20 heads
         (torch.float32, 1, (20, 32, 4, 8, 12), [90, 9], [70, 1]),
         # 9 requests of one head block fill the interpreter's 8 "SMs": one split, the
         # decode kernel writes the output itself (DIRECT), no combine
         (torch.float32, 16, (4, 16, 8, 8, 8), [9, 6, 12, 5, 7, 4, 10, 6, 8],
          [5, 2, 8, 1, 3, 0, 6, 4, 2])]
import dataclasses
from moeserve.kernels.attention.tiles import ATTENTION_TILES
MLA_WHOLE_FROM, decode_num_splits = (ATTENTION_TILES.mla_whole_from,
                                     ATTENTION_TILES.decode_num_splits)
assert decode_num_splits(9, 1, 8, MLA_WHOLE_FROM) == 1
assert decode_num_splits(2, 1, 8, MLA_WHOLE_FROM) > 1
for case in cases:
    errors = run_case("cpu", *case)
    assert max(errors) < 1e-5, (case, errors)
# the decode partials from planned buffers (the model runner's): 2 requests of one head
# block take 8 splits on 8 "SMs"; 5 slots clamp them to 2, 1 slot to one split
assert decode_num_splits(2, 1, 8, MLA_WHOLE_FROM) == 8
for slots, splits in ((5, 2), (1, 1)):
    o, lse = torch.full((slots, 4, 16), float("nan")), torch.full((slots, 4), float("nan"))
    errors = run_case("cpu", torch.float32, 16, (4, 16, 8, 8, 8), [20, 37], [10, 20],
                      partials=(o, lse))
    assert max(errors) < 1e-5, (slots, errors)
    # the steps wrote their partials there; one split writes the output itself, none
    assert o.isnan().all() == (splits == 1) and lse.isnan().all() == (splits == 1)
# the backend's own choice per request: SDPA (allowed on the CPU here) for the long ones,
# fresh and after a prefix, the kernel for the others of the same step
import moeserve.layers.mla_triton as MT
takes, MT._sdpa_takes = MT._sdpa_takes, lambda *a: True
calls, real = [], MT.mla_sdpa
MT.mla_sdpa = lambda *a: (calls.append(a[4]), real(*a))[1]
errors = run_case("cpu", torch.float32, 16, (4, 16, 8, 8, 8), [70, 4, 90, 9], [33, 0, 40, 1],
                  tiles=dataclasses.replace(ATTENTION_TILES, mla_sdpa_min_extend=30))
assert max(errors) < 1e-5, errors
assert calls == [[(0, 0, 33, 0), (2, 33, 40, 0)], [(0, 0, 34, 33), (2, 35, 47, 40)]], calls
MT._sdpa_takes, MT.mla_sdpa = takes, real
from test_mla_gpu import head_gemv_errors, prep_errors
errors = head_gemv_errors("cpu", torch.float32)
assert max(errors) < 1e-5, errors
for interleaved in (True, False):
    errors = prep_errors("cpu", torch.float32, interleaved)
    assert max(errors) < 1e-6, (interleaved, errors)
print("interpreter ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_mla_under_the_interpreter():
    run_interpreted(SCRIPT)


def test_expanded_form_through_sdpa_matches_torch_on_the_cpu():
    """mla_triton.mla_sdpa (rows expanded through kv_b_proj, SDPA on zero-padded head dims;
    fresh prompts padded to the bucket, chunks after a prefix under a mask aligned to the last
    key) equals the torch MLA backend; fp32 on the CPU, where SDPA runs its math kernel."""
    import torch

    from moeserve.kernels.attention.tiles import ATTENTION_TILES
    from moeserve.layers.mla_triton import mla_sdpa, sdpa_slots
    from moeserve.batch.forward_batch import ForwardMode, prepare_batch
    from moeserve.batch.kv_cache import MLAKVCachePool, ReqToTokenPool
    from test_mla_gpu import backends, fake_layer, rel_err

    # 5 and 37 tokens run padded to 16 and 48
    padded = dataclasses.replace(ATTENTION_TILES, sdpa_bucket=16).sdpa_length
    for n, c, r, p, v in ((4, 16, 8, 8, 8), (3, 32, 4, 8, 16)):
        gen = torch.Generator().manual_seed(n)
        layer = fake_layer(n, c, r, p, v, torch.float32, "cpu", gen, layer_id=0)
        pool = MLAKVCachePool(1, 128, c, r, torch.float32, "cpu")
        pool.kv_LSW.normal_(generator=gen)
        rows = ReqToTokenPool(3, 64, "cpu")
        req_rows = [rows.alloc(), rows.alloc()]
        w = layer.kv_b_proj.weight.view(n, p + v, c)
        # fresh prompts of 5 and 37 tokens, then 9 and 20 more after them
        for news, prefixes, reqs in (([5, 37], [0, 0], [(0, 0, 5, 0), (1, 5, 37, 0)]),
                                     ([9, 20], [5, 37], [(0, 0, 9, 5), (1, 9, 20, 37)])):
            fb = prepare_batch(ForwardMode.EXTEND, [[0] * k for k in news], prefixes,
                               req_rows, rows, pool)
            q = torch.randn(sum(news), n, p + r, generator=gen)
            got = torch.full((sum(news), n, v), float("nan"))
            mla_sdpa(q, pool.latent_cache(0), sdpa_slots(fb, reqs, padded), w, reqs,
                     layer.scaling, got)
            want = backends()[1].forward(q, layer, fb)
            assert rel_err(got, want) < 1e-5, (news, prefixes)
