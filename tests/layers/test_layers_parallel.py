"""The tensor-parallel layers on 2 gloo ranks (one spawned world, several checks): each rank's
shard, combined as the communicator would, equals the single-rank layer."""

from __future__ import annotations

import pytest
import torch

from moeserve.testing.multiproc import run_ranks

pytestmark = pytest.mark.multiproc


def _check_layers(rank: int, world: int) -> str:
    import torch.distributed as dist

    from moeserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from moeserve.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                        QKVParallelLinear, RowParallelLinear, axis_all_gather)
    from moeserve.layers.norm import RMSNorm, ShardedRMSNorm
    from moeserve.parallel.groups import init_parallel_state
    from moeserve.parallel.layout import ParallelLayout

    state = init_parallel_state(ParallelLayout(tp=world, dp=1, ep=1, dense_tp=world, a2a=False))
    axis, f32 = state.attn_tp, torch.float32
    torch.manual_seed(0)  # every rank draws the same full tensors
    x, hidden = torch.randn(5, 12), 12

    def close(a, b, what):
        err = float((a - b).norm() / b.norm())
        assert err < 1e-6, f"rank {rank}: {what} rel err {err}"

    # column then row parallel: the all-reduced partial sums are the full product
    w1, w2, b2 = torch.randn(8, 12), torch.randn(12, 8), torch.randn(12)
    col = ColumnParallelLinear(12, 8, bias=False, axis=axis, dtype=f32)
    row = RowParallelLinear(8, 12, bias=True, axis=axis, dtype=f32)
    col.load_weight("weight", w1)
    row.load_weight("weight", w2)
    row.load_weight("bias", b2)
    y = row(col(x))
    dist.all_reduce(y, group=axis.group)
    close(y, x @ w1.T @ w2.T + b2, "column+row")

    g, u = torch.randn(6, 12), torch.randn(6, 12)
    merged = MergedColumnParallelLinear(12, [6, 6], bias=False, axis=axis, dtype=f32)
    merged.load_weight("weight", g, 0)
    merged.load_weight("weight", u, 1)
    gate, up = merged(x).split(3, dim=-1)
    close(axis_all_gather(gate, axis), x @ g.T, "merged gate")
    close(axis_all_gather(up, axis), x @ u.T, "merged up")
    # a split shard beside a replicated one (latent attention's q heads and kv_a), with a
    # bias only the replicated shard's checkpoint has
    kv, kv_b = torch.randn(5, 12), torch.randn(5)
    mixed = MergedColumnParallelLinear(12, [6, 5], bias=True, axis=axis, dtype=f32,
                                       replicated=(False, True))
    mixed.load_weight("weight", g, 0)
    mixed.load_weight("weight", kv, 1)
    mixed.load_weight("bias", kv_b, 1)
    q_part, kv_part = mixed.split(mixed(x))
    assert mixed.out_locals == (3, 5)
    close(axis_all_gather(q_part, axis), x @ g.T, "merged split shard, no bias")
    close(kv_part, x @ kv.T + kv_b, "merged replicated shard")

    # QKV with one KV head replicated on both ranks, and OLMoE's q/k norm over the full width
    d = 4
    wq, wk, wv = torch.randn(4 * d, hidden), torch.randn(d, hidden), torch.randn(d, hidden)
    qkv = QKVParallelLinear(hidden, d, 4, 1, bias=False, axis=axis, dtype=f32)
    for shard, t in zip("qkv", (wq, wk, wv)):
        qkv.load_weight("weight", t, shard)
    assert qkv.kv_replicas == 2 and qkv.kv_heads_local == 1
    q, k, v = qkv(x)
    close(axis_all_gather(q, axis), x @ wq.T, "q heads")
    close(k, x @ wk.T, "replicated k")
    close(v, x @ wv.T, "replicated v")
    nq, nk = torch.rand(4 * d) + 0.5, torch.rand(d) + 0.5
    q_norm = ShardedRMSNorm(4 * d, qkv.q_size, rank * qkv.q_size, 1, 1e-6, axis, f32)
    k_norm = ShardedRMSNorm(d, qkv.kv_size, qkv.kv_head_start * d, qkv.kv_replicas, 1e-6,
                            axis, f32)
    q_norm.load_weight("weight", nq)
    k_norm.load_weight("weight", nk)
    full_q, full_k = RMSNorm(4 * d, 1e-6, f32), RMSNorm(d, 1e-6, f32)
    full_q.load_weight("weight", nq)
    full_k.load_weight("weight", nk)
    close(axis_all_gather(q_norm(q), axis), full_q(x @ wq.T), "sharded q norm")
    close(k_norm(k), full_k(x @ wk.T), "replicated k norm")

    # vocab-parallel embedding and LM head, 11 tokens over 2 ranks (one padding row)
    table = torch.randn(11, hidden)
    emb = VocabParallelEmbedding(11, hidden, axis=axis, dtype=f32)
    emb.load_weight("weight", table)
    ids = torch.tensor([0, 10, 5, 6, 3, 10])
    close(emb(ids), table[ids], "embedding")
    head = ParallelLMHead(11, hidden, axis=axis, dtype=f32)
    head.load_weight("weight", table)
    close(head(x), x @ table.T, "lm head")
    tied = ParallelLMHead(11, hidden, axis=axis, dtype=f32, tied_to=emb)
    close(tied(x), x @ table.T, "tied lm head")
    return "ok"


def test_parallel_layers_on_two_ranks():
    assert run_ranks(_check_layers, 2, timeout=120) == ["ok", "ok"]
