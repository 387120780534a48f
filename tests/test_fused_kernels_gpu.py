"""The fused GPU kernels of the decode path against the torch formulations they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_cases import tiny_spec
from moeserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from moeserve.layers.norm import RMSNorm, _rms
from moeserve.layers.rotary import RotaryEmbedding, rotate_half
from moeserve.moe.router import Router, RoutingConfig, select_experts
from moeserve.parallel.groups import single_process_state
from test_decode_kernels import check_add_rms_norm, check_rope_head_blocks, check_skinny_linear

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-6}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_rms_norm(device: str, dtype: torch.dtype) -> None:
    from moeserve.layers.fused_kernels import rms_norm

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
    from moeserve.layers.fused_kernels import rotary

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


def check_topk_softmax(device: str) -> None:
    from moeserve.layers.fused_kernels import topk_softmax

    gen = torch.Generator().manual_seed(2)
    for e, k, renorm, scale in [(128, 8, True, 1.0), (60, 4, False, 2.5), (8, 2, True, 1.0)]:
        cfg = RoutingConfig(e, k, "softmax", "greedy", 1, 1, renorm, scale)
        logits = torch.randn(11, e, generator=gen).to(device)
        want_ids, want_w = select_experts(logits, cfg, None, num_valid=9)
        ids, w = topk_softmax(logits, k, renorm, scale, 9)
        assert (ids[9:] == -1).all() and (w[9:] == 0).all()
        for r in range(9):  # same set of experts, same weight for each
            got = dict(zip(ids[r].tolist(), w[r].tolist()))
            ref = dict(zip(want_ids[r].tolist(), want_w[r].tolist()))
            assert got.keys() == ref.keys()
            assert max(abs(got[i] - ref[i]) for i in ref) < 1e-6
        ids, w16 = topk_softmax(logits, k, renorm, scale, 11, torch.bfloat16)
        assert torch.equal(w16, w16.bfloat16().float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_and_rotary(dtype):
    check_rms_norm("cuda", dtype)
    check_rotary("cuda", dtype)


def test_topk_softmax():
    check_topk_softmax("cuda")


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
    from moeserve.layers.fused_kernels import rotary

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
    from moeserve.layers.fused_kernels import store_kv

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
    check_rope_head_blocks("cuda", dtype)
    check_rope_head_blocks("cuda", dtype, nq=32, nk=4, d=128, blocks=(1, 2, 8, 32, None))


def test_layers_take_the_decode_kernels_on_cuda():
    """Linear layers and the router go through the skinny kernel up to 4 rows (F.linear
    beyond), the decoder's add + norm through add_rms_norm; all match the torch results."""
    from moeserve.layers.skinny_gemm import skinny_linear

    gen = torch.Generator().manual_seed(5)
    axis = single_process_state().attn_tp
    col = ColumnParallelLinear(256, 200, bias=True, axis=axis, dtype=torch.bfloat16).cuda()
    row = RowParallelLinear(200, 256, bias=False, axis=axis, dtype=torch.bfloat16).cuda()
    for layer in (col, row):
        for p in layer.parameters():
            p.data = (torch.randn(p.shape, generator=gen) * 0.1).to("cuda", p.dtype)
        k = layer.weight.shape[1]
        for m in (1, 3, 4, 9):
            x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
            y = layer(x)
            assert rel_err(y, F.linear(x.double(), layer.weight.double(),
                                       None if layer.bias is None else layer.bias.double())) < 1e-2
            if m <= 4:
                assert torch.equal(y, skinny_linear(x, layer.weight, layer.bias))
    for kind, fp32 in (("deepseek_v3", True), ("qwen3", False)):
        router = Router(tiny_spec(kind), torch.bfloat16).cuda()
        router.weight.data = torch.randn(router.weight.shape, generator=gen).to(
            "cuda", torch.bfloat16)
        x = torch.randn(2, router.hidden, generator=gen).to("cuda", torch.bfloat16)
        want = (F.linear(x.float(), router.weight.float()) if fp32
                else F.linear(x, router.weight).float())
        assert rel_err(router.logits(x), want) < (1e-5 if fp32 else 1e-2)
    norm = RMSNorm(2048, 1e-6, torch.bfloat16)
    norm.weight.data.uniform_(0.7, 1.3)
    x, a = torch.randn(3, 2048).bfloat16(), torch.randn(3, 2048).bfloat16()
    cpu_out, cpu_total = norm.add_forward(x, a)
    gpu_out, gpu_total = norm.cuda().add_forward(x.cuda(), a.cuda())
    assert torch.equal(gpu_total.cpu(), cpu_total) and rel_err(gpu_out.cpu(), cpu_out) < 1e-2
