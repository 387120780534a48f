"""The fused MoE kernels with block-scaled FP8 weights (kernels/moe/fused_moe_fp8.py,
decode_moe_fp8.py) against the reference runner's W8A8 path (torch: dequantize, float32
products, the intermediate quantized per row per bk columns) under Triton's interpreter and on
a GPU at the shapes of Qwen3-30B-A3B and DeepSeek-V2-Lite; their tile rules and tables."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from interpreter import run_interpreted
from moe_cases import fake_state
from moeserve.config.quant import QuantSpec
from moeserve.kernels.fp8 import reference as R
from moeserve.kernels.moe import configs
from moeserve.moe.experts import create_experts
from moeserve.parallel.layout import ParallelLayout
from moeserve.testing.graphs import captured

torch.set_num_threads(1)


def make_fp8_experts(name: str, spec, ep: int, rank: int, block, seed: int, device="cpu",
                     dtype=torch.float32):
    """Rank `rank` of an ep-way layout with fresh random weights quantized per block."""
    lay = ParallelLayout(tp=ep, dp=1, ep=ep, dense_tp=ep, a2a=False)
    quant = QuantSpec(block[0], block[1], from_checkpoint=False)
    experts = create_experts(name, spec, fake_state(lay, rank), dtype, quant)
    g = torch.Generator(device).manual_seed(seed)  # drawn where they will live
    h, i = spec.hidden_size, spec.moe_intermediate_size
    w13 = torch.randn(experts.num_local, 2 * i, h, generator=g, device=device) * h ** -0.5
    w2 = torch.randn(experts.num_local, h, i, generator=g, device=device) * i ** -0.5
    for w, s, src in ((experts.w13, experts.w13_scale_inv, w13),
                      (experts.w2, experts.w2_scale_inv, w2)):
        q, scale = R.quantize_blocks(src, block)
        w.data, s.data = q, scale
    return experts.to(device)


def test_fp8_defaults_take_the_warp_specialised_kernels_on_hopper():
    """An fp8 shape without a table, on a Hopper GPU (capability 9.x), with 128 x 128 blocks
    and widths the kernels take: the warp-specialised GEMMs past FP8_WS_MIN_ROWS rows an
    expert, 128-row blocks past FP8_WS128_MIN_ROWS where H is a multiple of 256; the Triton
    tiles below them, elsewhere (another GPU, other blocks or widths) and at any size off
    Hopper; every answer a valid table entry."""
    def cfg(n, e=32, h=7168, i=2048, cap=(9, 0), block=(128, 128)):
        got = configs.get_config(n, 8, e, h, i, torch.bfloat16, "none", cap,
                                 quant_block=block)
        configs.validate(got, "defaults", block[1])
        return got["BLOCK_M"], bool(got["gate_up"].get("WS")), bool(got["down"].get("WS"))

    assert cfg(64) == (16, False, False)  # 16 rows an expert
    assert cfg(128) == (64, True, True)  # 32
    assert cfg(512) == (64, True, True)  # 128
    assert cfg(1024) == (128, True, True) and cfg(8192) == (128, True, True)
    assert cfg(8192, h=2176) == (64, True, True)  # H not a multiple of 256: 64-row blocks
    assert not cfg(8192, i=2000)[1] and not cfg(8192, cap=(8, 9))[1]  # I; not Hopper
    assert not cfg(8192, block=(128, 64))[1] and not cfg(8192, cap=None)[1]
    assert configs.FP8_WS_MIN_ROWS < configs.FP8_WS128_MIN_ROWS


def test_fp8_tile_rules():
    """BLOCK_K divides the scale group; gate_up's BLOCK_N holds whole groups; defaults obey."""
    for n in (1, 2, 16, 64, 512, 8192):
        for group in (16, 64, 128):
            cfg = configs.get_config(n, 8, 128, 2048, 768, torch.bfloat16, "none",
                                     quant_block=(128, group))
            configs.validate(cfg, "defaults", group)
            assert cfg["gate_up"]["BLOCK_N"] % group == 0
            for g, c in cfg.get("decode", {}).items():  # whole groups a K step
                assert c["BLOCK_K"] % group == 0 and c["BLOCK_N"] & (c["BLOCK_N"] - 1) == 0
    bad = {"BLOCK_M": 64, "gate_up": {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
                                      "num_warps": 4, "num_stages": 3},
           "down": {"BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 4,
                    "num_stages": 3, "WS": 1}}
    with pytest.raises(ValueError) as err:
        configs.validate(bad, "t.json", 128)
    msg = str(err.value)
    assert "gate_up.BLOCK_N 64 is not a multiple" in msg and "down.BLOCK_K 256" in msg
    assert "down sets WS" in msg and "tune-moe --fp8" in msg
    decode = {"gate_up": {"BLOCK_N": 24, "BLOCK_K": 384, "num_warps": 4, "PREFETCH": 1},
              "down": {"BLOCK_N": 16, "BLOCK_K": 192, "num_warps": 4}}
    with pytest.raises(ValueError) as err:
        configs.validate({**bad, "down": {**bad["down"], "BLOCK_K": 128, "WS": 0},
                          "gate_up": {**bad["gate_up"], "BLOCK_N": 128}, "decode": decode},
                         "t.json", 128)
    msg = str(err.value)
    assert "decode.gate_up.BLOCK_N 24 is not a power of two" in msg, msg
    assert "decode.gate_up.BLOCK_K 384 is not a power-of-two multiple" in msg, msg
    assert "decode.down.BLOCK_K 192 is not a power-of-two multiple" in msg, msg
    assert "decode.gate_up sets PREFETCH" in msg, msg
    # the MMA decode kernels: a group a step, BLOCK_N a power of two from 16, their stages;
    # neither grouped kernel (nor a bf16 table's decode) takes MMA
    mma = {"gate_up": {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "MMA": 1},
           "down": {"BLOCK_N": 48, "BLOCK_K": 64, "num_warps": 4, "MMA": 1}}
    good = {**bad, "down": {**bad["down"], "BLOCK_K": 128, "WS": 0},
            "gate_up": {**bad["gate_up"], "BLOCK_N": 128}}
    with pytest.raises(ValueError) as err:
        configs.validate({**good, "down": {**good["down"], "MMA": 1}, "decode": mma}, "t.json",
                         128)
    msg = str(err.value)
    assert "decode.gate_up.BLOCK_K 256 is not the scale group 128" in msg, msg
    assert "decode.gate_up.BLOCK_N 8 is not a power of two from 16" in msg, msg
    assert "decode.gate_up sets MMA without num_stages" in msg, msg
    assert "decode.down.BLOCK_K 64 is not the scale group 128" in msg, msg
    assert "decode.down.BLOCK_N 48 is not a power of two from 16" in msg, msg
    assert "decode.down sets MMA without num_stages" in msg, msg
    assert "down sets MMA, which only the decode kernels take" in msg, msg
    ok = {"gate_up": configs.fp8_decode_gate_up(128), "down": configs.fp8_decode_down(128)}
    configs.validate({**good, "decode": ok}, "t.json", 128)
    for kernel in ("gate_up", "down"):
        one = {"gate_up": decode["gate_up"] | {"BLOCK_N": 16, "BLOCK_K": 128, "PREFETCH": 0},
               "down": decode["down"] | {"BLOCK_K": 128}} | {kernel: ok[kernel]}
        with pytest.raises(ValueError, match="bf16 table"):
            configs.validate({**good, "decode": one}, "t.json")
    # the warp-specialised kernels (fp8_ws.py): their fixed tiles, in both grouped GEMMs
    ws = {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 6,
          "WS": 1}
    configs.validate({"BLOCK_M": 64, "gate_up": ws, "down": {**ws, "ATOMIC_SUM": 1}},
                     "t.json", 128)
    with pytest.raises(ValueError) as err:
        configs.validate({"BLOCK_M": 32, "gate_up": {**ws, "BLOCK_N": 256},
                          "down": {**ws, "BLOCK_K": 32, "HALF_TAIL": 1},
                          "decode": {**ok, "down": {**ok["down"], "WS": 1}}}, "t.json", 128)
    msg = str(err.value)
    assert "gate_up sets WS with BLOCK_N 256 (WS: 128)" in msg, msg
    assert "down sets WS with BLOCK_K 32 (WS: 64 or 128)" in msg, msg
    assert "down sets WS with HALF_TAIL" in msg, msg
    assert "a GEMM sets WS with BLOCK_M 32 (WS: 64 or 128)" in msg, msg
    configs.validate({"BLOCK_M": 128, "gate_up": {**ws, "BLOCK_K": 128},
                      "down": {**ws, "BLOCK_K": 128}}, "t.json", 128)
    with pytest.raises(ValueError, match="down sets WS with BLOCK_K 64 at BLOCK_M 128"):
        configs.validate({"BLOCK_M": 128, "gate_up": {**ws, "BLOCK_K": 128}, "down": ws},
                         "t.json", 128)
    assert "decode.down sets WS, which only the grouped GEMMs take" in msg, msg
    with pytest.raises(ValueError, match="sets WS with scale group 64"):
        configs.validate({"BLOCK_M": 64, "gate_up": {**ws, "BLOCK_K": 64}, "down": ws},
                         "t.json", 64)
    with pytest.raises(ValueError, match="warp-specialised kernel is down's"):
        configs.validate({"BLOCK_M": 64, "gate_up": ws, "down": ws}, "t.json")  # bf16
    assert configs.table_dtype(torch.bfloat16, (128, 128)) == "fp8_w8a8_128x128"
    assert configs.table_dtype(torch.bfloat16) == "bfloat16"
    assert configs.fp8_group("fp8_w8a8_128x64") == 64 and configs.fp8_group("bfloat16") is None


def test_shipped_fp8_tables_obey_the_tile_rules():
    """Every shipped fp8 table (H100 and H200, Qwen3-30B-A3B and DeepSeek-V2-Lite) loads,
    obeys the fp8 rules and says that it awaits tuning."""
    files = sorted(configs.CONFIG_DIR.glob("*dtype=fp8_w8a8_*.json"))
    shapes = {f.name.split(",dtype")[0] for f in files}
    assert {"E=128,H=2048,I=768", "E=64,H=2048,I=1408"} <= shapes
    assert {f.name.split("device=")[1] for f in files} >= {"NVIDIA_H100_80GB_HBM3.json",
                                                           "NVIDIA_H200.json"}
    for f in files:
        parts = dict(p.split("=", 1) for p in f.stem.split(","))
        table = configs.load_tuned(int(parts["E"]), int(parts["H"]), int(parts["I"]),
                                   parts["dtype"], parts["device"])
        assert table and 1 in table and 8192 in table, f
        assert "tune-moe --fp8" in json.loads(f.read_text()).get("note", ""), f


def test_triton_runner_takes_fp8_weights_and_checks_the_block():
    from moeserve.moe.experts.triton_fused import TritonFusedExperts
    from test_moe_triton import make_spec

    spec = make_spec(e=8, k=2, h=64, i=32)
    lay = ParallelLayout(tp=1, dp=1, ep=1, dense_tp=1, a2a=False)
    runner = create_experts("triton", spec, fake_state(lay, 0), torch.bfloat16,
                            QuantSpec(16, 16, from_checkpoint=False))
    assert isinstance(runner, TritonFusedExperts) and runner.w13.dtype == R.FP8
    assert runner.w13_scale_inv.shape == (8, 4, 4) and runner.w2_scale_inv.shape == (8, 4, 2)
    cfg = runner.config_for(3, torch.device("cpu"))
    assert cfg["gate_up"]["BLOCK_K"] == 16 and cfg["gate_up"]["BLOCK_N"] % 16 == 0
    with pytest.raises(ValueError, match="power of two >= 16"):
        create_experts("triton", spec, fake_state(lay, 0), torch.bfloat16,
                       QuantSpec(16, 8, from_checkpoint=False))


_INTERPRETER_SCRIPT = r"""
import itertools
import torch
import torch.nn.functional as F
from test_moe_fp8 import make_fp8_experts
from test_moe_triton import make_spec, rel_err, routing
from moeserve.kernels.fp8 import gemm, reference as R
from moeserve.kernels.moe import fused_moe_fp8 as F8
from moeserve.kernels.moe.align_torch import Workspace, align_torch
from moeserve.kernels.moe.configs import BLOCK_MS, align_scratch_len, max_blocks, padded_rows
torch.manual_seed(0)


def gemm_cfg(bn, bk, **extra):
    return {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": 4, "num_stages": 2,
            **extra}


def run(tri, x, ids, w, cfg, x_scale=None, ws=None):
    return F8.fused_experts_fp8(x, x_scale, tri.w13, tri.w13_scale_inv, tri.w2,
                                tri.w2_scale_inv, ids, w, tri.first_expert, tri.kernel_act,
                                tri.quant.block, cfg, torch.float32, ws)


# the grouped GEMMs and the decode kernels against the reference runner's W8A8 path: scale
# groups of 16 and of 32 (BLOCK_K 16 dividing it), H not a multiple of the group, gate_up
# tiles of one and of two groups, TMA weights, half tiles, the top-k summed by atomics in
# down; decode tiles wider and narrower than the group, of one group a step and of several
# (down's 4 groups of 32 past I = 64: a step partly past I), and the MMA kernels (down's last
# column tile partly past H); EP ranks, -1 ids; the MMA down's pairs split into parts
def decode_cfg(group, up_n=16, up_k=1, down_n=8, down_k=1):
    return {"gate_up": {"BLOCK_N": up_n, "BLOCK_K": up_k * group, "num_warps": 4},
            "down": {"BLOCK_N": down_n, "BLOCK_K": down_k * group, "num_warps": 2}}


def mma_cfg(block_n, group):
    return {"BLOCK_N": block_n, "BLOCK_K": group, "num_warps": 4, "num_stages": 2, "MMA": 1}


gemv = decode_cfg(16)
cases = [
    ((16, 16), "silu", {"BLOCK_M": 16, "gate_up": gemm_cfg(16, 16), "down": gemm_cfg(16, 16)}),
    ((16, 32), "gelu", {"BLOCK_M": 16, "gate_up": gemm_cfg(32, 16),
                        "down": gemm_cfg(32, 16, TMA=1)}),
    ((16, 16), "silu", {"BLOCK_M": 32, "gate_up": gemm_cfg(32, 16, TMA=1, HALF_TAIL=1),
                        "down": gemm_cfg(16, 16, HALF_TAIL=1, ATOMIC_SUM=1)}),
    # SWAP: the weight's rows the dot's M side (with TMA weights, half tiles, atomics)
    ((16, 16), "silu", {"BLOCK_M": 16, "gate_up": gemm_cfg(16, 16, SWAP=1),
                        "down": gemm_cfg(32, 16, SWAP=1)}),
    ((16, 32), "gelu", {"BLOCK_M": 32, "gate_up": gemm_cfg(32, 16, TMA=1, HALF_TAIL=1, SWAP=1),
                        "down": gemm_cfg(16, 16, TMA=1, HALF_TAIL=1, ATOMIC_SUM=1,
                                         SWAP=1)}),
    ((32, 16), "silu", {"decode": gemv}),
    ((16, 32), "gelu", {"decode": decode_cfg(32, up_n=64, up_k=2, down_n=2, down_k=4)}),
    ((16, 16), "silu", {"decode": decode_cfg(16, up_n=4, up_k=4, down_n=16, down_k=2)}),
    # the MMA gate_up: the weight's rows the dot's M side, a group a step
    ((16, 32), "silu", {"decode": {**decode_cfg(32), "gate_up": mma_cfg(64, 32)}}),
    ((16, 16), "gelu", {"decode": {**gemv, "gate_up": mma_cfg(16, 16)}}),
    # the MMA down: the expert's rows of w2 the dot's M side, each pair's group of h
    # quantized in the kernel, a group a step
    ((16, 32), "silu", {"decode": {"gate_up": mma_cfg(64, 32), "down": mma_cfg(64, 32)}}),
    ((16, 16), "gelu", {"decode": {**gemv, "down": mma_cfg(16, 16)}}),
]
for (block, act, cfg), ((ep, rank), h) in itertools.product(cases, [((1, 0), 64),
                                                                    ((2, 1), 40)]):
    spec = make_spec(e=8, k=2, h=h, i=64, act=act)
    ref = make_fp8_experts("reference", spec, ep, rank, block, seed=h)
    tri = make_fp8_experts("triton", spec, ep, rank, block, seed=h)
    # the decode kernels at decode sizes (the interpreter runs their programs one by one)
    sizes = ((1, "uniform"), (7, "padded")) if "decode" in cfg else \
        ((1, "uniform"), (7, "skewed"), (30, "padded"))
    for n, mode in sizes:
        x = torch.randn(n, h) * 2
        ids, w = routing(n, 2, 8, mode, seed=n)
        want = ref(x, ids, w)
        y = run(tri, x, ids, w, cfg)
        err = rel_err(y, want)
        assert err <= 1e-4, (block, act, cfg, ep, h, n, mode, err)
        if mode == "padded":
            assert (y[-1] == 0).all()
        # rows delivered quantized (as the all-to-all carries them): the same bits
        xq, xs = R.quantize_groups(x, block[1])
        assert torch.equal(run(tri, xq, ids, w, cfg, xs), y)
        # the runner picks these kernels for its fp8 weights
        assert rel_err(tri(x, ids, w), want) <= 1e-4

# a table's warp-specialised config (fp8_ws.py, sm90 only) runs the Triton kernels elsewhere,
# with its tiles: 128 x 128 scale blocks, 64-row blocks
from moeserve.kernels.moe import fp8_ws
ws_gemm = {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 2,
           "WS": 1}
ws_cfg = {"BLOCK_M": 64, "gate_up": ws_gemm, "down": {**ws_gemm, "ATOMIC_SUM": 1}}
spec = make_spec(e=4, k=2, h=256, i=128, act="silu")
ref = make_fp8_experts("reference", spec, 1, 0, (128, 128), seed=3)
tri = make_fp8_experts("triton", spec, 1, 0, (128, 128), seed=3)
assert not fp8_ws.usable(tri.w2, (128, 128), 64, ws_gemm)
xq, xs = R.quantize_groups(torch.randn(4, 256), 128)
assert fp8_ws.gathers(xq, xs) and not fp8_ws.gathers(xq[:, 16:], xs)
assert not fp8_ws.gathers(xq, xs.t().contiguous().t())
x = torch.randn(12, 256) * 2
ids, w = routing(12, 2, 4, "skewed", seed=3)
err = rel_err(run(tri, x, ids, w, ws_cfg), ref(x, ids, w))
assert err <= 1e-4, err
# at 128-row blocks (fp8_ws128.py, BLOCK_K 128) likewise; its down's tiles are 256 columns of H,
# so another H takes the Triton kernel on sm90 too
from moeserve.kernels.moe import fp8_ws128
ws128 = {**ws_gemm, "BLOCK_K": 128}
ws128_cfg = {"BLOCK_M": 128, "gate_up": ws128, "down": {**ws128, "ATOMIC_SUM": 1}}
err = rel_err(run(tri, x, ids, w, ws128_cfg), ref(x, ids, w))
assert err <= 1e-4, err
sm90, fp8_ws.sm90 = fp8_ws.sm90, lambda w: True
try:
    assert fp8_ws128.usable(tri.w13, (128, 128), 128, ws128)
    assert fp8_ws128.down_usable(tri.w2, (128, 128), 128, ws128)
    assert not fp8_ws128.down_usable(tri.w2[:, :128].contiguous(), (128, 128), 128, ws128)
    assert not fp8_ws128.usable(tri.w13, (128, 128), 128, ws_gemm)  # BLOCK_K 64
finally:
    fp8_ws.sm90 = sm90

# the MMA down with the row's pairs split into parts (as on a GPU of 16 SMs: at one row, a part
# a pair, the last part to finish adding the partials in part order)
from moeserve.kernels.moe import decode_moe_fp8 as D8
assert D8.down_split(4, 2, 16) == 2 and D8.down_split(28, 2, 16) == 1
assert D8.down_split(32, 8, 132) == 8 and D8.down_split(64, 8, 132) == 4
assert D8.down_split(32, 6, 132) == 6 and D8.down_split(7, 8, 0) == 1
on_cpu = D8._programs
D8._programs = lambda device: 16
try:
    block, cfg = (16, 16), {"decode": {**gemv, "down": mma_cfg(16, 16)}}
    for (ep, rank), n in [((1, 0), 1), ((2, 1), 1)]:
        spec = make_spec(e=8, k=2, h=64, i=64, act="silu")
        ref = make_fp8_experts("reference", spec, ep, rank, block, seed=n)
        tri = make_fp8_experts("triton", spec, ep, rank, block, seed=n)
        x = torch.randn(n, 64) * 2
        ids, w = routing(n, 2, 8, "uniform", seed=n)
        err = rel_err(run(tri, x, ids, w, cfg), ref(x, ids, w))
        assert err <= 1e-4, (ep, n, err)
finally:
    D8._programs = on_cpu

# gate_up's epilogue writes the codes and scales that quantize_groups gives the float32 product
block, act = (16, 16), "silu"
spec = make_spec(e=8, k=2, h=48, i=64)
tri = make_fp8_experts("triton", spec, 1, 0, block, seed=4)
x = torch.randn(20, 48)
ids, w = routing(20, 2, 8, "uniform", seed=4)
xq, xs = gemm.quantize_groups(x, 16)
blocks = align_torch(ids, 0, 8, 16)
h, hs = F8.gate_up(xq, xs, tri.w13, tri.w13_scale_inv, blocks, 2, "silu", gemm_cfg(32, 16),
                   block)
rows = [r for b in range(blocks.num_blocks) for r in range(b * 16, b * 16 + int(blocks.block_rows[b]))]
pairs = blocks.sorted_pairs[rows].long()
experts = ids.view(-1)[pairs].long()
xd = R.dequantize_groups(xq, xs, 16)[pairs // 2]
w13 = R.dequantize_blocks(tri.w13, tri.w13_scale_inv, block)[experts]
gu = torch.einsum("ph,pih->pi", xd, w13)
want_q, want_s = R.quantize_groups(F.silu(gu[:, :64]) * gu[:, 64:], 16)
same = (h[rows].view(torch.uint8) == want_q.view(torch.uint8)).float().mean()
assert same >= 0.99, float(same)  # a float32 sum in another order may round a code the other way
assert torch.allclose(hs[rows], want_s, rtol=1e-5, atol=0)

# the intermediates in a plan-sized workspace: the same bits; one row short is refused by name
spec = make_spec(e=8, k=2, h=48, i=64)
tri = make_fp8_experts("triton", spec, 2, 1, block, seed=7)
grouped = {"BLOCK_M": 16, "gate_up": gemm_cfg(16, 16), "down": gemm_cfg(16, 16)}
# decode: its product in act_f32; the MMA gate_up quantizes 16-bit rows into input, the MMA
# down the product into act and act_scale
mma = {"decode": {"gate_up": mma_cfg(16, 16), "down": mma_cfg(16, 16)}}
for n, cfg in [(30, grouped), (3, {"decode": gemv}), (3, mma)]:
    p = n * 2
    def workspace(short=0):
        b = max(max_blocks(p, m, 4) for m in BLOCK_MS)
        r = padded_rows(p, 4) - short
        return Workspace(torch.empty(r, dtype=torch.int32), torch.empty(b, dtype=torch.int32),
                         torch.empty(b, dtype=torch.int32),
                         torch.empty(r, 64, dtype=R.FP8), torch.empty(p, 48),
                         torch.empty(align_scratch_len(p, 4), dtype=torch.int32),
                         act_scale=torch.empty(r, 4), input=torch.empty(n, 48, dtype=R.FP8),
                         input_scale=torch.empty(n, 3),
                         # zeros: the rows of other ranks' pairs stay as they are
                         act_f32=torch.zeros(p - (short > 0), 64))
    x = torch.randn(n, 48)
    ids, w = routing(n, 2, 8, "skewed", seed=n)
    ws = workspace()
    assert torch.equal(run(tri, x, ids, w, cfg, ws=ws), run(tri, x, ids, w, cfg))
    if cfg is mma:  # the rows' and the product's codes where the plan put them
        codes = R.quantize_groups(x, 16)[0]
        assert torch.equal(ws.input.view(torch.uint8), codes.view(torch.uint8))
        h_q, h_s = R.quantize_groups(ws.act_f32[:p], 16)
        assert torch.equal(ws.act[:p].view(torch.uint8), h_q.view(torch.uint8))
        assert torch.equal(ws.act_scale[:p], h_s)
    short = padded_rows(p, 4) - (p if "decode" in cfg else max_blocks(p, 16, 4) * 16) + 1
    try:
        run(tri, x, ids, w, cfg, ws=workspace(short))
    except RuntimeError as exc:
        assert "moe.runner." in str(exc) and "token budget" in str(exc), exc
    else:
        raise AssertionError("a workspace too small was taken")
# tiles that break the fp8 rules are refused at launch, naming the rule
for bad in ({"BLOCK_M": 16, "gate_up": gemm_cfg(16, 32), "down": gemm_cfg(16, 16)},
            {"decode": {**gemv, "gate_up": {**gemv["gate_up"], "BLOCK_K": 24}}}):
    try:
        run(tri, x, ids, w, bad)
    except ValueError as exc:
        assert "scale group 16" in str(exc), exc
    else:
        raise AssertionError(f"{bad} was launched")
print("interpreter ok")
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_fp8_moe_kernels_under_the_interpreter():
    run_interpreted(_INTERPRETER_SCRIPT, timeout=280)


def test_plan_records_the_fp8_workspace_and_the_binder_makes_it():
    """act in fp8 beside its group scales; the input rows' quantized copy only where no
    all-to-all delivers them quantized; one formula for both dtypes."""
    from moeserve.config import EngineConfig
    from moeserve.plan.capacity import build_plan
    from moeserve.config.quant import FP8_DTYPE as FP8
    from moeserve.runtime.buffers import bind_model_buffers

    flags = dict(model="preset:tiny", gpu_memory_gb=8, moe_runner_backend="triton",
                 device="cuda")
    bf16 = build_plan(EngineConfig(**flags))
    plan = build_plan(EngineConfig(**flags, quantization="fp8"))
    assert plan.ok and plan.expert_block == (128, 128) and bf16.expert_block is None
    h, i = plan.spec.hidden_size, plan.spec.moe_intermediate_size
    act, act16 = plan.buffer("moe.runner.act"), bf16.buffer("moe.runner.act")
    assert act.dtype == "float8_e4m3fn" and act.shape == act16.shape
    assert act.formula == act16.formula and act.bytes * 4 == act16.bytes  # float32 model
    assert plan.buffer("moe.runner.act_scale").shape == (act.shape[0], -(-i // 128))
    rows = plan.moe_runner_rows
    assert plan.buffer("moe.runner.input").shape == (rows, h)
    assert plan.buffer("moe.runner.input_scale").shape == (rows, -(-h // 128))
    assert not any(r.name in ("moe.runner.act_scale", "moe.runner.input") for r in bf16.buffers)
    ws = bind_model_buffers(plan, "cpu").experts
    assert ws.act.dtype == R.FP8 and ws.input.dtype == R.FP8 and ws.act_scale is not None
    # the GEMV gate_up's split product: the most rows the defaults give the GEMV path (no
    # table for an unknown device), K pairs each
    e, k = plan.spec.num_experts, plan.spec.top_k
    gemv = configs.gemv_rows(rows, k, e, h, i, "float32", None, quant_block=(128, 128))
    assert gemv == min(rows, max(1, e // (8 * k)))
    assert plan.buffer("moe.runner.act_f32").shape == (gemv * k, i)
    assert ws.act_f32.dtype == torch.float32 and ws.act_f32.shape == (gemv * k, i)
    assert "moe.runner.act_f32" not in {r.name for r in bf16.buffers}
    a2a = build_plan(EngineConfig(**flags, quantization="fp8", tp_size=2, ep_size=2,
                                  moe_a2a_backend="all_to_all"))
    names = {r.name for r in a2a.buffers}
    assert "moe.runner.act_scale" in names and "moe.runner.input" not in names
    bound = bind_model_buffers(a2a, "cpu")
    assert bound.experts.input is None and bound.experts.act_scale is not None
    # the rows the all-to-all quantizes before they travel: planned, on either transport
    cap = a2a.a2a_cap
    for transport in ("all_to_all", "nvlink"):
        p = build_plan(EngineConfig(**flags, quantization="fp8", tp_size=2, ep_size=2,
                                    moe_a2a_backend=transport))
        assert p.buffer("a2a.quant").shape == (cap, h) and p.buffer("a2a.quant").dtype == FP8
        assert p.buffer("a2a.quant_scale").shape == (cap, -(-h // 128))
        ws = bind_model_buffers(p, "cpu").a2a
        assert ws.quant.dtype == R.FP8 and ws.quant_scale.shape == (cap, -(-h // 128))
    assert not any(r.name.startswith("a2a.quant") for r in build_plan(EngineConfig(
        **flags, tp_size=2, ep_size=2, moe_a2a_backend="all_to_all")).buffers)
    # auto moves fp8 rows one-sided on the GPUs of one node, as it does bf16 rows
    for device, want in (("cuda", "nvlink"), ("cpu", "all_to_all")):
        on = dict(flags, device=device, moe_runner_backend="auto")
        p = build_plan(EngineConfig(**on, quantization="fp8", tp_size=2, ep_size=2,
                                    dp_size=2, enable_dp_attention=True,
                                    moe_a2a_backend="auto"))
        assert p.backends.a2a == want and p.a2a_scale_group == 128


# --- GPU: real shapes, CUDA graphs, an engine ------------------------------------------------

REAL = {"qwen3-30b-a3b": dict(e=128, k=8, h=2048, i=768),
        "deepseek-v2-lite": dict(e=64, k=6, h=2048, i=1408)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(REAL))
@pytest.mark.parametrize("n", [1, 2, 16, 64, 256, 512, 8192])
def test_fp8_runner_matches_the_reference_at_real_shapes_on_gpu(name, n):
    from test_moe_triton import make_spec, rel_err, routing

    spec = make_spec(**REAL[name])
    e, k = REAL[name]["e"], REAL[name]["k"]
    ref = make_fp8_experts("reference", spec, 1, 0, (128, 128), 0, "cuda", torch.bfloat16)
    tri = make_fp8_experts("triton", spec, 1, 0, (128, 128), 0, "cuda", torch.bfloat16)
    x = torch.randn(n, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(n, k, e, "uniform", seed=n, device="cuda")
    want = ref(x, ids, w)
    got = tri(x, ids, w)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) <= 1e-2, rel_err(got, want)
    xq, xs = R.quantize_groups(x, 128)  # delivered quantized, as the all-to-all does
    assert rel_err(tri(xq, ids, w, xs), want) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(REAL))
@pytest.mark.parametrize("n", [1, 2, 8])
def test_fp8_mma_decode_kernels_match_the_reference_at_real_shapes_on_gpu(name, n):
    """Both MMA decode kernels whatever the tables say: the down's pairs split into parts on
    every SM count (down_split), the same bits eager and replayed in a graph with new ids."""
    from moeserve.kernels.moe import fused_moe_fp8 as F8
    from test_moe_triton import make_spec, rel_err, routing

    spec = make_spec(**REAL[name])
    e, k = REAL[name]["e"], REAL[name]["k"]
    ref = make_fp8_experts("reference", spec, 1, 0, (128, 128), 0, "cuda", torch.bfloat16)
    tri = make_fp8_experts("triton", spec, 1, 0, (128, 128), 0, "cuda", torch.bfloat16)
    cfg = {"decode": {"gate_up": configs.fp8_decode_gate_up(128),
                      "down": configs.fp8_decode_down(128)}}
    x = torch.randn(n, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(n, k, e, "uniform", seed=n, device="cuda")

    def run():
        return F8.fused_experts_fp8(x, None, tri.w13, tri.w13_scale_inv, tri.w2,
                                    tri.w2_scale_inv, ids, w, 0, tri.kernel_act, (128, 128),
                                    cfg, torch.bfloat16)
    assert rel_err(run(), ref(x, ids, w)) <= 1e-2
    graph, out = captured(run)
    for seed in (2, 3):
        new_ids, new_w = routing(n, k, e, "skewed", seed=seed, device="cuda")
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        assert torch.equal(out, run())


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(REAL))
@pytest.mark.parametrize("n,ep", [(64, 1), (1000, 1), (4096, 1), (1000, 2)])
@pytest.mark.parametrize("bm", [64, 128])
def test_fp8_ws_gemms_match_the_triton_kernels_on_gpu(name, n, ep, bm):
    """fp8_ws.py's warp-specialised gate_up and down (sm90) against the Triton kernels of 128-
    column K steps (the same promotion a scale group: both sum a group's products in the MMA,
    then scale them), with K steps of 64 and 128 columns: h's codes and scales (on H200 the
    same bits; a float32 sum in another order may round a code the other way), the experts'
    output at the pairs' slots and summed by atomics; an EP rank's -1 ids; a CUDA graph's
    replay equals the eager call."""
    check_ws_gemms(REAL[name], n, ep, bm)


# the largest FP8 releases, as one expert-parallel rank holds them (DeepSeek-V3 on 8 ranks,
# Qwen3-235B-A22B on 4): their configs default to the warp-specialised kernels on sm90
LARGE = {"deepseek-v3": (dict(e=256, k=8, h=7168, i=2048), 8),
         "qwen3-235b-a22b": (dict(e=128, k=8, h=4096, i=1536), 4)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LARGE))
@pytest.mark.parametrize("n", [300, 4096])
@pytest.mark.parametrize("bm", [64, 128])
def test_fp8_ws_gemms_match_the_triton_kernels_at_the_largest_shapes_on_gpu(name, n, bm):
    """The same checks at the shapes of the largest FP8 checkpoints, one EP rank's experts."""
    dims, ep = LARGE[name]
    check_ws_gemms(dims, n, ep, bm)


def check_ws_gemms(dims: dict, n: int, ep: int, bm: int) -> None:
    from moeserve.kernels.moe import fp8_ws
    from moeserve.kernels.moe import fused_moe_fp8 as F8
    from moeserve.kernels.moe.align import align_triton
    from test_moe_triton import make_spec, rel_err, routing

    if not fp8_ws.sm90(torch.empty(1, device="cuda")):
        pytest.skip("the warp-specialised fp8 kernels are sm90's")
    spec = make_spec(**dims)
    e, k = dims["e"], dims["k"]
    tri = make_fp8_experts("triton", spec, ep, ep - 1, (128, 128), 0, "cuda", torch.bfloat16)
    x = torch.randn(n, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(n, k, e, "skewed", seed=n, device="cuda")
    xq, xs = R.quantize_groups(x, 128)
    blocks = align_triton(ids.to(torch.int32), tri.first_expert, tri.num_local, bm)
    for bk, stages in ((64, 6), (128, 3)) if bm == 64 else ((128, 3), (128, 4)):
        ws = {"BLOCK_N": 128, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": 4,
              "num_stages": stages, "WS": 1}
        plain = {**ws, "BLOCK_K": 128, "num_stages": 3, "WS": 0}
        assert fp8_ws.usable(tri.w13, (128, 128), bm, ws) == (bm == 64)
        args = (xq, xs, tri.w13, tri.w13_scale_inv, blocks, k, "silu")
        h0, hs0 = F8.gate_up(*args, plain, (128, 128))
        h1, hs1 = F8.gate_up(*args, ws, (128, 128))
        nb = blocks.num_blocks
        rows = (torch.arange(bm, device="cuda")[None, :] < blocks.block_rows[:nb, None])
        rows = (rows & (blocks.block_expert[:nb, None] >= 0)).view(-1)
        codes = h0.view(torch.uint8)[rows] != h1.view(torch.uint8)[rows]
        assert codes.float().mean() <= 1e-3, float(codes.float().mean())
        assert torch.allclose(hs1[rows], hs0[rows], rtol=1e-5, atol=0)
        wts = w.to(torch.float32).view(-1)
        for atomic in (False, True):
            shape = (n, spec.hidden_size) if atomic else (n * k, spec.hidden_size)
            y0 = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
            y1 = torch.zeros_like(y0)
            F8.down(h0, hs0, tri.w2, tri.w2_scale_inv, blocks, wts, y0, k if atomic else 1,
                    {**plain, "ATOMIC_SUM": int(atomic)}, (128, 128), atomic)
            F8.down(h0, hs0, tri.w2, tri.w2_scale_inv, blocks, wts, y1, k if atomic else 1,
                    {**ws, "ATOMIC_SUM": int(atomic)}, (128, 128), atomic)
            assert rel_err(y1, y0) <= (1e-2 if atomic else 1e-4), (atomic, rel_err(y1, y0))
        # the whole experts, eagerly and replayed
        cfg = {"BLOCK_M": bm, "gate_up": ws, "down": ws}
        run = lambda: F8.fused_experts_fp8(  # noqa: E731
            x, None, tri.w13, tri.w13_scale_inv, tri.w2, tri.w2_scale_inv, ids, w,
            tri.first_expert, "silu", (128, 128), cfg, torch.bfloat16)
        eager = run()
        want = F8.fused_experts_fp8(x, None, tri.w13, tri.w13_scale_inv, tri.w2,
                                    tri.w2_scale_inv, ids, w, tri.first_expert, "silu",
                                    (128, 128), {"BLOCK_M": bm, "gate_up": plain,
                                                 "down": plain}, torch.bfloat16)
        assert rel_err(eager, want) <= 1e-3, rel_err(eager, want)
        graph, out = captured(run)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 16, 256])
def test_fp8_runner_replays_in_a_cuda_graph(n):
    from test_moe_triton import make_spec, routing

    spec = make_spec(**REAL["qwen3-30b-a3b"])
    tri = make_fp8_experts("triton", spec, 1, 0, (128, 128), 1, "cuda", torch.bfloat16)
    x = torch.randn(n, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(n, 8, 128, "uniform", seed=1, device="cuda")
    tri(x, ids, w)  # compile outside the capture
    graph, out = captured(lambda: tri(x, ids, w))
    for seed in (2, 3):
        new_ids, new_w = routing(n, 8, 128, "skewed", seed=seed, device="cuda")
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, tri(x, ids, w))


@pytest.mark.gpu
def test_fp8_engine_with_triton_experts_gives_the_reference_tokens(tmp_path):
    """A small Qwen3-MoE whose projections hold whole 128 x 128 blocks, quantized at load,
    decode graphs and the triton runner against the reference runner (eager): the same greedy
    tokens (float32 model; the two differ only in the order of float32 sums). The prompts,
    prefilled together, keep at most 24 rows an expert: past that the Hopper defaults take the warp-specialised
    GEMMs, whose float32 sums in another order round some of h's fp8 codes the other way
    (H200, this shape at 130 rows: 2.7e-3 from the reference against 3.7e-7 for the Triton
    kernels), which changes this random model's greedy tokens; check_ws_gemms holds those
    kernels to the Triton ones."""
    import json
    import random

    from moeserve.config.presets import PRESETS
    from moeserve.runtime.engine import Engine

    config = {**PRESETS["tiny"], "hidden_size": 256, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 128, "moe_intermediate_size": 128,
              "intermediate_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))

    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(m)] for m in (1, 7, 30, 50)]
    params = [{"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}] * len(prompts)
    flags = dict(load_format="dummy", dtype="float32", device="cuda", quantization="fp8",
                 skip_tokenizer_init=True, max_running_requests=8, max_total_tokens=2048,
                 context_length=256)
    tokens = {}
    for runner in ("triton", "reference"):
        # the reference runner's fp8 path finds each expert's rows on the host: no graphs
        with Engine(str(tmp_path), moe_runner_backend=runner, **flags,
                    disable_cuda_graph=runner == "reference",
                    disable_piecewise_cuda_graph=runner == "reference") as engine:
            out = engine.generate(input_ids=prompts, sampling_params=params)
        assert all(o["error"] is None for o in out), out
        tokens[runner] = [o["token_ids"] for o in out]
    assert [t[0] for t in tokens["triton"]] == [t[0] for t in tokens["reference"]]
    same = sum(a == b for x, y in zip(tokens["triton"], tokens["reference"])
               for a, b in zip(x, y))
    assert same >= 0.9 * 16 * len(prompts), tokens


def test_the_tuner_note_names_every_size_it_tuned():
    """tune-moe --fp8 adds each size it tunes to the sizes the table's note already names and
    keeps its remarks; the shipped H200 tables' notes read as the sizes they were tuned at."""
    from benchmarks.tune_moe_fp8 import tuned_note, tuned_sizes

    note = tuned_note("NVIDIA H200", {64, 8192, 1})
    assert "at 1, 64 and 8192 tokens" in note and tuned_sizes(note) == {1, 64, 8192}
    assert tuned_sizes(tuned_note("X", {16})) == {16}
    assert tuned_sizes("Untuned: the fp8 defaults") == set()
    # a re-tune keeps the remarks the table's note made after its sizes
    again = tuned_note("X", {16, 32}, note + " Kept: the decode tiles.")
    assert tuned_sizes(again) == {16, 32} and again.endswith(" Kept: the decode tiles.")
    assert tuned_note("X", {16}, "Untuned") == tuned_note("X", {16})
    path = configs.CONFIG_DIR / configs.config_file_name(128, 2048, 768, "fp8_w8a8_128x128",
                                                         "NVIDIA H200")
    table = json.loads(path.read_text())
    # every entry of the shipped table tuned on its device
    assert tuned_sizes(table["note"]) == {int(k) for k in table if k != "note"}
    assert {1, 16, 64, 256, 512, 8192} <= tuned_sizes(table["note"])


def test_the_tuners_decode_candidates_obey_the_fp8_rules():
    """tune-moe --fp8 tries only decode tiles that load and launch: the CUDA-core tiles and
    the MMA kernels' (a group a step), the defaults among them."""
    from benchmarks.tune_moe_fp8 import GROUP, gemv_candidates

    for gemm in ("gate_up", "down"):
        tiles = gemv_candidates(gemm, 8)
        for t in tiles:
            assert not configs.fp8_tile_problems(t, GROUP, False, decode=True), (gemm, t)
        mma = [t for t in tiles if t.get("MMA")]
        assert 0 < len(mma) < len(tiles)
    assert configs.fp8_decode_gate_up(GROUP) in gemv_candidates("gate_up", 8)
    assert configs.fp8_decode_down(GROUP) in gemv_candidates("down", 8)


def test_the_tuners_grouped_candidates_obey_the_fp8_rules():
    """tune-moe --fp8's grouped GEMM tiles load: the warp-specialised kernels' at BLOCK_M 64
    and 128, SWAP's up to 32, for both GEMMs; SWAP is refused in a bf16 table and beside WS."""
    from benchmarks.tune_moe_fp8 import GROUP, candidates

    for bm in (16, 32, 64, 128):
        for gemm in ("gate_up", "down"):
            tiles = candidates(bm, gemm)
            for t in tiles:
                assert not configs.fp8_tile_problems(t, GROUP, gemm == "gate_up"), (bm, t)
            assert any(t.get("WS") for t in tiles) == (bm >= 64), (bm, gemm)
            assert any(t.get("SWAP") for t in tiles) == (bm <= 32), (bm, gemm)
            configs.validate({"BLOCK_M": bm, "gate_up": candidates(bm, "gate_up")[-1],
                              "down": tiles[-1]}, "the tuner", GROUP)
    swap = {**candidates(16, "down")[-1], "SWAP": 1}
    assert configs.fp8_tile_problems({**swap, "WS": 1}, GROUP, False)
    with pytest.raises(ValueError, match="SWAP in a bf16 table"):
        configs.validate({"BLOCK_M": 16, "gate_up": candidates(16, "gate_up")[0], "down": swap},
                         "a table")
