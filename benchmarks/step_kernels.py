"""The small kernels of a decode step at 1..16 rows (`attention --parts kernels`): each
projection through the linear layer's pick (the skinny FMA or MMA kernel where
kernels/skinny/tiles.py says it beats cuBLAS, else cuBLAS) against F.linear (cuBLAS); add +
RMSNorm in one kernel against the add and the norm kernel; q/k norm + rope against one
program per token; rope that writes K/V into their slots against rope then store_kv.
--try-tiles times every skinny tile alternative and rope head-block count and prints the best
(kernels/skinny/tiles.py TILES and the rope's head blocks come from such sweeps).
--fp8: the projections with block-scaled FP8 weights (kernels/fp8/gemm.fp8_linear) beside the
bf16 pick, their own section."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks import harness
from benchmarks.harness import Ceilings, RunInfo, table

TITLE = "Decode-step kernels"
DT = torch.bfloat16
CALLS = 20
COLD_BYTES = 256 << 20
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
# model -> projection -> (N, K): the projections of a decode step, per layer (tp = 1)
MODEL_SHAPES = {
    "qwen3-30b-a3b": {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048),
                      "dense": (1536, 2048)},
    "deepseek-v2-lite": {"q_kv_a": (3648, 2048), "o_proj": (2048, 2048),
                         "router": (64, 2048), "shared gate_up": (5632, 2048),
                         "shared down": (2048, 2816)},
}
TRY_FMA = list(itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8)))
TRY_MMA = [t for t in itertools.product((16, 32, 64), (128, 256, 512), (2, 4), (3, 4))
           if t[0] * t[1] * 2 * t[3] <= 160 << 10]  # (BLOCK_N, BLOCK_K, warps, stages)
TRY_HEAD_BLOCKS = (1, 2, 4, 8, 16, 32)
FP8_BLOCK = (128, 128)
TITLE_FP8 = "Decode-step kernels, FP8"
KV_SLOTS = 1 << 16
METHOD = """\
A CUDA graph of 20 back-to-back calls (launch gaps count, as in the engine's decode graphs),
replayed; the median per call. Each call of a projection reads its own copy of the weight and
the graphs rotate over at least 256 MB of copies, so no weight is in L2 when read (in a step
every layer reads its own weights). Floor of a projection = its weight bytes over the copy
bandwidth, the same at 1 and 16 rows. Cells: moeserve (the linear layer's pick, its kernel
named where it changes) / cuBLAS, µs."""

METHOD_FP8 = """\
The projections with block-scaled FP8 weights (float8_e4m3fn, a float32 scale per 128 x 128
block; W8A8, the activation quantized per row per 128 columns), timed as above: fp8_linear
(cuBLAS's block-scaled GEMM where it takes the shape, else the quantizer and moeserve's block
GEMM, whose tiles up to 8 rows are swapped: the weight the MMA's M side) beside the bf16 pick of
the same shape in the same run. Floor = the FP8 weight and scale bytes over the copy bandwidth:
the bound of decode rows; prefill rows (from 1024) are bound by the GEMM rate instead, and
there the cells compare FP8 with bf16. Cells: FP8 / bf16 µs."""


def add_arguments(p: Any) -> None:
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODEL_SHAPES),
                   help="whose projections (kernels part; norm and rope are Qwen3-30B-A3B's)")
    p.add_argument("--try-tiles", action="store_true",
                   help="kernels part: sweep the skinny tiles and the rope head blocks")
    p.add_argument("--fp8", action="store_true",
                   help="kernels part: the projections in block-scaled FP8 beside bf16")


def repeated(fn: Callable[[], object]) -> float:
    return harness.graphs_us([lambda: [fn() for _ in range(CALLS)]], CALLS)


def cold_us(weights: list, call: Callable[[Any], Callable[[], object]]) -> float:
    """µs a call of call(w)(), CALLS calls a graph, one graph per CALLS of the weight copies,
    replayed in turn: no copy is in L2 when it is read."""
    groups = [weights[i:i + CALLS] for i in range(0, len(weights), CALLS)]
    return harness.graphs_us([lambda g=g: [call(w)() for w in g] for g in groups], CALLS)


class Projection:
    """Copies of one [N, K] weight, enough to read each from HBM."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k, self.bytes = n, k, n * k * 2
        groups = max(1, -(-COLD_BYTES // (CALLS * self.bytes)))
        self.weights = [torch.randn(n, k, device="cuda", dtype=DT) * k ** -0.5
                        for _ in range(groups * CALLS)]

    def us(self, x: torch.Tensor, tiles: Any = None, cublas: bool = False) -> float:
        from moeserve.kernels.skinny.gemm import skinny_linear
        from moeserve.kernels.skinny.tiles import beats_cublas

        # the linear layer's pick (layers/linear.py): cuBLAS past the table's rows for the shape
        cublas = cublas or (tiles is None and not beats_cublas(x.shape[0], self.n, self.k))

        def call(w: torch.Tensor) -> Callable[[], object]:
            if cublas:
                return lambda: F.linear(x, w)
            return lambda: skinny_linear(x, w, tiles=tiles)

        return cold_us(self.weights, call)


class FP8Projection:
    """Copies of one [N, K] weight quantized to FP8 with its block scales (FP8_BLOCK)."""

    def __init__(self, n: int, k: int) -> None:
        from moeserve.kernels.fp8.reference import quantize_blocks

        wq, ws = quantize_blocks(torch.randn(n, k, device="cuda") * k ** -0.5, FP8_BLOCK)
        self.n, self.k = n, k
        self.bytes = wq.numel() * wq.element_size() + ws.numel() * ws.element_size()
        groups = max(1, -(-COLD_BYTES // (CALLS * self.bytes)))
        self.weights = [(wq.clone(), ws.clone()) for _ in range(groups * CALLS)]

    def us(self, x: torch.Tensor) -> float:
        """fp8_linear's µs a call."""
        from moeserve.kernels.fp8.gemm import fp8_linear

        return cold_us(self.weights, lambda w: (lambda: fp8_linear(x, w[0], w[1], FP8_BLOCK)))

    def kind(self, x: torch.Tensor) -> str:
        from moeserve.kernels.fp8.gemm import _sm_count, cublas_takes
        from moeserve.kernels.fp8.tiles import gemm_tiles

        if cublas_takes(x, *self.weights[0], FP8_BLOCK):
            return "cuBLAS"
        tiles = gemm_tiles(x.shape[0], self.n, self.k, _sm_count(x.device.index or 0))
        return "block GEMM, swapped" if tiles.swap else "block GEMM"


def kind(m: int, n: int, k: int) -> str:
    from moeserve.kernels.skinny.tiles import beats_cublas, tiles_for

    if not beats_cublas(m, n, k):
        return "cuBLAS"
    t = tiles_for(m, n, k)
    groups = -(-m // t.rows)
    return "MMA" if t.mma else "FMA" if groups == 1 else f"FMA, {groups} groups"


def bench_projections(shapes: dict, rows: list[int], ceil: Ceilings) -> list[dict]:
    out = []
    for name, (n, k) in shapes.items():
        proj = Projection(n, k)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=DT)
            r = {"name": f"{name} {k}->{n}", "rows": m, "kind": kind(m, n, k),
                 "floor_us": ceil.floor_us(proj.bytes), "cublas_us": proj.us(x, cublas=True)}
            r["us"] = r["cublas_us"] if r["kind"] == "cuBLAS" else proj.us(x)
            print(r, flush=True)
            out.append(r)
        del proj
        torch.cuda.empty_cache()
    return out


def bench_fp8_projections(shapes: dict, rows: list[int], ceil: Ceilings) -> list[dict]:
    out = []
    for name, (n, k) in shapes.items():
        fp8, bf16 = FP8Projection(n, k), Projection(n, k)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=DT)
            r = {"name": f"{name} {k}->{n}", "rows": m, "kind": fp8.kind(x),
                 "floor_us": ceil.floor_us(fp8.bytes), "us": fp8.us(x), "bf16_us": bf16.us(x)}
            print(r, flush=True)
            out.append(r)
        del fp8, bf16
        torch.cuda.empty_cache()
    return out


def bench_fused(rows: list[int]) -> list[dict]:
    from moeserve.kernels.elementwise.fused import add_rms_norm, rms_norm, rotary, store_kv
    from moeserve.layers.rotary import RotaryEmbedding

    out = []
    w = 1 + 0.3 * torch.rand(HIDDEN, device="cuda", dtype=DT)
    inv_freq = RotaryEmbedding(HEAD_DIM, 1e6, None, 40960)._inv_freq_cpu.to("cuda")
    qn, kn = (1 + 0.3 * torch.rand(HEAD_DIM, device="cuda", dtype=DT) for _ in range(2))
    for m in rows:
        x, a = (torch.randn(m, HIDDEN, device="cuda", dtype=DT) for _ in range(2))
        pos = torch.randint(0, 40960, (m,), device="cuda")
        qkv = torch.randn(m, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=DT)
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q, k, v = q.view(m, HEADS, -1), k.view(m, KV_HEADS, -1), v.view(m, KV_HEADS, -1)
        kv = torch.randn(2, KV_SLOTS, KV_HEADS, HEAD_DIM, device="cuda", dtype=DT)
        loc = torch.randperm(KV_SLOTS, device="cuda")[:m]

        def rope(blocks: Any = None, store: bool = False) -> Callable[[], object]:
            cache = (kv[0], kv[1], loc, v) if store else None
            return lambda: rotary(pos, q, k, inv_freq, 1.0, qn, kn, 1e-6, head_blocks=blocks,
                                  kv_cache=cache)

        def rope_then_store() -> None:
            _, ko = rotary(pos, q, k, inv_freq, 1.0, qn, kn, 1e-6)
            store_kv(kv[0], kv[1], loc, ko, v)

        cases = [("add + RMSNorm", lambda: add_rms_norm(x, a, w, 1e-6),
                  "add, then RMSNorm", lambda: rms_norm(x + a, w, 1e-6)),
                 ("q/k norm + rope", rope(), "one program per token", rope(1)),
                 ("q/k norm + rope + KV store", rope(store=True), "rope, then store_kv",
                  rope_then_store)]
        for name, fn, base_name, base in cases:
            r = {"kernel": name, "rows": m, "us": repeated(fn), "baseline": base_name,
                 "baseline_us": repeated(base)}
            print(r, flush=True)
            out.append(r)
    return out


def try_tiles(shapes: dict, rows: list[int]) -> None:
    from moeserve.kernels.skinny.tiles import tiles_for

    for name, (n, k) in shapes.items():
        proj = Projection(n, k)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=DT)
            timed: dict[tuple, tuple[float, tuple]] = {}  # by effective tiles: each once
            for tile in TRY_FMA + (TRY_MMA if m <= 16 else []):
                eff = tuple(tiles_for(m, n, k, tile))
                if eff not in timed:
                    timed[eff] = (proj.us(x, tiles=tile), tile)
            for mma in (False, True):
                got = [t for eff, t in timed.items() if eff[0] == mma]
                if got:
                    us, tile = min(got)
                    print(f"{name} {k}->{n} rows {m}: best {'MMA' if mma else 'FMA'} {tile} "
                          f"{us:.2f} us; the table's {proj.us(x):.2f} us", flush=True)
        del proj
        torch.cuda.empty_cache()


def run(args: Any, info: RunInfo, ceil: Ceilings) -> None:
    shapes = MODEL_SHAPES[args.model]
    if args.fp8:
        run_fp8(args, info, ceil, {k: v for k, v in shapes.items() if k != "router"})
        return
    projections = bench_projections(shapes, args.rows, ceil)
    fused = bench_fused(args.rows) if args.model == "qwen3-30b-a3b" else []
    if args.try_tiles:
        try_tiles(shapes, args.rows)
    body = [f"Projections of {args.model} (tp = 1):", ""]
    body += table(["projection", "floor µs", *map(str, args.rows)],
                  pivot(projections, "cublas_us"))
    if fused:
        body += ["", "Fused elementwise kernels (Qwen3-30B-A3B), moeserve / baseline µs:", ""]
        names = list(dict.fromkeys((r["kernel"], r["baseline"]) for r in fused))
        body += table(["kernel", "baseline", *map(str, args.rows)],
                      [[kn, bn, *(f"{r['us']:.2f} / {r['baseline_us']:.2f}" for r in fused
                                  if r["kernel"] == kn)] for kn, bn in names])
    text = harness.section(TITLE, METHOD, info, ceil, body)
    harness.save(Path(args.out), "attention_kernels", {"info": info, "ceilings": ceil,
                 "projections": projections, "fused": fused}, text, args.results)


def run_fp8(args: Any, info: RunInfo, ceil: Ceilings, shapes: dict) -> None:
    """The FP8 section (the router stays in bf16 in an FP8 model: not among `shapes`)."""
    found = bench_fp8_projections(shapes, args.rows, ceil)
    body = [f"Projections of {args.model} (tp = 1), FP8 / bf16 µs:", ""]
    body += table(["projection", "FP8 floor µs", *map(str, args.rows)],
                  pivot(found, "bf16_us"))
    text = harness.section(TITLE_FP8, METHOD_FP8, info, ceil, body)
    harness.save(Path(args.out), "attention_kernels_fp8", {"info": info, "ceilings": ceil,
                 "projections": found}, text, args.results)


def pivot(found: list[dict], baseline: str) -> list[list[str]]:
    """A row per projection: its floor, then a cell per row count (ours / the `baseline`
    key's µs, our kernel named where it changes)."""
    rows = []
    for name in dict.fromkeys(r["name"] for r in found):
        mine = [r for r in found if r["name"] == name]
        cells, last = [], None
        for r in mine:
            tag = f" ({r['kind']})" if r["kind"] != last else ""
            cells.append(f"{r['us']:.2f} / {r[baseline]:.2f}{tag}")
            last = r["kind"]
        rows.append([name, f"{mine[0]['floor_us']:.1f}", *cells])
    return rows
