"""The fused GPU kernels of the decode path against the torch formulations they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_cases import tiny_spec
from moeserve.layers.backends import create_attention_backend
from moeserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from moeserve.layers.norm import RMSNorm, _rms
from moeserve.layers.rotary import RotaryEmbedding, rotate_half
from moeserve.models.decoder import AttentionOptions, DecoderAttention
from moeserve.moe.router import Router
from moeserve.parallel.groups import single_process_state
from moeserve.batch.forward_batch import ForwardMode, prepare_batch
from moeserve.batch.kv_cache import KVCachePool, ReqToTokenPool
from test_decode_kernels import (check_act_and_mul, check_add_rms_norm, check_rope_head_blocks,
                                check_topk_add_rms_norm,
                                check_rope_store_kv, check_shared_gate_add,
                                check_router_topk, check_skinny_linear, check_topk_softmax,
                                check_unpack_decode_inputs)

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-6}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_rms_norm(device: str, dtype: torch.dtype) -> None:
    from moeserve.kernels.elementwise.fused import rms_norm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 2048, generator=gen).to(device, dtype)
    w = (1 + 0.3 * torch.rand(2048, generator=gen)).to(device, dtype)
    want = _rms(x.float(), x.float().pow(2).mean(-1, keepdim=True), 1e-6, w, dtype)
    assert rel_err(rms_norm(x, w, 1e-6), want) < TOL[dtype]
    qkv = torch.randn(5, 40 * 128, generator=gen).to(device, dtype)  # q heads in a fused row
    q = qkv[:, : 32 * 128].view(5, 32, 128)
    w = (1 + 0.3 * torch.rand(128, generator=gen)).to(device, dtype)
    want = _rms(q.float(), q.float().pow(2).mean(-1, keepdim=True), 1e-6, w, dtype)
    got = rms_norm(q, w, 1e-6)
    assert got.shape == q.shape and rel_err(got, want) < TOL[dtype]


def check_rotary(device: str, dtype: torch.dtype) -> None:
    from moeserve.kernels.elementwise.fused import rotary

    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(128, 1e6, {"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 4096}, 16384)
    pos = torch.randint(0, 16384, (9,), generator=gen).to(device)
    qkv = torch.randn(9, 40 * 128, generator=gen).to(device, dtype)
    q, k = qkv[:, : 32 * 128].view(9, 32, 128), qkv[:, 32 * 128: 36 * 128].view(9, 4, 128)
    cos, sin = rope.cos_sin(pos)
    cos, sin = cos[:, None].double(), sin[:, None].double()
    want_q = q.double() * cos + rotate_half(q.double()) * sin
    want_k = k.double() * cos + rotate_half(k.double()) * sin
    got_q, got_k = rotary(pos, q, k, rope._inv_freq_cpu.to(device), rope.attention_factor)
    assert rel_err(got_q, want_q) < TOL[dtype] and rel_err(got_k, want_k) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_and_rotary(dtype):
    check_rms_norm("cuda", dtype)
    check_rotary("cuda", dtype)


def test_topk_softmax():
    check_topk_softmax("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_router_topk(dtype):
    check_router_topk("cuda", dtype)


@pytest.mark.parametrize("kind,experts,rows", [("qwen2", 60, 700), ("qwen3", 64, 8192)])
def test_router_takes_the_one_launch_where_it_suits(kind, experts, rows):
    """A bf16 router at rows where router_gemm_suits (60 experts from 512 rows, 64 from 8192)
    chooses as the CPU router does (up to rows where two scores lie within the logits'
    rounding), padding rows included."""
    from moe_cases import HF_CONFIGS
    from moeserve.config.spec import spec_from_hf_config
    from moeserve.moe.router import router_gemm_suits

    assert router_gemm_suits(rows, experts) and not router_gemm_suits(rows // 2, 64)
    spec = spec_from_hf_config({**HF_CONFIGS[kind], "num_experts": experts,
                                "num_experts_per_tok": 4}, name=f"{kind}-{experts}")
    router = Router(spec, torch.bfloat16)
    router.weight.data.normal_(0, spec.hidden_size ** -0.5)
    x = torch.randn(rows, spec.hidden_size).bfloat16()
    want_ids, want_w = router(x, rows - 5)
    got_ids, got_w = (t.cpu() for t in router.cuda()(x.cuda(), rows - 5))
    assert (got_ids[rows - 5:] == -1).all() and (got_w[rows - 5:] == 0).all()
    same = (got_ids.sort(1).values == want_ids.sort(1).values).all(1)
    assert int((~same).sum()) <= rows // 50
    order = lambda ids, w: w.gather(1, ids.argsort(1))
    assert rel_err(order(got_ids, got_w)[same], order(want_ids, want_w)[same]) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shared_gate_add(dtype):
    check_shared_gate_add("cuda", dtype)


def test_layers_take_the_fused_path_on_cuda():
    """RMSNorm goes through the kernel on CUDA and gives the CPU module's result."""
    norm = RMSNorm(256, 1e-6, torch.bfloat16)
    norm.weight.data.uniform_(0.7, 1.3)
    x = torch.randn(4, 256).bfloat16()
    cpu = norm(x)
    gpu = norm.cuda()(x.cuda())
    assert rel_err(gpu.cpu(), cpu) < 1e-2


def check_rotary_with_qk_norm(device: str, dtype: torch.dtype) -> None:
    """Qwen3's per-head q/k RMSNorm fused before the rope: the RMSNorm modules, then rope."""
    from moeserve.kernels.elementwise.fused import rotary

    gen = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(128, 1e6, None, 40960)
    pos = torch.randint(0, 40960, (6,), generator=gen).to(device)
    qkv = torch.randn(6, 40 * 128, generator=gen).to(device, dtype)
    q, k = qkv[:, : 32 * 128].view(6, 32, 128), qkv[:, 32 * 128: 36 * 128].view(6, 4, 128)
    norms = [RMSNorm(128, 1e-6, dtype) for _ in range(2)]
    for n in norms:
        n.weight.data = (1 + 0.3 * torch.rand(128, generator=gen)).to(device, dtype)
    qn = _rms(q.float(), q.float().pow(2).mean(-1, keepdim=True), 1e-6, norms[0].weight, dtype)
    kn = _rms(k.float(), k.float().pow(2).mean(-1, keepdim=True), 1e-6, norms[1].weight, dtype)
    cos, sin = rope.cos_sin(pos)
    cos, sin = cos[:, None].double(), sin[:, None].double()
    want_q = qn.double() * cos + rotate_half(qn.double()) * sin
    want_k = kn.double() * cos + rotate_half(kn.double()) * sin
    got_q, got_k = rotary(pos, q, k, rope._inv_freq_cpu.to(device), rope.attention_factor,
                          norms[0].weight, norms[1].weight, 1e-6)
    assert rel_err(got_q, want_q) < TOL[dtype] and rel_err(got_k, want_k) < TOL[dtype]


def check_store_kv(device: str, dtype: torch.dtype) -> None:
    from moeserve.kernels.elementwise.fused import store_kv

    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(3, 2, 50, 4, 16, generator=gen).to(device, dtype)
    want = cache.clone()
    qkv = torch.randn(5, 16 * 16, generator=gen).to(device, dtype)
    k, v = qkv[:, 8 * 16: 12 * 16].view(5, 4, 16), qkv[:, 12 * 16:].view(5, 4, 16)
    loc = torch.tensor([7, 0, 49, 3, 21], device=device)
    assert store_kv(cache[1, 0], cache[1, 1], loc, k, v)
    want[1, 0, loc], want[1, 1, loc] = k, v
    assert torch.equal(cache, want)
    assert not store_kv(cache[1, 0], cache[1, 1], loc, k, v[:, :2])  # a shape it does not take


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qk_norm_rope_and_kv_store(dtype):
    check_rotary_with_qk_norm("cuda", dtype)
    check_store_kv("cuda", dtype)


# --- the decode kernels: skinny linear, add + RMSNorm, rope over head blocks ---------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_kernels(dtype):
    check_skinny_linear("cuda", dtype)
    for n, k in [(5120, 2048), (2048, 4096), (128, 2048), (1536, 2048)]:  # Qwen3-30B-A3B
        check_skinny_linear("cuda", dtype, n=n, k=k, tiles=(None, (32, 128, 8)))
    check_add_rms_norm("cuda", dtype)
    check_add_rms_norm("cuda", dtype, d=2048)
    check_topk_add_rms_norm("cuda", dtype)
    check_topk_add_rms_norm("cuda", dtype, d=2048)
    check_act_and_mul("cuda", dtype)
    check_unpack_decode_inputs("cuda")
    check_rope_head_blocks("cuda", dtype)
    check_rope_head_blocks("cuda", dtype, nq=32, nk=4, d=128, blocks=(1, 2, 8, 32, None))


def test_layers_take_the_decode_kernels_on_cuda():
    """Linear layers and the router go through the skinny kernels up to the table's rows
    (F.linear beyond), the decoder's add + norm through add_rms_norm; all match the torch
    results."""
    from moeserve.kernels.skinny.gemm import skinny_linear
    from moeserve.kernels.skinny.tiles import beats_cublas

    gen = torch.Generator().manual_seed(5)
    axis = single_process_state().attn_tp
    col = ColumnParallelLinear(256, 200, bias=True, axis=axis, dtype=torch.bfloat16).cuda()
    row = RowParallelLinear(200, 256, bias=False, axis=axis, dtype=torch.bfloat16).cuda()
    for layer in (col, row):
        for p in layer.parameters():
            p.data = (torch.randn(p.shape, generator=gen) * 0.1).to("cuda", p.dtype)
        k = layer.weight.shape[1]
        for m in (1, 3, 4, 9, 16, 17):
            x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
            y = layer(x)
            assert rel_err(y, F.linear(x.double(), layer.weight.double(),
                                       None if layer.bias is None else layer.bias.double())) < 1e-2
            if beats_cublas(m, *layer.weight.shape):
                assert torch.equal(y, skinny_linear(x, layer.weight, layer.bias))
    for kind, fp32 in (("deepseek_v3", True), ("qwen3", False)):
        router = Router(tiny_spec(kind), torch.bfloat16).cuda()
        router.weight.data = torch.randn(router.weight.shape, generator=gen).to(
            "cuda", torch.bfloat16)
        for m in (2, 17, 64):  # FMA, then the MMA kernel's rows
            x = torch.randn(m, router.hidden, generator=gen).to("cuda", torch.bfloat16)
            want = (F.linear(x.float(), router.weight.float()) if fp32
                    else F.linear(x, router.weight).float())
            assert rel_err(router.logits(x), want) < (1e-5 if fp32 else 1e-2), (kind, m)
    norm = RMSNorm(2048, 1e-6, torch.bfloat16)
    norm.weight.data.uniform_(0.7, 1.3)
    x, a = torch.randn(3, 2048).bfloat16(), torch.randn(3, 2048).bfloat16()
    cpu_out, cpu_total = norm.add_forward(x, a)
    gpu_out, gpu_total = norm.cuda().add_forward(x.cuda(), a.cuda())
    assert torch.equal(gpu_total.cpu(), cpu_total) and rel_err(gpu_out.cpu(), cpu_out) < 1e-2


# --- the rope that stores K/V into the cache ------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_store_kv_is_rope_then_store_kv(dtype):
    check_rope_store_kv("cuda", dtype)
    check_rope_store_kv("cuda", dtype, nq=32, nk=4, d=128, blocks=(1, 2, 8, 32, None),
                        slots=300)  # Qwen3-30B-A3B's heads


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("qk_norm", ["per_head", "none"])
def test_decoder_attention_same_with_and_without_the_rope_kv_store(monkeypatch, backend,
                                                                  qk_norm):
    """A Qwen3 attention block over prompts, a chunk after a prefix and decode steps: the
    same outputs and the same cache, bit for bit, whether the rope kernel stores K/V (no
    set_kv at all) or PagedAttention.forward does (one set_kv per forward)."""
    import moeserve.layers.attention as attention_mod

    spec, dtype = tiny_spec("qwen3"), torch.bfloat16
    gen = torch.Generator().manual_seed(7)
    rope = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling_dict,
                           spec.max_position_embeddings)
    block = DecoderAttention(spec, single_process_state(), 1, dtype,
                             AttentionOptions(qk_norm=qk_norm), rope,
                             create_attention_backend(backend)).cuda()
    for prm in block.parameters():
        prm.data = (1 + 0.2 * torch.randn(prm.shape, generator=gen) if prm.dim() == 1 else
                    0.1 * torch.randn(prm.shape, generator=gen)).to("cuda", dtype)
    lens, split = [9, 2, 14], [4, 1, 10]
    h = [torch.randn(n, spec.hidden_size, generator=gen).to("cuda", dtype) for n in lens]
    stores = []
    real_set_kv = KVCachePool.set_kv
    monkeypatch.setattr(KVCachePool, "set_kv",
                        lambda self, *a: (stores.append(1), real_set_kv(self, *a))[1])

    def run(fuse: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        monkeypatch.setattr(attention_mod, "FUSE_ROPE_KV_STORE", fuse)
        kv_heads = block.qkv_proj.kv_heads_local
        pool = KVCachePool(2, 64, kv_heads, spec.head_dim, dtype, "cuda")
        pool.kv_LSKD.normal_(generator=torch.Generator("cuda").manual_seed(8))
        rows = ReqToTokenPool(4, 32, "cuda")
        req_rows = [rows.alloc() for _ in lens]
        outs = []
        steps = [(ForwardMode.EXTEND, [0] * 3, split),
                 (ForwardMode.EXTEND, split, [n - 2 for n in lens]),
                 (ForwardMode.DECODE, [n - 2 for n in lens], [n - 1 for n in lens]),
                 (ForwardMode.DECODE, [n - 1 for n in lens], lens)]
        stores.clear()
        for mode, starts, ends in steps:
            new = [list(range(e - s)) for s, e in zip(starts, ends)]
            fb = prepare_batch(mode, new, starts, req_rows, rows, pool)
            x = torch.cat([h[r][s:e] for r, (s, e) in enumerate(zip(starts, ends))])
            outs.append(block(fb.positions, x, fb))
        assert len(stores) == (0 if fuse else len(steps))  # never twice, never skipped
        return outs, pool.kv_LSKD

    fused_outs, fused_cache = run(True)
    outs, cache = run(False)
    assert torch.equal(fused_cache, cache)
    for a, b in zip(fused_outs, outs):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_dense_mlp_and_fp32_router_take_the_gpu_path():
    """A dense MLP on CUDA (its act-and-mul kernel) and DeepSeek's fp32 router logits at more
    rows than the skinny kernel takes (one bf16 GEMM with fp32 sums and output) give the CPU
    modules' results."""
    from moeserve.layers.mlp import DenseMLP

    spec = tiny_spec("deepseek_v2")
    state = single_process_state()
    mlp = DenseMLP(spec, state, torch.bfloat16, tp_size=1)
    mlp.gate_up.weight.data.normal_(0, spec.hidden_size ** -0.5)
    mlp.down.weight.data.normal_(0, mlp.i_local ** -0.5)
    router = Router(spec, torch.bfloat16)
    assert router.fp32_logits
    router.weight.data.normal_(0, spec.hidden_size ** -0.5)
    x = torch.randn(300, spec.hidden_size).bfloat16()
    want_y, want_logits = mlp.partial(x), router.logits(x)
    mlp.cuda(), router.cuda()
    got_logits = router.logits(x.cuda())
    assert got_logits.dtype == torch.float32
    assert rel_err(got_logits.cpu(), want_logits) < 1e-5
    assert rel_err(mlp.partial(x.cuda()).cpu(), want_y) < 1e-2
