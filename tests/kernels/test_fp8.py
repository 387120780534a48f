"""Block-scaled FP8: the quantizers' round trip, the torch W8A8 product against a block-by-block
loop of fp8 dots, and the Triton quantizer and GEMM against the torch formulation, under
Triton's interpreter (fp8 loads, stores and dots run there) and on a GPU."""

from __future__ import annotations

import pytest
import torch

from interpreter import run_interpreted
from moeserve.kernels.fp8 import reference as R

torch.set_num_threads(1)


@pytest.mark.parametrize("shape, block", [((48, 80), (16, 16)), ((3, 40, 70), (16, 32)),
                                          ((256, 384), (128, 128))])
def test_quantizer_round_trip(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3
    w[..., :5, :7] = 0  # an all-zero corner keeps a finite scale and zeros
    q, scale = R.quantize_blocks(w, block)
    n, k = shape[-2:]
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.shape == (*shape[:-2], -(-n // block[0]), -(-k // block[1]))
    full = R.expand_scale(scale, (n, k), block)
    # each block's largest value maps to +-448 exactly
    assert torch.allclose(q.float().abs().amax(), torch.tensor(448.0))
    back = R.dequantize_blocks(q, scale, block)
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of a normal value; subnormals 2^-10
    bound = torch.maximum(w.abs() * 2 ** -4, full * 2 ** -10)
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    assert (back[..., :5, :7] == 0).all()
    q2, scale2 = R.quantize_blocks(back, block)  # quantizing what it gives changes nothing
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.allclose(scale2, scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rows", [0, 3])
def test_activation_groups_of_any_rows_are_row_major(rows):
    """A rank with no rows (DP attention) quantizes to empty row-major tensors, which the
    dispatchers pack as bytes."""
    q, scale = R.quantize_groups(torch.randn(rows, 300), 128)
    assert q.shape == (rows, 300) and scale.shape == (rows, 3)
    assert q.stride() == (300, 1) and scale.stride() == (3, 1)
    assert scale.view(torch.uint8).shape == (rows, 12)


def test_activation_groups_are_per_token():
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    x[2] *= 1000  # one loud token does not change the others' scales
    q, s = R.quantize_groups(x, 16)
    assert s.shape == (6, 4)
    q_alone, s_alone = R.quantize_groups(x[3:4], 16)
    assert torch.equal(s[3:4], s_alone) and torch.equal(q[3:4].float(), q_alone.float())
    back = R.dequantize_groups(q, s, 16)
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + s.repeat_interleave(16, 1)[:, :50] * 2 ** -10).all()


def test_w8a8_equals_block_by_block_fp8_dots():
    """y[t, n] = sum over K blocks b of xs[t, b] ws[n // bn, b] (xq[t, b] . wq[n, b]),
    computed the long way in float64."""
    gen = torch.Generator().manual_seed(3)
    block = (16, 32)
    x, w = torch.randn(5, 70, generator=gen), torch.randn(40, 70, generator=gen)
    wq, ws = R.quantize_blocks(w, block)
    xq, xs = R.quantize_groups(x, block[1])
    want = torch.zeros(5, 40, dtype=torch.float64)
    for b in range(xs.shape[1]):
        cols = slice(b * 32, (b + 1) * 32)
        dots = xq[:, cols].double() @ wq[:, cols].double().T
        want += dots * xs[:, b, None].double() * ws[torch.arange(40) // 16, b][None, :].double()
    got = R.fp8_linear(x, wq, ws, block)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    # and the activation quantization costs a few percent against the float product
    exact = x @ R.dequantize_blocks(wq, ws, block).T
    assert 1e-4 < float((got - exact).norm() / exact.norm()) < 0.05


KERNEL_SCRIPT = r"""
import torch
from moeserve.kernels.fp8 import gemm, reference as R
from moeserve.kernels.fp8.tiles import GemmTiles
torch.manual_seed(0)
dev = "{device}"
# 37 rows: a program a row and group; 150: tiles of rows, the last one partly empty
for rows, k, group in ((37, 80, 16), (37, 300, 128), (150, 300, 128)):
    x = (torch.randn(rows, k) * 5).to(dev)
    x[3, :group] = 0
    q, s = gemm.quantize_groups(x, group)
    qr, sr = R.quantize_groups(x, group)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)), "quantizer bits"
    assert torch.equal(s, sr), "quantizer scales"
# a GPU's fp8 dot takes K >= 32: the small blocks are 16 wide on the interpreter only
small = (16, 16) if dev == "cpu" else (32, 32)
for (n, k, block) in (((48, 80, small)), ((200, 300, (128, 128)))):
    w = torch.randn(n, k, device=dev)
    wq, ws = R.quantize_blocks(w, block)
    bias, res = torch.randn(n, device=dev), torch.randn(9, n, device=dev)
    for m in (1, 2, 9, 70, 130):  # up to 8 rows: swapped tiles
        xx = torch.randn(m, k, device=dev)
        ref = R.fp8_linear(xx, wq, ws, block)
        got = gemm.fp8_linear(xx, wq, ws, block)
        err = float((got - ref).norm() / ref.norm())
        # a GPU's fp8 MMA accumulates in fewer bits than float32 (H200, narrowed column
        # tiles: 4.4e-5 at K 80, 1.2e-4 at K 300), far below W8A8's own error (~3e-2)
        assert err < (1e-5 if dev == "cpu" else 1e-3), (n, k, m, err)
        if dev == "cuda":  # bf16 activations, as the engine runs them
            got = gemm.fp8_linear(xx.bfloat16(), wq, ws, block).float()
            ref = R.fp8_linear(xx.bfloat16(), wq, ws, block).float()
            assert float((got - ref).norm() / ref.norm()) < 1e-2
    for rows in (1, 9):  # the epilogue of swapped tiles and of the others
        got = gemm.fp8_linear(xx[:rows], wq, ws, block, bias, res[:rows])
        ref = R.fp8_linear(xx[:rows], wq, ws, block, bias) + res[:rows]
        err = float((got - ref).norm() / ref.norm())
        assert err < (1e-5 if dev == "cpu" else 1e-3), (rows, err)
# K split into parts (a GPU's decode tiles): each part stores its partial, the tile's last
# part sums them and adds bias and residual; 5 groups of K in 2 and 4 parts (the last part
# short, then empty), 20 rows in two row tiles; twice, as the tiles' counters carry over
k = 5 * small[1]
w = torch.randn(96, k, device=dev)
wq, ws = R.quantize_blocks(w, small)
xx, bias = torch.randn(20, k, device=dev), torch.randn(96, device=dev)
res = torch.randn(20, 96, device=dev)
xq, xs = gemm.quantize_groups(xx, small[1])
ref = R.fp8_linear(xx, wq, ws, small, bias) + res
# both tile orientations: rows x weight^T, and the weight's 64 rows as the MMA's M side
for split, swap in ((2, False), (4, False), (2, False), (2, True), (4, True), (2, True)):
    tiles = GemmTiles(16, 64 if swap else 32, 2, split, swap)
    got = gemm.block_gemm(xq, xs, wq, ws, small, torch.float32, bias, res, tiles=tiles)
    assert float((got - ref).norm() / ref.norm()) < (1e-5 if dev == "cpu" else 1e-3), tiles
# with the plan's workspace bound (fp8.gemm.*) the launches take views of it, and one whose
# parts it cannot hold splits K into fewer: room for 2 parts of 20 x 96 runs the 4-part
# launch in 2; the counters are left at zero; unbound once the workspace is dropped
from moeserve.kernels.fp8.tiles import SplitWorkspace
room = SplitWorkspace(torch.full((2 * 20 * 96,), float("nan"), device=dev),
                      torch.zeros(64, dtype=torch.int32, device=dev))
gemm.bind_workspace(room)
assert gemm.split_buffers(xq.device, 4, 20, 96, 6)[0] == 2
assert gemm.split_buffers(xq.device, 2, 20, 96, 65)[0] == 1  # more tiles than counters
for split in (2, 4):
    got = gemm.block_gemm(xq, xs, wq, ws, small, torch.float32, bias, res,
                          tiles=GemmTiles(16, 64, 2, split, True))
    assert float((got - ref).norm() / ref.norm()) < (1e-5 if dev == "cpu" else 1e-3), split
assert not room.partials.isnan().any() and not room.counters.any()
del room
import gc
gc.collect()
assert gemm.split_buffers(xq.device, 4, 20, 96, 6)[0] == 4  # the launch's own partials
# scales written outer-dim-major (as cuBLAS reads them): the same values
xx = torch.randn(5, 256, device=dev)
q, sc = gemm.quantize_groups(xx, 64)
st = torch.empty(4, 5, device=dev).t()
q2 = torch.empty_like(q)
gemm.quantize_groups(xx, 64, out=(q2, st))
assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(st, sc)
# 128 x 128 blocks, K a multiple of 512, 256..512 or 2048+ bf16 rows: cuBLAS's block-scaled
# GEMM on a GPU (the Triton GEMM elsewhere: its 128-row prefill tiles at 1024 rows), against
# the reference, with bias and residual; 301 and 2049 rows padded to a multiple of 4 for cuBLAS
w = torch.randn(384, 1024, device=dev)
wq, ws = R.quantize_blocks(w, (128, 128))
bias, res = torch.randn(384, device=dev), torch.randn(2049, 384, device=dev)
for m in (8, 256, 301, 1024, 2049):
    xx = torch.randn(m, 1024, device=dev).bfloat16()
    assert gemm.cublas_takes(xx, wq, ws, (128, 128)) == (dev == "cuda" and m in (256, 301, 2049))
    got = gemm.fp8_linear(xx, wq, ws, (128, 128), bias.bfloat16(), res[:m].bfloat16()).float()
    ref = (R.fp8_linear(xx.float(), wq, ws, (128, 128), bias) + res[:m])
    assert float((got - ref).norm() / ref.norm()) < 1e-2, m
# the quantizer's edges (a row whose group is all zeros, values on the e4m3 grid's edges)
# through the swapped tiles of a few rows: the reference's products (float32 out, K = 3
# groups, the last column tile partly empty)
w = torch.randn(40, 384, device=dev)
wq, ws = R.quantize_blocks(w, (128, 128))
xx = torch.randn(2, 384, device=dev) * 300
xx[0, 128:256] = 0
got = gemm.fp8_linear(xx, wq, ws, (128, 128))
ref = R.fp8_linear(xx, wq, ws, (128, 128))
assert float((got - ref).norm() / ref.norm()) < (1e-6 if dev == "cpu" else 1e-3)
print("interpreter ok")
"""


def test_triton_fp8_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(KERNEL_SCRIPT.replace("{device}", "cpu"))


@pytest.mark.gpu
def test_triton_fp8_kernels_on_the_gpu():
    exec(KERNEL_SCRIPT.replace("{device}", "cuda"), {})


def test_split_partials_stay_within_the_planned_bound():
    """Every decode-tile launch that splits K stores at most split_partials_bound(SMs)
    partials (the plan's fp8.gemm.partials on PLANNED_SMS SMs), on devices of 8 to 160 SMs,
    for rows up to the decode tiles' and projections of 128 to 32768 columns."""
    from moeserve.kernels.fp8.tiles import DECODE_GEMM_ROWS, gemm_tiles, split_partials_bound

    for sms in (8, 78, 132, 160):
        bound, most = split_partials_bound(sms), 0
        for m in range(1, DECODE_GEMM_ROWS + 1):
            for n in (128, 1024, 2048, 2816, 5120, 7168, 24576, 32768):
                for k in (512, 768, 2048, 4096, 16384):
                    split = gemm_tiles(m, n, k, sms).split
                    most = max(most, split * m * n if split > 1 else 0)
        assert 0 < most <= bound < 2 * most, (sms, most, bound)


def test_decode_tiles_split_k_until_the_weight_fills_the_device():
    pytest.importorskip("triton")
    from moeserve.kernels.fp8.tiles import gemm_tiles

    # (rows, columns, K, programs) -> (BLOCK_M, BLOCK_N, stages, parts of K, swapped); 132
    # programs: an H100's SMs. Up to 8 rows the weight's 64 rows are the MMA's M side
    assert gemm_tiles(1, 2048, 2048, 0) == (16, 64, 3, 1, True)  # no device to fill
    assert gemm_tiles(1, 5120, 2048, 132) == (16, 64, 3, 4, True)  # 80 tiles x 4 >= 198
    assert gemm_tiles(8, 2048, 4096, 132) == (16, 64, 3, 8, True)  # 32 tiles x 8
    assert gemm_tiles(1, 1536, 2048, 132) == (16, 64, 3, 8, True)  # 24 x 8: 2 groups a part
    assert gemm_tiles(9, 2048, 4096, 132) == (16, 32, 5, 4, False)  # 64 tiles x 4
    assert gemm_tiles(9, 5120, 2048, 132) == (16, 32, 4, 2, False)  # 160 tiles x 2
    assert gemm_tiles(16, 32768, 2048, 132) == (16, 32, 4, 1, False)  # 1024 tiles: unsplit
    assert gemm_tiles(1, 128, 8192, 132) == (16, 64, 3, 8, True)  # 2 tiles: at most 8 parts
    assert gemm_tiles(64, 2048, 4096, 132) == (64, 32, 5, 2, False)  # 64-row tiles: 7/8 an SM
    assert gemm_tiles(64, 5120, 2048, 132) == (64, 32, 4, 1, False)
    assert gemm_tiles(8, 2048, 384, 132) == (16, 64, 3, 1, True)  # 3 groups: no part under 2
    assert gemm_tiles(200, 2048, 4096, 132) == (64, 64, 5, 1, False)  # decode rows: 64 x 64
    assert gemm_tiles(200, 1024, 4096, 132) == (64, 64, 5, 2, False)
    assert gemm_tiles(257, 5120, 2048, 132) == (128, 64, 3, 1, False)  # past them 128, unsplit
    assert gemm_tiles(8192, 2048, 2048, 132) == (128, 128, 3, 1, False)
