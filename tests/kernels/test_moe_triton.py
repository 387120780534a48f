"""The fast expert runners against the reference runner: triton (fused kernels, GPU) and
grouped_mm (torch._grouped_mm, CPU and GPU); the align step (torch on CPU; Triton under the
interpreter when triton is installed, and on the GPU); the tile-config lookup.

Legend: N rows, K top-k, E experts (all ranks), H hidden, I intermediate.
"""

from __future__ import annotations

import collections
import importlib.util
import itertools
import json

import pytest
import torch

from interpreter import run_interpreted
from moe_cases import fake_state, make_spec  # noqa: F401 (make_spec: the kernel tests' import)
from moeserve.moe.experts import create_experts
from moeserve.kernels.moe import configs
from moeserve.kernels.moe.align_torch import align_torch
from moeserve.kernels.moe.configs import max_blocks
from moeserve.parallel.layout import ParallelLayout
from moeserve.testing.graphs import captured

ROUTINGS = ("uniform", "skewed", "padded")


def make_experts(name: str, spec, ep: int, rank: int, dtype, device, seed: int):
    """Rank `rank` of an ep-way layout (tp = ep) with fresh random weights."""
    lay = ParallelLayout(tp=ep, dp=1, ep=ep, dense_tp=ep, a2a=False)
    experts = create_experts(name, spec, fake_state(lay, rank), dtype).to(device)
    g = torch.Generator().manual_seed(seed)
    h, i = spec.hidden_size, spec.moe_intermediate_size
    w13 = torch.randn(experts.num_local, 2 * i, h, generator=g) * h ** -0.5
    w2 = torch.randn(experts.num_local, h, i, generator=g) * i ** -0.5
    experts.w13.data.copy_(w13)
    experts.w2.data.copy_(w2)
    return experts


def routing(n: int, k: int, e: int, mode: str, seed: int, device="cpu"):
    """Top-k ids [N, K] int32 (distinct per row) and weights [N, K] float32.
    skewed: every row's first choice is expert e // 2 (the first expert of EP rank 1 of 2) and
    half of the other slots are -1; padded: 30% of the slots and the last row are -1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(n, e, generator=g).topk(k, dim=1).indices.to(torch.int32)
    if mode == "skewed":
        rest = ids[:, 1:]
        rest[(rest == e // 2) | (torch.rand(n, k - 1, generator=g) < 0.5)] = -1
        ids[:, 0] = e // 2
    elif mode == "padded":
        ids[torch.rand(n, k, generator=g) < 0.3] = -1
        ids[-1] = -1
    weights = torch.rand(n, k, generator=g) + 0.05
    return ids.to(device), weights.to(device)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def check_aligned(blocks, ids: torch.Tensor, first: int, num_local: int) -> None:
    """Every owned pair appears exactly once, in a block of its expert; blocks are contiguous
    per expert; unused blocks are marked -1 with 0 rows."""
    bm = blocks.block_m
    key = ids.reshape(-1).long().cpu() - first
    own = (ids.reshape(-1).cpu() >= 0) & (key >= 0) & (key < num_local)
    expert, rows = blocks.block_expert.cpu(), blocks.block_rows.cpu()
    pairs = blocks.sorted_pairs.cpu().long()
    assert blocks.num_blocks == max_blocks(ids.numel(), bm, num_local)
    seen = []
    for b in range(blocks.num_blocks):
        e, r = int(expert[b]), int(rows[b])
        if e < 0:
            assert r == 0
            continue
        assert 1 <= r <= bm
        p = pairs[b * bm: b * bm + r]
        assert (key[p] == e).all()
        seen += p.tolist()
    assert sorted(seen) == torch.nonzero(own).flatten().tolist()
    used = expert[expert >= 0]
    assert (used[1:] >= used[:-1]).all()
    assert (expert[len(used):] == -1).all()


# --- CPU ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k,e,ep_rank,bm", [(1, 8, 128, None, 16), (9, 2, 8, None, 16),
                                              (33, 4, 16, 1, 16), (300, 6, 64, 0, 64),
                                              (1000, 2, 8, 1, 128)])
@pytest.mark.parametrize("mode", ROUTINGS)
def test_align_torch_groups_every_owned_pair(n, k, e, ep_rank, bm, mode):
    ids, _ = routing(n, k, e, mode, seed=n + k)
    first, num_local = (0, e) if ep_rank is None else (ep_rank * e // 2, e // 2)
    check_aligned(align_torch(ids, first, num_local, bm), ids, first, num_local)


def test_align_torch_all_rows_on_one_expert_fill_whole_blocks():
    ids = torch.full((100, 1), 3, dtype=torch.int32)
    blocks = align_torch(ids, 0, 8, 16)
    assert blocks.block_expert[:7].tolist() == [3] * 7
    assert blocks.block_rows[:7].tolist() == [16] * 6 + [4]
    assert (blocks.block_expert[7:] == -1).all()
    assert blocks.sorted_pairs[:100].tolist() == list(range(100))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("ep,rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("mode", ROUTINGS)
@pytest.mark.parametrize("in_order", [False, True])
def test_grouped_mm_runner_matches_reference_on_cpu(dtype, tol, ep, rank, mode, in_order):
    """in_order: the top-k sum of --enable-deterministic-inference (rows back in pair order,
    summed over k) in place of index_add_."""
    spec = make_spec()
    ref = make_experts("reference", spec, ep, rank, torch.float32, "cpu", seed=7)
    gmm = make_experts("grouped_mm", spec, ep, rank, dtype, "cpu", seed=7)
    gmm.deterministic = in_order
    ref.w13.data.copy_(gmm.w13.float())
    ref.w2.data.copy_(gmm.w2.float())
    x = torch.randn(37, spec.hidden_size).to(dtype)
    ids, w = routing(37, spec.top_k, spec.num_experts, mode, seed=11)
    y = gmm(x, ids, w)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert rel_err(y, ref(x.float(), ids, w)) <= tol


def test_triton_runner_refuses_cpu_tensors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = make_spec()
    experts = make_experts("triton", spec, 1, 0, torch.float32, "cpu", seed=1)
    ids, w = routing(2, spec.top_k, spec.num_experts, "uniform", seed=1)
    with pytest.raises(ValueError, match="needs CUDA"):
        experts(torch.randn(2, spec.hidden_size), ids, w)


def test_one_row_decode_defaults_are_the_shipped_tables_most_common_tiles():
    """An untuned shape at one row takes the GEMV tiles that most shipped bf16 tables chose
    there (the tables' tiles as (BLOCK_N, BLOCK_K, num_warps), gate_up and down apart)."""
    picks: dict[str, collections.Counter] = {"gate_up": collections.Counter(),
                                             "down": collections.Counter()}
    for path in configs.CONFIG_DIR.glob("*dtype=bfloat16*.json"):
        entry = json.loads(path.read_text()).get("1", {}).get("decode")
        for gemv in picks if entry else ():
            picks[gemv][tuple(entry[gemv][k] for k in configs.DECODE_KEYS)] += 1
    assert sum(picks["down"].values()) >= 5
    default = configs.default_config(1, 8, 128)["decode"]
    for gemv, counts in picks.items():
        assert tuple(default[gemv][k] for k in configs.DECODE_KEYS) == \
            counts.most_common(1)[0][0], (gemv, counts)


def test_tiles_source_names_the_tuned_table_or_the_one_tune_moe_would_write(tmp_path):
    name = configs.config_file_name(128, 2048, 384, torch.bfloat16, "NVIDIA H200")
    src = lambda device, quant=None: configs.tiles_source(  # noqa: E731
        128, 2048, 384, torch.bfloat16, device, quant, config_dir=tmp_path)
    assert src("NVIDIA H200") == (f"defaults: no tuned table {name} (`python -m benchmarks "
                                  "tune-moe` writes it)")
    (tmp_path / name).write_text(json.dumps({"1": configs.default_config(1, 8, 128)}))
    configs.load_tuned.cache_clear()
    assert src("NVIDIA H200") == f"tuned ({name})"
    assert "fp8_w8a8_128x128" in src("NVIDIA H200", (128, 128))
    assert "tune-moe --fp8" in src("NVIDIA H200", (128, 128))
    assert src(None).startswith("the tuned table of E=128,H=2048,I=384,dtype=bfloat16 for "
                                "the GPU it runs on")
    shipped = configs.tiles_source(128, 2048, 768, torch.bfloat16, "NVIDIA H200")
    assert shipped.startswith("tuned (") and (configs.CONFIG_DIR / shipped[7:-1]).is_file()


def test_configs_nearest_entry_and_defaults(tmp_path):
    table = {"1": configs.default_config(1, 8, 128), "64": configs.default_config(64, 8, 128),
             "4096": configs.default_config(4096, 8, 128)}
    table["64"]["BLOCK_M"] = 32
    name = configs.config_file_name(128, 2048, 768, torch.bfloat16, "NVIDIA H200")
    assert name == "E=128,H=2048,I=768,dtype=bfloat16,device=NVIDIA_H200.json"
    (tmp_path / name).write_text(json.dumps(table))
    get = lambda n: configs.get_config(n, 8, 128, 2048, 768, torch.bfloat16, "NVIDIA H200",
                                       config_dir=tmp_path)
    assert get(1)["BLOCK_M"] == 16 and get(50)["BLOCK_M"] == 32 and get(90)["BLOCK_M"] == 32
    assert get(8192)["BLOCK_M"] == table["4096"]["BLOCK_M"]
    other = configs.get_config(64, 8, 128, 2048, 768, torch.bfloat16, "NVIDIA H100",
                               config_dir=tmp_path)
    assert other == configs.default_config(64, 8, 128)
    (tmp_path / name).write_text(json.dumps({"8": {"BLOCK_M": 16, "gate_up": {}}}))
    configs.load_tuned.cache_clear()
    with pytest.raises(ValueError, match="lacks down"):
        get(8)
    bad = {**configs.default_config(1, 8, 128), "decode": {"gate_up": {"BLOCK_N": 16}}}
    (tmp_path / name).write_text(json.dumps({"1": bad}))
    configs.load_tuned.cache_clear()
    with pytest.raises(ValueError, match="decode.gate_up.BLOCK_K"):
        get(1)
    half = configs.default_config(64, 8, 128)  # BLOCK_M 16: no half tile of 8 rows
    half["down"]["HALF_TAIL"] = 1
    (tmp_path / name).write_text(json.dumps({"64": half}))
    configs.load_tuned.cache_clear()
    with pytest.raises(ValueError, match="HALF_TAIL for down with BLOCK_M 16"):
        get(64)
    for gemm, tma in [("down", 1), ("gate_up", 0)]:  # only gate_up by TMA pairs w13's halves
        paired = configs.default_config(4096, 8, 128)
        paired[gemm].update(TMA=tma, PAIRED=1)
        (tmp_path / name).write_text(json.dumps({"4096": paired}))
        configs.load_tuned.cache_clear()
        with pytest.raises(ValueError, match="sets PAIRED where it has no meaning"):
            get(4096)
    for gemm, block_m in [("gate_up", 128), ("down", 32)]:  # the Gluon kernel: down, M >= 64
        ws = configs.default_config(4096, 8, 128)
        ws[gemm]["WS"] = 1
        ws["BLOCK_M"] = block_m
        (tmp_path / name).write_text(json.dumps({"4096": ws}))
        configs.load_tuned.cache_clear()
        with pytest.raises(ValueError, match="sets WS where it cannot run"):
            get(4096)
    summed = configs.default_config(4096, 8, 128)  # ATOMIC_SUM: down's only
    summed["gate_up"]["ATOMIC_SUM"] = 1
    (tmp_path / name).write_text(json.dumps({"4096": summed}))
    configs.load_tuned.cache_clear()
    with pytest.raises(ValueError, match="sets ATOMIC_SUM for gate_up"):
        get(4096)
    for where in ("gate_up", "down", "decode.down"):  # PREFETCH: the decode gate_up's only
        pf = configs.default_config(1, 8, 128)
        (pf["decode"]["down"] if where == "decode.down" else pf[where])["PREFETCH"] = 1
        (tmp_path / name).write_text(json.dumps({"1": pf}))
        configs.load_tuned.cache_clear()
        with pytest.raises(ValueError, match=f"sets PREFETCH for {where}:"):
            get(1)
    configs.load_tuned.cache_clear()


def test_rows_writing_pairs_end_where_the_table_sums_the_top_k_in_down(tmp_path):
    """The most rows of a step whose nearest tuned entry writes every pair's row (no
    ATOMIC_SUM): what the plan sizes moe.runner.down for."""
    plain = configs.default_config(4096, 8, 128)
    summed = {**plain, "down": {**plain["down"], "ATOMIC_SUM": 1}}
    name = configs.config_file_name(128, 2048, 768, torch.bfloat16, "GPU X")
    rows = lambda n: configs.rows_writing_pairs(n, 128, 2048, 768, "bfloat16", "GPU X",
                                                tmp_path)

    def table(**entries):
        (tmp_path / name).write_text(json.dumps({k[1:]: v for k, v in entries.items()}))
        configs.load_tuned.cache_clear()

    assert rows(5000) == 5000  # no table for the device
    assert configs.rows_writing_pairs(5000, 128, 2048, 768, "bfloat16", None, tmp_path) == 5000
    table(_512=plain, _1024=summed, _4096=summed)
    get = lambda n: configs.get_config(n, 8, 128, 2048, 768, torch.bfloat16, "GPU X",
                                       config_dir=tmp_path)
    assert rows(16384) == rows(725) == 724 and rows(700) == 700
    assert "ATOMIC_SUM" not in get(724)["down"] and get(725)["down"]["ATOMIC_SUM"]
    table(_512=plain, _1024=summed, _2048=plain, _4096=summed)
    assert rows(16384) == 2896 and rows(2000) == 2000 and rows(1000) == 724
    assert "ATOMIC_SUM" not in get(2896)["down"] and get(2897)["down"]["ATOMIC_SUM"]
    table(_512=summed, _8192=plain)
    assert rows(16384) == 16384 and rows(1000) == 0
    configs.load_tuned.cache_clear()


def test_gemv_rows_end_where_the_table_leaves_the_gemv_path(tmp_path):
    """The most rows of a step whose nearest tuned entry takes the GEMV path: what the plan
    sizes an fp8 runner's moe.runner.act_f32 for; the defaults' bound without a table."""
    plain = configs.default_config(64, 8, 128)
    gemv = configs.default_config(1, 8, 128)
    assert "decode" in gemv and "decode" not in plain
    name = configs.config_file_name(128, 2048, 768, torch.bfloat16, "GPU X")
    rows = lambda n: configs.gemv_rows(n, 8, 128, 2048, 768, "bfloat16", "GPU X", tmp_path)
    assert rows(5000) == 2  # no table: 128 // (8 x 8), as decode_suits
    assert configs.gemv_rows(1, 8, 512, 2048, 768, "bfloat16", None, tmp_path) == 1
    (tmp_path / name).write_text(json.dumps({"1": gemv, "2": gemv, "4": plain}))
    configs.load_tuned.cache_clear()
    get = lambda n: configs.get_config(n, 8, 128, 2048, 768, torch.bfloat16, "GPU X",
                                       config_dir=tmp_path)
    assert rows(5000) == 2 and rows(1) == 1
    assert "decode" in get(2) and "decode" not in get(3)
    (tmp_path / name).write_text(json.dumps({"4": plain}))
    configs.load_tuned.cache_clear()
    assert rows(5000) == 0
    configs.load_tuned.cache_clear()


def test_deterministic_runner_writes_every_pair_where_the_table_sums_atomically(
        tmp_path, monkeypatch):
    """--enable-deterministic-inference: the fused runner takes the tuned entry without its
    ATOMIC_SUM (down writes each pair's row, the top-k pass sums them in order), and the
    rest of the entry as tuned."""
    from moeserve.moe.experts import triton_fused

    plain = configs.default_config(4096, 4, 16)
    summed = {**plain, "down": {**plain["down"], "ATOMIC_SUM": 1}}
    spec = make_spec(e=16, k=4, h=256, i=192)
    name = configs.config_file_name(16, 256, 192, torch.bfloat16, "GPU X")
    monkeypatch.setattr(triton_fused, "_device", lambda device: ("GPU X", (9, 0)))
    (tmp_path / name).write_text(json.dumps({"512": plain, "1024": summed}))
    configs.load_tuned.cache_clear()
    try:
        runs = [make_experts("triton", spec, 1, 0, torch.bfloat16, "cpu", 0) for _ in (0, 1)]
        for run in runs:
            run.config_dir = tmp_path
        runs[1].deterministic = True
        cpu = torch.device("cpu")
        assert runs[0].config_for(2000, cpu) == summed
        assert runs[1].config_for(2000, cpu) == plain
        assert runs[1].config_for(300, cpu) == runs[0].config_for(300, cpu) == plain
    finally:
        configs.load_tuned.cache_clear()


def test_default_config_takes_the_gemv_path_only_where_pairs_rarely_share_experts():
    assert "decode" in configs.default_config(1, 2, 8)  # one row: ids distinct
    assert "decode" in configs.default_config(2, 8, 128)  # 16 pairs over 128 experts
    assert "decode" not in configs.default_config(2, 2, 8)  # Mixtral, 2 rows: often shared
    assert "decode" not in configs.default_config(64, 8, 128)


def test_hopper_defaults_take_the_sm90_tiles_past_48_rows_an_expert():
    """Without a table, a compute capability 9.x device gets the tiles the shipped H100 / H200
    tables share (TMA, PAIRED, WS from 192 rows an expert); other devices, and the small
    tiles, stay as they were; every default is a valid config."""
    for n, k, e in itertools.product([1, 2, 8, 64, 200, 1000, 4096, 8192], [2, 8], [8, 60, 128]):
        plain, hopper = (configs.default_config(n, k, e, hopper=h) for h in (False, True))
        for cfg in (plain, hopper):
            configs.validate(cfg, "default")
        rows = n * k / min(e, n * k)
        if rows <= 48:
            assert hopper == plain
        else:
            assert hopper["gate_up"].get("PAIRED") and hopper["down"].get("TMA")
            assert bool(hopper["down"].get("WS")) == (rows > 192) == (hopper["BLOCK_M"] == 128)
            assert not any(plain[g].get("TMA") for g in ("gate_up", "down"))
    get = lambda cap, dev="NVIDIA H20": configs.get_config(8192, 8, 128, 4096, 1536,
                                                          torch.bfloat16, dev, cap)
    assert get((9, 0)) == configs.default_config(8192, 8, 128, hopper=True)
    assert get((8, 0)) == get(None) == configs.default_config(8192, 8, 128)
    shipped = configs.get_config(8192, 8, 128, 2048, 768, torch.bfloat16, "NVIDIA H200")
    assert configs.get_config(8192, 8, 128, 2048, 768, torch.bfloat16, "NVIDIA H200",
                              (9, 0)) == shipped  # a table wins over the defaults


@pytest.mark.parametrize("device,shape,max_tokens,cap", [
    ("NVIDIA H200", (128, 2048, 768), 16384, (9, 0)),  # a shipped table, max past its largest
    ("NVIDIA H200", (64, 2048, 1408), 3000, (9, 0)),  # a shipped table, max between its keys
    ("NVIDIA H100", (128, 2048, 768), 5000, None),  # no table: the defaults
    ("NVIDIA H20", (128, 2048, 768), 5000, (9, 0))])  # no table: the Hopper defaults
def test_warm_up_sizes_reach_every_config_a_step_can_take(device, shape, max_tokens, cap):
    """The warm-up runs each distinct config once, at a size that takes it, within the bound:
    after it, no step of 1..max_tokens rows meets an uncompiled config."""
    e, h, i = shape
    get = lambda n: json.dumps(configs.get_config(n, 8, e, h, i, torch.bfloat16, device, cap),
                               sort_keys=True)
    sizes = configs.warm_up_sizes(max_tokens, 8, e, h, i, torch.bfloat16, device, cap)
    assert sizes == sorted(sizes) and 1 <= sizes[0] and sizes[-1] <= max_tokens
    warmed = [get(n) for n in sizes]
    assert len(set(warmed)) == len(warmed)  # no config twice
    assert {get(n) for n in range(1, max_tokens + 1)} == set(warmed)


def test_shipped_tile_configs_are_complete():
    for path in sorted(configs.CONFIG_DIR.glob("*.json")):
        group = configs.fp8_group(path.name.split("dtype=")[1].split(",")[0])  # fp8 tables'
        for key, cfg in json.loads(path.read_text()).items():
            if key != "note":  # BLOCK_M among configs.BLOCK_MS included
                configs.validate(cfg, str(path), group)


_INTERPRETER_SCRIPT = r"""
import itertools
import torch
from test_moe_triton import check_aligned, make_experts, make_spec, rel_err, routing
from moeserve.kernels.moe.align import align_triton, one_program
from moeserve.kernels.moe.align_torch import align_torch

for n, k, e, first, num_local, bm in [(1, 8, 128, 0, 128, 16), (40, 4, 16, 8, 8, 16),
                                      (700, 2, 8, 0, 8, 64), (250, 8, 64, 32, 32, 32),
                                      (3000, 2, 8, 0, 8, 16)]:  # 6 chunks of pairs
    for mode in ("uniform", "skewed", "padded"):
        ids, _ = routing(n, k, e, mode, seed=n)
        got, want = align_triton(ids, first, num_local, bm), align_torch(ids, first, num_local, bm)
        check_aligned(got, ids, first, num_local)
        assert torch.equal(got.block_expert, want.block_expert)
        assert torch.equal(got.block_rows, want.block_rows)
assert one_program(1 * 8) and one_program(250 * 8) and not one_program(3000 * 2)  # both ran
for ids in (torch.full((5, 2), -1, dtype=torch.int32), torch.zeros(5, 2, dtype=torch.int32)):
    got, want = align_triton(ids, 8, 8, 16), align_torch(ids, 8, 8, 16)  # no pair is owned
    assert torch.equal(got.block_expert, want.block_expert) and (got.block_expert < 0).all()
    assert torch.equal(got.block_rows, want.block_rows)
for act, (ep, rank), n, h in [("silu", (1, 0), 5, 48), ("gelu", (2, 1), 70, 48),
                              ("gelu_pytorch_tanh", (1, 0), 3, 48), ("silu", (2, 0), 300, 128)]:
    spec = make_spec(e=8, k=2, h=h, i=40, act=act)
    ref = make_experts("reference", spec, ep, rank, torch.float32, "cpu", seed=3)
    tri = make_experts("triton", spec, ep, rank, torch.float32, "cpu", seed=3)
    for mode in ("uniform", "skewed", "padded"):
        x = torch.randn(n, spec.hidden_size)
        ids, w = routing(n, 2, 8, mode, seed=n)
        err = rel_err(tri(x, ids, w), ref(x, ids, w))
        assert err <= 1e-4, (act, ep, n, mode, err)
# the GEMV decode path (decode_moe.py), forced at any row count; K and N not block multiples;
# the down GEMV with its first tiles read before the PDL gate (small tiles) and after (large)
from moeserve.kernels.moe.fused_moe import fused_experts
small = {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4},
         "down": {"BLOCK_N": 8, "BLOCK_K": 16, "num_warps": 2}}
large = {**small, "down": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 1}}
ahead = {**small, "gate_up": {**small["gate_up"], "PREFETCH": 1}}  # the next chunk loaded first
narrow = {**small, "down": {"BLOCK_N": 2, "BLOCK_K": 32, "num_warps": 1}}  # one-row width
for gemv, act, (ep, rank), n, h in [(small, "silu", (1, 0), 1, 48),
                                    (narrow, "silu", (1, 0), 1, 48),
                                    (large, "silu", (1, 0), 1, 48),
                                    (small, "gelu", (2, 1), 4, 40),
                                    (large, "silu", (2, 0), 7, 64),
                                    (ahead, "silu", (1, 0), 1, 48),
                                    (ahead, "silu", (2, 1), 3, 40)]:
    spec = make_spec(e=8, k=2, h=h, i=40, act=act)
    ref = make_experts("reference", spec, ep, rank, torch.float32, "cpu", seed=5)
    tri = make_experts("triton", spec, ep, rank, torch.float32, "cpu", seed=5)
    for mode in ("uniform", "skewed", "padded"):
        x = torch.randn(n, spec.hidden_size)
        ids, w = routing(n, 2, 8, mode, seed=n + 1)
        y = fused_experts(x, tri.w13, tri.w2, ids, w, tri.first_expert, tri.kernel_act,
                          {"decode": gemv})
        err = rel_err(y, ref(x, ids, w))
        assert err <= 1e-4, ("decode", act, ep, n, mode, err)
        if mode == "padded":
            assert (y[-1] == 0).all()  # a row with only -1 ids gets 0
# the grouped GEMMs with their weights through TMA descriptors; PAIRED: gate_up's two halves
# in one [2, BLOCK_N, BLOCK_K] tile (I = 40 leaves a part-empty last tile of each half)
tma = {"BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 2, "TMA": 1}
for (n, (ep, rank), h), paired in itertools.product([(9, (1, 0), 48), (40, (2, 1), 64)], (0, 1)):
    spec = make_spec(e=8, k=2, h=h, i=40)
    ref = make_experts("reference", spec, ep, rank, torch.float32, "cpu", seed=6)
    tri = make_experts("triton", spec, ep, rank, torch.float32, "cpu", seed=6)
    x = torch.randn(n, spec.hidden_size)
    ids, w = routing(n, 2, 8, "padded", seed=n)
    y = fused_experts(x, tri.w13, tri.w2, ids, w, tri.first_expert, "silu",
                      {"BLOCK_M": 16, "gate_up": {**tma, "PAIRED": paired},
                       "down": {**tma, "BLOCK_N": 32}})
    err = rel_err(y, ref(x, ids, w))
    assert err <= 1e-4, ("tma", n, ep, paired, err)


# fused_experts under cfg against the reference (E 8, top-2, H 48, I 40) on each routing; a
# row whose ids are all -1 (padded) gets 0
def check_grouped(what, n, ep, rank, cfg, seed):
    spec = make_spec(e=8, k=2, h=48, i=40)
    ref = make_experts("reference", spec, ep, rank, torch.float32, "cpu", seed=seed)
    tri = make_experts("triton", spec, ep, rank, torch.float32, "cpu", seed=seed)
    for mode in ("uniform", "skewed", "padded"):
        x = torch.randn(n, spec.hidden_size)
        ids, w = routing(n, 2, 8, mode, seed=n + seed)
        y = fused_experts(x, tri.w13, tri.w2, ids, w, tri.first_expert, "silu", cfg)
        err = rel_err(y, ref(x, ids, w))
        assert err <= 1e-4, (what, n, ep, cfg["BLOCK_M"], mode, err)
        if mode == "padded":
            assert (y[-1] == 0).all(), what
    return tri, x, ids, w


# half tiles for an expert's last block when it holds at most BLOCK_M / 2 rows; by pointer
# loads and by TMA; 1-3 rows an expert give only such tails, 60 some full blocks beside them
for n, tma_on, block_m in [(3, 0, 32), (60, 1, 32), (60, 0, 64)]:
    half = {**tma, "TMA": tma_on, "HALF_TAIL": 1}
    tri, x, ids, w = check_grouped("half tail", n, 1, 0,
                                   {"BLOCK_M": block_m, "gate_up": half, "down": half}, seed=8)
try:
    fused_experts(x, tri.w13, tri.w2, ids, w, tri.first_expert, "silu",
                  {"BLOCK_M": 16, "gate_up": half, "down": half})
except ValueError as exc:
    assert "HALF_TAIL needs BLOCK_M >= 32" in str(exc), exc
else:
    raise AssertionError("a half tile of 8 rows was launched")
# down adding each pair's row into its token's row (ATOMIC_SUM: no top-k sum pass), on EP
# ranks, with -1 ids, half tiles
for n, (ep, rank), block_m, half_tail in [(9, (1, 0), 16, 0), (60, (2, 1), 32, 1),
                                          (300, (2, 0), 64, 0)]:
    summed = {**tma, "TMA": 0, "HALF_TAIL": half_tail, "ATOMIC_SUM": 1}
    check_grouped("atomic sum", n, ep, rank, {"BLOCK_M": block_m, "gate_up": tma,
                                              "down": summed}, seed=9)
# the intermediates in a plan-sized workspace (as the model runner hands them over): the same
# bits as allocating them, and a workspace one row short refused with the record's name
from moeserve.kernels.moe.align_torch import Workspace
from moeserve.kernels.moe.configs import BLOCK_MS, align_scratch_len, max_blocks, padded_rows
spec = make_spec(e=8, k=2, h=48, i=40)
tri = make_experts("triton", spec, 2, 1, torch.float32, "cpu", seed=7)
grouped = {"BLOCK_M": 16, "gate_up": {**tma, "TMA": 0}, "down": {**tma, "TMA": 0}}
# 260 rows: 520 pairs, align's large path (its scratch in the workspace)
for n, cfg in [(30, grouped), (260, {**grouped, "BLOCK_M": 64}), (3, {"decode": small})]:
    p = n * 2
    def workspace(short=0):
        b = max(max_blocks(p, m, 4) for m in BLOCK_MS)
        return Workspace(torch.empty(padded_rows(p, 4) - short, dtype=torch.int32),
                         torch.empty(b, dtype=torch.int32), torch.empty(b, dtype=torch.int32),
                         torch.empty(padded_rows(p, 4) - short, 40), torch.empty(p, 48),
                         torch.empty(align_scratch_len(p, 4), dtype=torch.int32))
    x = torch.randn(n, 48)
    ids, w = routing(n, 2, 8, "skewed", seed=n)
    args = (x, tri.w13, tri.w2, ids, w, tri.first_expert, "silu", cfg)
    assert torch.equal(fused_experts(*args, workspace()), fused_experts(*args))
    short = padded_rows(p, 4) - (p if "decode" in cfg else max_blocks(p, cfg["BLOCK_M"], 4)
                                 * cfg["BLOCK_M"]) + 1
    try:
        fused_experts(*args, workspace(short))
    except RuntimeError as exc:
        assert "moe.runner." in str(exc) and "token budget" in str(exc), exc
    else:
        raise AssertionError("a workspace too small was taken")
print("interpreter ok")
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernels_under_the_interpreter():
    """The Triton align and GEMM kernels on the CPU (TRITON_INTERPRET=1: numpy semantics)."""
    run_interpreted(_INTERPRETER_SCRIPT, timeout=280)


# --- GPU ----------------------------------------------------------------------------------

def _gpu_pair(name: str, spec, ep: int, rank: int, seed: int):
    """(fast runner in bf16, reference runner in fp32 holding the same bf16 weights)."""
    fast = make_experts(name, spec, ep, rank, torch.bfloat16, "cuda", seed)
    ref = make_experts("reference", spec, ep, rank, torch.float32, "cuda", seed)
    ref.w13.data.copy_(fast.w13.float())
    ref.w2.data.copy_(fast.w2.float())
    return fast, ref


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "grouped_mm"])
@pytest.mark.parametrize("ep,rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("mode", ROUTINGS)
@pytest.mark.parametrize("n", [1, 2, 7, 64, 129, 1000, 4096])
@pytest.mark.parametrize("shape", [dict(e=16, k=4, h=256, i=192), dict(e=16, k=2, h=328, i=200)])
def test_fast_runner_matches_reference_on_gpu(name, ep, rank, mode, n, shape):
    torch.backends.cuda.matmul.allow_tf32 = False
    spec = make_spec(**shape)
    fast, ref = _gpu_pair(name, spec, ep, rank, seed=n)
    x = torch.randn(n, spec.hidden_size, device="cuda").bfloat16()
    ids, w = routing(n, spec.top_k, spec.num_experts, mode, seed=n + 1, device="cuda")
    y = fast(x, ids, w)
    want = ref(x.float(), ids, w)
    assert y.dtype == torch.bfloat16 and y.shape == want.shape
    assert torch.isfinite(y).all()
    assert rel_err(y, want) <= 1e-2
    assert ((want == 0).all(dim=1) <= (y == 0).all(dim=1)).all()  # rows with nothing stay 0


@pytest.mark.gpu
@pytest.mark.parametrize("n", [3, 700])
def test_triton_align_equals_torch_align_on_gpu(n):
    from moeserve.kernels.moe.align import align_triton

    for mode in ROUTINGS:
        ids, _ = routing(n, 8, 128, mode, seed=n, device="cuda")
        for first, num_local in [(0, 128), (64, 64)]:
            for bm in (16, 64):
                got = align_triton(ids, first, num_local, bm)
                want = align_torch(ids, first, num_local, bm)
                check_aligned(got, ids, first, num_local)
                assert torch.equal(got.block_expert, want.block_expert)
                assert torch.equal(got.block_rows, want.block_rows)


def _replayed_on_new_routings(graph, ids, w, num_experts: int, seed: int):
    """Yields each routing mode after copying a new routing of it into ids and w (the graph's
    inputs) and replaying the graph."""
    for mode in ROUTINGS:
        new_ids, new_w = routing(ids.shape[0], ids.shape[1], num_experts, mode, seed=seed,
                                 device="cuda")
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        yield mode


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "grouped_mm"])
def test_fast_runner_replays_in_a_cuda_graph(name):
    """No host synchronisation: the forward captures, and a replay on new inputs (new routing
    included) gives what an eager call gives."""
    spec = make_spec(e=16, k=4, h=256, i=192)
    fast, _ = _gpu_pair(name, spec, 1, 0, seed=5)
    x = torch.randn(48, spec.hidden_size, device="cuda").bfloat16()
    ids, w = routing(48, 4, 16, "uniform", seed=1, device="cuda")
    fast(x, ids, w)  # compile outside the capture
    graph, y = captured(lambda: fast(x, ids, w))
    for mode in ROUTINGS:
        new_ids, new_w = routing(48, 4, 16, mode, seed=9, device="cuda")
        x.copy_(torch.randn_like(x))
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        exact = dict(rtol=0, atol=0) if name == "triton" else {}  # index_add_ order varies
        torch.testing.assert_close(y, fast(x, ids, w), **exact)


@pytest.mark.gpu
def test_triton_duplicate_ids_add_up():
    spec = make_spec(e=16, k=2, h=256, i=192)
    fast, _ = _gpu_pair("triton", spec, 1, 0, seed=3)
    x = torch.randn(1, spec.hidden_size, device="cuda").bfloat16()
    w = torch.tensor([[0.3, 0.5]], device="cuda")
    twice = fast(x, torch.tensor([[4, 4]], dtype=torch.int32, device="cuda"), w)
    once = fast(x, torch.tensor([[4, -1]], dtype=torch.int32, device="cuda"),
                torch.tensor([[0.8, 0.1]], device="cuda"))
    assert rel_err(twice, once) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [(16, 256, 4, 16, 256, 4), (8, 128, 2, 4, 512, 4),
                                   (32, 64, 8, 32, 128, 8), (16, 128, 8, 2, 128, 4)])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_triton_decode_path_at_any_rows(tiles, prefetch):
    """The GEMV kernels (decode_moe.py) with tiles the tuner may pick, gate_up with and
    without PREFETCH, forced at row counts where pairs share experts, on an EP rank (ids of
    the other rank skipped) and with -1s."""
    from moeserve.kernels.moe.fused_moe import fused_experts

    spec = make_spec(e=16, k=4, h=328, i=200)
    fast, ref = _gpu_pair("triton", spec, 2, 1, seed=sum(tiles))
    keys = ("BLOCK_N", "BLOCK_K", "num_warps")
    cfg = {"decode": {"gate_up": {**dict(zip(keys, tiles[:3])), "PREFETCH": prefetch},
                      "down": dict(zip(keys, tiles[3:]))}}
    for n in (1, 2, 5, 33):
        for mode in ROUTINGS:
            x = torch.randn(n, spec.hidden_size, device="cuda").bfloat16()
            ids, w = routing(n, 4, 16, mode, seed=n, device="cuda")
            y = fused_experts(x, fast.w13, fast.w2, ids, w, fast.first_expert, "silu", cfg)
            want = ref(x.float(), ids, w)
            assert rel_err(y, want) <= 1e-2, (n, mode)
            assert ((want == 0).all(dim=1) <= (y == 0).all(dim=1)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("tma,paired", [(0, 0), (1, 0), (1, 1)])
@pytest.mark.parametrize("half_tail", [0, 1])
def test_triton_every_block_m_and_tile(block_m, tma, paired, half_tail):
    """Tile configs the tuner may pick (any BLOCK_M up to 256, weights by pointer loads or
    TMA, gate_up's halves in one MMA, half tiles for short last blocks) compute the same
    function."""
    from moeserve.kernels.moe.fused_moe import fused_experts

    if half_tail and block_m < 32:
        pytest.skip("a half tile needs BLOCK_M >= 32")
    spec = make_spec(e=16, k=4, h=256, i=192)
    fast, ref = _gpu_pair("triton", spec, 2, 1, seed=block_m)
    gemm = {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8 if block_m > 64 else 4,
            "num_stages": 3, "TMA": tma, "HALF_TAIL": half_tail}
    cfg = {"BLOCK_M": block_m, "gate_up": {**gemm, "PAIRED": paired},
           "down": {**gemm, "BLOCK_N": 128}}
    for n, mode in [(3, "uniform"), (600, "skewed"), (2000, "padded")]:
        x = torch.randn(n, spec.hidden_size, device="cuda").bfloat16()
        ids, w = routing(n, 4, 16, mode, seed=n, device="cuda")
        y = fused_experts(x, fast.w13, fast.w2, ids, w, fast.first_expert, "silu", cfg)
        assert rel_err(y, ref(x.float(), ids, w)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("shape,block_n", [(dict(e=16, k=4, h=256, i=192), 128),
                                           (dict(e=8, k=2, h=512, i=200), 256),
                                           (dict(e=16, k=2, h=328, i=200), 128)])
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("half_tail", [0, 1])
def test_warp_specialised_down_computes_the_triton_down(shape, block_n, block_m, half_tail):
    """down by the Gluon kernel (down_ws.py: persistent, warp-specialised; sm90) against the
    Triton kernel and the reference: on an EP rank (other ranks' ids skipped), with -1 ids, a
    K (200) that is no multiple of BLOCK_K, and a hidden (328) that is no multiple of BLOCK_N,
    where it must fall back (and with half tiles at BLOCK_M 64); replayed in a CUDA graph on
    new routings."""
    from moeserve.kernels.moe import down_ws
    from moeserve.kernels.moe.fused_moe import fused_experts

    spec = make_spec(**shape)
    fast, ref = _gpu_pair("triton", spec, 2, 1, seed=block_m + block_n)
    gemm = {"BLOCK_N": block_n, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3,
            "TMA": 1, "HALF_TAIL": half_tail}
    plain = {"BLOCK_M": block_m, "gate_up": {**gemm, "BLOCK_N": 64}, "down": gemm}
    ws = {**plain, "down": {**gemm, "WS": 1}}
    h = torch.empty(block_m, spec.moe_intermediate_size, device="cuda", dtype=torch.bfloat16)
    assert down_ws.usable(fast.w2, h, ws["down"], block_m) == (
        spec.hidden_size % block_n == 0 and not (half_tail and block_m < 128))
    e, k = spec.num_experts, spec.top_k
    for n, mode in [(3, "uniform"), (300, "skewed"), (2000, "padded")]:
        x = torch.randn(n, spec.hidden_size, device="cuda").bfloat16()
        ids, w = routing(n, k, e, mode, seed=n, device="cuda")
        args = (x, fast.w13, fast.w2, ids, w, fast.first_expert, "silu")
        y = fused_experts(*args, ws)
        assert rel_err(y, fused_experts(*args, plain)) <= 1e-3, (n, mode)
        assert rel_err(y, ref(x.float(), ids, w)) <= 1e-2, (n, mode)
    graph, y = captured(lambda: fused_experts(*args, ws))
    for _ in _replayed_on_new_routings(graph, ids, w, e, seed=11):
        torch.testing.assert_close(y, fused_experts(*args, ws), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("ws", [0, 1])
@pytest.mark.parametrize("block_m,half_tail", [(64, 0), (128, 1)])
def test_atomic_sum_down_gives_the_top_k_pass_result(ws, block_m, half_tail):
    """down adding its rows into the output ("ATOMIC_SUM", bf16 atomics; by the Gluon kernel
    on sm90 with WS, else Triton's) against down + the top-k pass and the reference: on an EP
    rank, with -1 ids and rows of no owned pair (which stay 0); in a CUDA graph on new
    routings (the order of the adds varies, so within rounding rather than bit for bit)."""
    from moeserve.kernels.moe.fused_moe import fused_experts

    spec = make_spec(e=16, k=4, h=512, i=192)
    fast, ref = _gpu_pair("triton", spec, 2, 1, seed=block_m + ws)
    gemm = {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3,
            "TMA": 1, "HALF_TAIL": half_tail}
    plain = {"BLOCK_M": block_m, "gate_up": gemm, "down": {**gemm, "WS": ws}}
    summed = {**plain, "down": {**plain["down"], "ATOMIC_SUM": 1}}
    for n, mode in [(3, "uniform"), (300, "skewed"), (2000, "padded")]:
        x = torch.randn(n, spec.hidden_size, device="cuda").bfloat16()
        ids, w = routing(n, 4, 16, mode, seed=n, device="cuda")
        args = (x, fast.w13, fast.w2, ids, w, fast.first_expert, "silu")
        y = fused_experts(*args, summed)
        assert y.shape == (n, spec.hidden_size) and y.dtype == torch.bfloat16
        assert rel_err(y, fused_experts(*args, plain)) <= 1e-2, (n, mode)
        assert rel_err(y, ref(x.float(), ids, w)) <= 1e-2, (n, mode)
        mine = ((ids >= fast.first_expert) & (ids < fast.first_expert + 8)).any(1)
        assert (y[~mine] == 0).all() and mine.any()
    graph, y = captured(lambda: fused_experts(*args, summed))
    for mode in _replayed_on_new_routings(graph, ids, w, 16, seed=12):
        assert rel_err(y, fused_experts(*args, plain)) <= 1e-2, mode


@pytest.mark.gpu
def test_deterministic_runner_gives_the_same_bits_every_run(tmp_path):
    """On this GPU, under a tuned table whose entry sums the top-k in down with atomics: the
    runner of --enable-deterministic-inference gives the bits of down + the top-k pass on
    every run; the default runner takes the atomic sum, within rounding of them. The
    grouped_mm runner's in-order sum gives the same bits on every run too."""
    from moeserve.kernels.moe.fused_moe import fused_experts

    spec = make_spec(e=16, k=4, h=512, i=192)
    gemm = {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3,
            "TMA": 1}
    plain = {"BLOCK_M": 64, "gate_up": gemm, "down": {**gemm, "WS": 1}}
    summed = {**plain, "down": {**plain["down"], "ATOMIC_SUM": 1}}
    device = torch.cuda.get_device_name()
    (tmp_path / configs.config_file_name(16, 512, 192, torch.bfloat16, device)).write_text(
        json.dumps({"1024": summed}))
    configs.load_tuned.cache_clear()
    try:
        fast, _ = _gpu_pair("triton", spec, 1, 0, seed=5)
        fixed, _ = _gpu_pair("triton", spec, 1, 0, seed=5)
        fast.config_dir = fixed.config_dir = tmp_path
        fixed.deterministic = True
        x = torch.randn(3000, spec.hidden_size, device="cuda").bfloat16()
        ids, w = routing(3000, 4, 16, "uniform", seed=6, device="cuda")
        assert fast.config_for(3000, x.device) == summed
        assert fixed.config_for(3000, x.device) == plain
        want = fused_experts(x, fixed.w13, fixed.w2, ids, w, 0, "silu", plain)
        for _ in range(3):
            assert torch.equal(fixed(x, ids, w), want)
        assert rel_err(fast(x, ids, w), want) <= 1e-2
    finally:
        configs.load_tuned.cache_clear()
    # the grouped_mm runner's in-order sum (index_add_'s atomics otherwise)
    gmm, ref = _gpu_pair("grouped_mm", spec, 1, 0, seed=5)
    gmm.deterministic = True
    first = gmm(x, ids, w)
    assert all(torch.equal(gmm(x, ids, w), first) for _ in range(3))
    assert rel_err(first, ref(x.float(), ids, w)) <= 1e-2


@pytest.mark.gpu
def test_hopper_defaults_compute_the_reference():
    """A shape with no tuned table takes the defaults for this device (on a Hopper GPU: TMA,
    PAIRED, and down's warp-specialised kernel at 500 rows an expert); they give the
    reference's result."""
    spec = make_spec(e=8, k=2, h=256, i=192)  # no table has this shape
    fast, ref = _gpu_pair("triton", spec, 1, 0, seed=21)
    cap = torch.cuda.get_device_capability()
    for n, mode in [(300, "uniform"), (2000, "skewed"), (2000, "padded")]:
        want = configs.default_config(n, 2, 8, hopper=cap[0] == 9)
        assert fast.config_for(n, torch.device("cuda")) == want
        x = torch.randn(n, spec.hidden_size, device="cuda").bfloat16()
        ids, w = routing(n, 2, 8, mode, seed=n, device="cuda")
        assert rel_err(fast(x, ids, w), ref(x.float(), ids, w)) <= 1e-2, (n, mode)


@pytest.mark.gpu
def test_triton_warm_up_runs_each_config_once():
    spec = make_spec(e=16, k=4, h=256, i=192)
    fast, _ = _gpu_pair("triton", spec, 2, 1, seed=7)
    want = configs.warm_up_sizes(3000, 4, 8, 256, 192, torch.bfloat16,
                                 torch.cuda.get_device_name())
    assert fast.warm_up(3000, torch.device("cuda")) == want and len(want) >= 3
