"""Programmatic dependent launch (kernels/launch/pdl.py): where it is on, and that a chain of decode
kernels launched with it, captured in a CUDA graph, gives bit for bit what the same chain gives
launched the plain way."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from moeserve.kernels.launch.pdl import pdl_args  # noqa: E402
from moeserve.kernels.launch.choice import KernelSet, select_kernels, use_kernels  # noqa: E402



def test_off_on_the_cpu_and_under_the_flag():
    assert pdl_args(torch.device("cpu")) == {"PDL": False}
    assert not select_kernels(torch.device("cpu")).pdl
    off = KernelSet(device="cuda:0", triton=True, pdl=False, reason="--disable-pdl")
    with use_kernels(off):  # no GPU query when the rank's set says off
        assert pdl_args(torch.device("cuda", 0)) == {"PDL": False}


def _chain(x, r, norm_w, w_qkv, w_router, w13, w2, top_k):
    """add + RMSNorm -> skinny projection -> router logits -> top-k -> expert GEMVs: each
    kernel reads what the one before wrote."""
    from moeserve.kernels.elementwise.fused import add_rms_norm
    from moeserve.kernels.moe.router import topk_softmax
    from moeserve.kernels.skinny.gemm import skinny_linear
    from moeserve.kernels.moe.decode_moe import decode_experts

    h, s = add_rms_norm(x, r, norm_w, 1e-6)
    q = skinny_linear(h, w_qkv, tiles=(16, 128, 4))
    logits = skinny_linear(h, w_router, tiles=(16, 128, 4))
    ids, weights = topk_softmax(logits, top_k, True, 1.0, h.shape[0], h.dtype)
    # down's tiles small enough to be read before its gate (decode_moe.EARLY_TILE_PER_THREAD)
    cfg = {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4},
           "down": {"BLOCK_N": 2, "BLOCK_K": 64, "num_warps": 4}}
    y = decode_experts(h, w13, w2, ids.view(-1), weights.view(-1), top_k, 0, "silu", cfg)
    return q, y, s


def _seeded_sm90(dtype: torch.dtype):
    """(generator, rand(*shape, scale) in dtype) on the GPU, seeded; skips below compute
    capability 9.0, which PDL needs."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)
    return g, rand


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
def test_a_graph_of_pdl_launches_equals_plain_launches(rows):
    _, rand = _seeded_sm90(torch.bfloat16)
    hidden, inter, experts, top_k = 512, 256, 16, 4
    x, r = rand(rows, hidden), rand(rows, hidden)
    weights = (rand(hidden) + 1, rand(1024, hidden, scale=hidden ** -0.5),
               rand(experts, hidden, scale=hidden ** -0.5),
               rand(experts, 2 * inter, hidden, scale=hidden ** -0.5),
               rand(experts, hidden, inter, scale=inter ** -0.5))

    _graph_equals_plain(lambda xx: _chain(xx, r, *weights, top_k), x)


def _graph_equals_plain(chain, x):
    """chain(x) launched plainly, against the same chain with PDL captured in a CUDA graph
    and replayed (its input refilled each time): the same bits."""
    with use_kernels(select_kernels(x.device, pdl=False)):
        plain = chain(x)
    assert pdl_args(x.device)["PDL"]
    static_x = x.clone()
    chain(static_x)  # compile the PDL variants outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static_x)
    for _ in range(3):
        static_x.zero_()  # a replay that read a stale input would not match
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(out, plain):
            assert torch.equal(got, want)


def _fp8_chain(x, w_qkv, w_o, w13, w2, ids, weights):
    """The fp8 kernels of a decode step back to back: quantize -> block GEMM -> quantize ->
    block GEMM -> quantize -> split gate_up GEMV -> quantize -> down GEMV."""
    from moeserve.kernels.fp8.gemm import fp8_linear
    from moeserve.kernels.moe.fused_moe_fp8 import fused_experts_fp8

    q = fp8_linear(x, *w_qkv, (128, 128))
    o = fp8_linear(q[:, : x.shape[1]].contiguous(), *w_o, (128, 128))
    cfg = {"decode": {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4},
                      "down": {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4}}}
    y = fused_experts_fp8(o, None, *w13, *w2, ids, weights, 0, "silu", (128, 128), cfg,
                          torch.bfloat16)
    return q, o, y


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
def test_a_graph_of_pdl_fp8_launches_equals_plain_launches(rows):
    from moeserve.kernels.fp8 import reference as R

    g, rand = _seeded_sm90(torch.float32)
    hidden, inter, experts, top_k = 512, 256, 16, 4
    x = rand(rows, hidden).to(torch.bfloat16)
    block = (128, 128)
    ws = (R.quantize_blocks(rand(1024, hidden, scale=hidden ** -0.5), block),
          R.quantize_blocks(rand(hidden, hidden, scale=hidden ** -0.5), block),
          R.quantize_blocks(rand(experts, 2 * inter, hidden, scale=hidden ** -0.5), block),
          R.quantize_blocks(rand(experts, hidden, inter, scale=inter ** -0.5), block))
    ids = torch.rand(rows, experts, generator=g, device="cuda").topk(top_k, 1).indices
    weights = torch.rand(rows, top_k, generator=g, device="cuda")
    _graph_equals_plain(lambda xx: _fp8_chain(xx, *ws, ids.to(torch.int32), weights), x)


def test_cuda_versions_read_as_the_driver_numbers_them():
    from moeserve.kernels.launch.choice import _as_int

    assert _as_int("12.4") == 12040 and _as_int("13.0") == 13000 and _as_int("12") == 12000
    assert _as_int(None) == 0 and _as_int("12.2") < 12030 <= _as_int("12.3")
