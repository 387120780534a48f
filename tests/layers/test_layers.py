"""Single-process tests of the layers: norms, rotary, paged attention, KV cache, linear loading."""

from __future__ import annotations

import math

import pytest
import torch

from moeserve.layers.attention import PagedAttention
from moeserve.layers.backends import create_attention_backend
from moeserve.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                    QKVParallelLinear, RowParallelLinear)
from moeserve.layers.norm import RMSNorm, ShardedRMSNorm
from moeserve.layers.rotary import RopeScalingError, RotaryEmbedding, rope_frequencies
from moeserve.layers.weights import WeightError
from moeserve.parallel.groups import single_process_state
from moeserve.batch.forward_batch import ForwardMode, prepare_batch
from moeserve.batch.kv_cache import DUMMY_SLOT, KVCachePool, ReqToTokenPool

ONE = single_process_state().attn_tp
F32 = torch.float32


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


# --- norms --------------------------------------------------------------------------------

def test_rms_norm_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    torch.manual_seed(0)
    x = torch.randn(5, 3, 24)
    ours, ref = RMSNorm(24, 1e-6, F32), Qwen3MoeRMSNorm(24, eps=1e-6)
    w = torch.rand(24) + 0.5
    ours.load_weight("weight", w)
    ref.weight.data.copy_(w)
    assert rel_err(ours(x), ref(x)) < 1e-6


def test_sharded_norm_on_one_rank_is_rms_norm():
    torch.manual_seed(1)
    x, w = torch.randn(7, 32), torch.rand(32) + 0.5
    full, sharded = RMSNorm(32, 1e-5, F32), ShardedRMSNorm(32, 32, 0, 1, 1e-5, ONE, F32)
    full.load_weight("weight", w)
    sharded.load_weight("weight", w)
    assert rel_err(sharded(x), full(x)) < 1e-6


# --- rotary -------------------------------------------------------------------------------

ROPE_CASES = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
]


@pytest.mark.parametrize("scaling", ROPE_CASES)
def test_rope_frequencies_match_transformers(scaling):
    from transformers import Qwen3MoeConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta, max_pos = 32, 1_000_000.0, 2048
    params = {"rope_theta": theta, "rope_type": "default", **(scaling or {})}
    params["rope_type"] = params.pop("type", params["rope_type"])
    cfg = Qwen3MoeConfig(hidden_size=64, num_attention_heads=2, head_dim=head_dim,
                         max_position_embeddings=max_pos, rope_parameters=params)
    inv_freq, factor = rope_frequencies(head_dim, theta, scaling, max_pos)
    if scaling is None:
        ref = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        ref_factor = 1.0
    else:
        ref, ref_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    assert torch.allclose(inv_freq, ref, rtol=1e-6, atol=0)
    assert math.isclose(factor, ref_factor, rel_tol=1e-9)


def test_rotary_apply_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

    torch.manual_seed(2)
    rope = RotaryEmbedding(16, 10000.0, {"rope_type": "yarn", "factor": 2.0,
                                         "original_max_position_embeddings": 64}, 128)
    pos = torch.tensor([0, 5, 17, 100])
    q, k = torch.randn(4, 3, 16), torch.randn(4, 1, 16)
    cos, sin = rope.cos_sin(pos)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        cos[None], sin[None])
    got_q, got_k = rope(pos, q, k)
    assert rel_err(got_q, ref_q[0].transpose(0, 1)) < 1e-6
    assert rel_err(got_k, ref_k[0].transpose(0, 1)) < 1e-6


def test_unsupported_rope_type_is_refused():
    with pytest.raises(RopeScalingError, match="dynamic.*supports default, linear"):
        rope_frequencies(16, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 128)


# --- KV cache -----------------------------------------------------------------------------

def test_kv_pool_pages_and_dummy_slot():
    pool = KVCachePool(1, 20, 1, 2, F32, page_size=4)  # 5 pages, page 0 reserved
    assert pool.available_slots == 16
    a = pool.alloc(5)  # two fresh pages
    assert a.tolist() == [4, 5, 6, 7, 8]
    b = pool.alloc_after(8, 4)  # rest of page 2, then a new page
    assert b.tolist() == [9, 10, 11, 12]
    assert pool.available_slots == 4
    assert pool.alloc(5) is None  # one page left, and a failed alloc takes nothing
    assert pool.available_slots == 4
    pool.free(torch.cat([a, b]))
    assert pool.available_slots == 16
    seen = torch.cat([pool.alloc(4) for _ in range(4)])
    assert DUMMY_SLOT not in seen.tolist() and len(set(seen.tolist())) == 16
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(seen[:4])
        pool.free(seen[:4])


@pytest.mark.parametrize("page_size", [1, 4])
def test_kv_pool_hands_out_the_lowest_free_pages_like_a_sorted_set(page_size):
    """Random allocations (fresh and continued) and frees against a model of the free pages
    as a sorted set: the same slots, lowest pages first, whether they were never handed out
    or given back."""
    import random
    rng = random.Random(page_size)
    pages = 40
    pool = KVCachePool(1, pages * page_size, 1, 2, F32, page_size=page_size)
    free = set(range(1, pages))  # the model: page 0 is the dummy's
    held: list[list[int]] = []
    for _ in range(300):
        if held and rng.random() < 0.4:
            slots = held.pop(rng.randrange(len(held)))
            pool.free(slots)
            free |= {s // page_size for s in slots}
        else:
            last = held[-1][-1] if held and rng.random() < 0.3 else None
            n = rng.randint(0, 3 * page_size + 1)
            tail = [] if last is None else list(range(last + 1, min(
                (last // page_size + 1) * page_size, last + 1 + n)))
            need = -(-(n - len(tail)) // page_size)
            got = pool.alloc_after(last, n)
            if need > len(free):
                assert got is None
                continue
            take = sorted(free)[:need]
            free -= set(take)
            want = tail + [p * page_size + i for p in take for i in range(page_size)]
            assert got.tolist() == want[:n]
            if last is not None:
                held[-1] += got.tolist()
            elif n:
                held.append(got.tolist())
        assert pool.available_slots == len(free) * page_size


def test_req_to_token_pool_reserves_the_dummy_row():
    rows = ReqToTokenPool(3, 8)
    got = {rows.alloc(), rows.alloc()}
    assert got == {1, 2} and rows.alloc() is None
    rows.free(1)
    assert rows.alloc() == 1


# --- paged attention ----------------------------------------------------------------------

def dense_attention(q, k, v, scaling, window=None):
    """q [S, N, D], k/v [S, K, D] of one whole sequence: causal GQA in fp64."""
    n, kh = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(n // kh, dim=1)
    v = v.double().repeat_interleave(n // kh, dim=1)
    s = torch.einsum("qnd,knd->nqk", q.double(), k) * scaling
    i = torch.arange(q.shape[0])
    mask = i[None, :] <= i[:, None]
    if window is not None:
        mask &= i[None, :] > i[:, None] - window
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    return torch.einsum("nqk,knd->qnd", p, v)


@pytest.mark.parametrize("page_size,window", [(1, None), (4, None), (2, 3)])
def test_paged_attention_extend_with_prefix_then_decode(page_size, window):
    torch.manual_seed(3)
    n, kh, d, layers = 6, 2, 8, 2
    lens = [7, 1, 12]  # whole sequence length of each request
    split = [3, 0, 9]  # tokens in the first (prefix) forward
    seqs = [(torch.randn(s, n, d), torch.randn(s, kh, d), torch.randn(s, kh, d)) for s in lens]
    pool = KVCachePool(layers, 64, kh, d, F32, page_size=page_size)
    rows = ReqToTokenPool(4, 32)
    req_rows = [rows.alloc() for _ in lens]
    attn = PagedAttention(1, n, kh, d, d ** -0.5, create_attention_backend("torch"), window)
    refs = [dense_attention(q, k, v, d ** -0.5, window) for q, k, v in seqs]

    def run(mode, starts, ends):
        new = [list(range(e - s)) for s, e in zip(starts, ends)]
        fb = prepare_batch(mode, new, starts, req_rows, rows, pool)
        cat = lambda i: torch.cat([seqs[r][i][s:e] for r, (s, e) in enumerate(zip(starts, ends))])
        out = attn(cat(0), cat(1), cat(2), fb)
        ref = torch.cat([refs[r][s:e] for r, (s, e) in enumerate(zip(starts, ends))])
        assert rel_err(out.double(), ref) < 1e-6

    run(ForwardMode.EXTEND, [0, 0, 0], split)  # prompts (one empty chunk)
    run(ForwardMode.EXTEND, split, [s - 1 for s in lens])  # chunks after a cached prefix
    run(ForwardMode.DECODE, [s - 1 for s in lens], lens)  # one decode step each


# --- linear layers on one rank --------------------------------------------------------------

def test_linear_layers_load_and_compute():
    torch.manual_seed(4)
    x = torch.randn(5, 12)
    w, b = torch.randn(10, 12), torch.randn(10)
    col = ColumnParallelLinear(12, 10, bias=True, axis=ONE, dtype=F32)
    col.load_weight("weight", w)
    col.load_weight("bias", b)
    assert rel_err(col(x), x @ w.T + b) < 1e-6
    row = RowParallelLinear(12, 10, bias=True, axis=ONE, dtype=F32)
    row.load_weight("weight", w)
    row.load_weight("bias", b)
    assert rel_err(row(x), x @ w.T + b) < 1e-6
    g, u = torch.randn(6, 12), torch.randn(6, 12)
    merged = MergedColumnParallelLinear(12, [6, 6], bias=False, axis=ONE, dtype=F32)
    merged.load_weight("weight", u, 1)
    merged.load_weight("weight", g, 0)
    assert rel_err(merged(x), x @ torch.cat([g, u]).T) < 1e-6
    wq, wk, wv = torch.randn(12, 12), torch.randn(4, 12), torch.randn(4, 12)
    qkv = QKVParallelLinear(12, 4, 3, 1, bias=False, axis=ONE, dtype=F32)
    for shard, t in zip("qkv", (wq, wk, wv)):
        qkv.load_weight("weight", t, shard)
    for got, ref in zip(qkv(x), (x @ wq.T, x @ wk.T, x @ wv.T)):
        assert rel_err(got, ref) < 1e-6
    with pytest.raises(WeightError, match=r"'q_proj.weight' has shape \[4, 12\], "
                                          r"expected \[12, 12\]"):
        qkv.load_weight("weight", wk, "q")
