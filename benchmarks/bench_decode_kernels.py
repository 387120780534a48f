"""The small kernels of a decode step (Qwen3-30B-A3B, bf16, tp = 1) at 1..16 rows: the skinny
linear (the table's FMA or MMA kernel) against F.linear (cuBLAS), add + RMSNorm in one kernel
against the add and the RMSNorm kernel, the rope over head blocks against one program per
token (head_blocks=1, the former kernel), the rope that writes K/V into their cache slots
against the rope, then store_kv (two launches), with the device's copy bandwidth from the
same run.

    PYTHONPATH=src python benchmarks/bench_decode_kernels.py --out DIR [--rows 1 2 4 8 16] \
        [--try-tiles] [--model deepseek-v2-lite]

Timing: a CUDA graph of 20 back-to-back calls (so launch gaps count, as in the engine's decode
graphs), replayed; the median of CUDA events over the replays, per call. Each call of a
projection reads its own copy of the weight, and the graphs rotate over at least 256 MB of
copies, so that no weight is in L2 when it is read (in a decode step every layer reads its own
weights, and the experts between them flush L2). GB/s counts the weight bytes once per call.

--try-tiles times each projection at each row count with the FMA kernel's (BLOCK_N, BLOCK_K,
num_warps) alternatives (BLOCK_K cut to the register budget as the kernel's table is), the MMA
kernel's (BLOCK_N, BLOCK_K, num_warps, num_stages) up to 16 rows, and the rope with each
head-block count, and prints the best; layers/skinny_tiles.py TILES and
fused_kernels.ROPE_HEADS_PER_PROGRAM take their defaults from it.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_common import capture, ceilings  # noqa: E402
from moeserve.layers.fused_kernels import add_rms_norm, rms_norm, rotary, store_kv  # noqa: E402
from moeserve.layers.rotary import RotaryEmbedding  # noqa: E402
from moeserve.layers.skinny_gemm import skinny_linear  # noqa: E402
from moeserve.layers.skinny_tiles import beats_cublas, tiles_for  # noqa: E402

DEVICE, DTYPE = "cuda", torch.bfloat16
CALLS = 20
COLD_BYTES = 256 << 20
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 2048, 32, 4, 128, 48
# model -> name -> (N, K): the projections a decode step runs per layer (tp = 1)
MODEL_SHAPES = {
    "qwen3-30b-a3b": {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048),
                      "dense": (1536, 2048)},
    # latent attention's q_proj and kv_a_proj_with_mqa (one GEMM since session 13), o_proj,
    # the router, the two shared experts' gate_up and down
    "deepseek-v2-lite": {"q_kv_a": (3648, 2048), "o_proj": (2048, 2048),
                         "router": (64, 2048), "shared_gate_up": (5632, 2048),
                         "shared_down": (2048, 2816)},
}
TRY_BLOCK_N, TRY_BLOCK_K, TRY_WARPS = (1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8)
# the MMA kernel's (BLOCK_N, BLOCK_K, num_warps, num_stages)
TRY_MMA = [t for t in itertools.product((16, 32, 64), (128, 256, 512), (2, 4), (3, 4))
           if t[0] * t[1] * 2 * t[3] <= 160 << 10]
TRY_HEAD_BLOCKS = (1, 2, 4, 8, 16, 32)
KV_SLOTS = 1 << 16  # one layer's KV cache [2, slots, KV_HEADS, HEAD_DIM]


def graphs_us(calls: list[Callable[[], object]], reps: int = 60) -> float:
    """us per call: graphs of CALLS consecutive calls, replayed in turn; median of replays."""
    graphs = [capture(lambda group=calls[i:i + CALLS]: [c() for c in group])
              for i in range(0, len(calls), CALLS)]
    for g in graphs:
        g()
    reps = max(reps, 3 * len(graphs))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for r in range(reps):
        starts[r].record()
        graphs[r % len(graphs)]()
        ends[r].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3 / CALLS


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


class Projection:
    """Weight copies of one [N, K] projection, enough of them to read from DRAM every call."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k = n, k
        self.bytes = n * k * 2
        groups = max(1, -(-COLD_BYTES // (CALLS * self.bytes)))
        self.weights = [torch.randn(n, k, device=DEVICE, dtype=DTYPE) * k ** -0.5
                        for _ in range(groups * CALLS)]

    def time(self, x: torch.Tensor, tiles: Optional[tuple[int, int, int]] = None,
             cublas: bool = False) -> float:
        if cublas:
            calls = [lambda w=w: F.linear(x, w) for w in self.weights]
        else:
            calls = [lambda w=w: skinny_linear(x, w, tiles=tiles) for w in self.weights]
        return graphs_us(calls)


def bench_projections(shapes: dict, rows: list[int], ceil: dict, say) -> list[dict]:
    out = []
    for name, (n, k) in shapes.items():
        proj = Projection(n, k)
        for m in rows:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
            new_us, old_us = proj.time(x), proj.time(x, cublas=True)
            w = proj.weights[0]
            r = {"kernel": "linear", "shape": f"{name} {k}->{n}", "rows": m,
                 "tiles": list(tiles_for(m, n, k)), "new_us": new_us, "old_us": old_us,
                 "new_GBps": proj.bytes / new_us / 1e3, "old_GBps": proj.bytes / old_us / 1e3,
                 "err": rel(skinny_linear(x, w), F.linear(x.double(), w.double()))}
            r["pct_copy"] = 100 * r["new_GBps"] / ceil["copy_GBps"]
            say(fmt_row(r))
            out.append(r)
        del proj
        torch.cuda.empty_cache()
    return out


def bench_norm_and_rope(rows: list[int], say) -> list[dict]:
    out = []
    w = 1 + 0.3 * torch.rand(HIDDEN, device=DEVICE, dtype=DTYPE)
    rope = RotaryEmbedding(HEAD_DIM, 1e6, None, 40960)
    inv_freq = rope._inv_freq_cpu.to(DEVICE)
    qn, kn = (1 + 0.3 * torch.rand(HEAD_DIM, device=DEVICE, dtype=DTYPE) for _ in range(2))
    for m in rows:
        x, a = (torch.randn(m, HIDDEN, device=DEVICE, dtype=DTYPE) for _ in range(2))

        def old_norm():
            total = x + a
            return rms_norm(total, w, 1e-6), total

        new, old = add_rms_norm(x, a, w, 1e-6), old_norm()
        r = {"kernel": "add_rms_norm", "shape": f"add + norm {HIDDEN}", "rows": m,
             "new_us": graphs_us([lambda: add_rms_norm(x, a, w, 1e-6)] * CALLS),
             "old_us": graphs_us([old_norm] * CALLS), "err": rel(new[0], old[0])}
        say(fmt_row(r))
        out.append(r)
        pos = torch.randint(0, 40960, (m,), device=DEVICE)
        qkv = torch.randn(m, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEVICE, dtype=DTYPE)
        q = qkv[:, : HEADS * HEAD_DIM].view(m, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM: (HEADS + KV_HEADS) * HEAD_DIM].view(m, KV_HEADS, HEAD_DIM)

        def rope_call(blocks: Optional[int]):
            return lambda: rotary(pos, q, k, inv_freq, 1.0, qn, kn, 1e-6, head_blocks=blocks)

        new, old = rope_call(None)(), rope_call(1)()
        r = {"kernel": "rope", "shape": f"q/k norm + rope {HEADS}+{KV_HEADS} heads", "rows": m,
             "new_us": graphs_us([rope_call(None)] * CALLS),
             "old_us": graphs_us([rope_call(1)] * CALLS),
             "err": max(rel(new[0], old[0]), rel(new[1], old[1]))}
        say(fmt_row(r))
        out.append(r)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(m, KV_HEADS, HEAD_DIM)
        kv = torch.randn(2, KV_SLOTS, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        loc = torch.randperm(KV_SLOTS, device=DEVICE)[:m]

        def rope_then_store():  # the engine's two launches before the fusion
            qo, ko = rotary(pos, q, k, inv_freq, 1.0, qn, kn, 1e-6)
            store_kv(kv[0], kv[1], loc, ko, v)
            return qo, ko

        def rope_store():
            return rotary(pos, q, k, inv_freq, 1.0, qn, kn, 1e-6,
                          kv_cache=(kv[0], kv[1], loc, v))

        old = rope_then_store()
        want = kv[:, loc].clone()
        kv[:, loc] = 0
        new = rope_store()
        same = torch.equal(kv[:, loc], want) and torch.equal(new[1], old[1])
        r = {"kernel": "rope_store_kv",
             "shape": f"q/k norm + rope + KV store {HEADS}+{KV_HEADS} heads", "rows": m,
             "new_us": graphs_us([rope_store] * CALLS),
             "old_us": graphs_us([rope_then_store] * CALLS),
             "err": max(rel(new[0], old[0]), 0.0 if same else float("inf"))}
        say(fmt_row(r))
        out.append(r)
    return out


def try_tiles(shapes: dict, rows: list[int], say, rope: bool = True) -> list[dict]:
    """Every tile alternative per projection and row count; the best per shape."""
    found = []
    for name, (n, k) in shapes.items():
        proj = Projection(n, k)
        per_tile: dict[tuple, dict[int, float]] = {}
        for m in rows:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
            by_eff: dict[tuple, float] = {}  # tiles that BLOCK_K's cut makes equal: timed once
            fma = list(itertools.product(TRY_BLOCK_N, TRY_BLOCK_K, TRY_WARPS))
            for tile in fma + (TRY_MMA if m <= 16 else []):
                eff = tiles_for(m, n, k, tile)
                if eff not in by_eff:
                    by_eff[eff] = proj.time(x, tiles=tile)
                    found.append({"shape": name, "rows": m, "tiles": list(tile),
                                  "effective": list(eff), "us": by_eff[eff]})
                per_tile.setdefault(tile, {})[m] = by_eff[eff]
            for mma in (False, True):
                best = min((f for f in found if f["shape"] == name and f["rows"] == m
                            and f["effective"][0] == mma), key=lambda f: f["us"], default=None)
                if best:
                    say(f"{name} {k}->{n} rows {m}: best {'MMA' if mma else 'FMA'} "
                        f"{best['tiles']} {best['us']:.2f} us "
                        f"({proj.bytes / best['us'] / 1e3:.0f} GB/s)")
            say(f"{name} {k}->{n} rows {m}: table {tiles_for(m, n, k)} {proj.time(x):.2f} us, "
                f"cuBLAS {proj.time(x, cublas=True):.2f} us")
        for kind in (3, 4):
            full = {t: sum(v.values()) for t, v in per_tile.items()
                    if len(t) == kind and len(v) == len(rows)}
            if full:
                t = min(full, key=full.get)
                say(f"{name} {k}->{n}: best {'MMA' if kind == 4 else 'FMA'} tiles over rows "
                    f"{rows}: {list(t)} (sum {full[t]:.2f} us); for skinny_tiles.TILES")
        del proj
        torch.cuda.empty_cache()
    for m in rows if rope else []:
        pos = torch.randint(0, 40960, (m,), device=DEVICE)
        q = torch.randn(m, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        k = torch.randn(m, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        inv = RotaryEmbedding(HEAD_DIM, 1e6, None, 40960)._inv_freq_cpu.to(DEVICE)
        nw = torch.ones(HEAD_DIM, device=DEVICE, dtype=DTYPE)
        times = {b: graphs_us([lambda b=b: rotary(pos, q, k, inv, 1.0, nw, nw, 1e-6,
                                                  head_blocks=b)] * CALLS)
                 for b in TRY_HEAD_BLOCKS}
        for b, us in times.items():
            found.append({"shape": "rope", "rows": m, "head_blocks": b, "us": us})
        say(f"rope rows {m}: " + ", ".join(f"{b} blocks {us:.2f} us" for b, us in times.items()))
    return found


HEADER = ("| kernel | shape | rows | new µs | old µs | speedup | new GB/s | old GB/s | % copy "
          "| rel err |")


def fmt_row(r: dict) -> str:
    gbps = (f"{r['new_GBps']:.0f} | {r['old_GBps']:.0f} | {r['pct_copy']:.0f}%"
            if "new_GBps" in r else "- | - | -")
    return (f"| {r['kernel']} | {r['shape']} | {r['rows']} | {r['new_us']:.2f} | "
            f"{r['old_us']:.2f} | {r['old_us'] / r['new_us']:.2f}x | {gbps} | {r['err']:.1e} |")


def step_summary(rows_out: list[dict], rows: list[int]) -> list[str]:
    """Per decode step (48 layers): qkv + o_proj + router, the add + norm, the rope with the
    KV store; the layers keep cuBLAS where skinny_tiles.beats_cublas says so."""
    def skinny_taken(r: dict, m: int) -> bool:
        if r["kernel"] != "linear":
            return True
        k, n = (int(v) for v in r["shape"].split()[1].split("->"))
        return beats_cublas(m, n, k)

    lines = []
    for m in rows:
        pick = [r for r in rows_out if r["rows"] == m and r["kernel"] != "rope" and (
            r["kernel"] != "linear" or r["shape"].split()[0] in ("qkv", "o_proj", "router"))]
        old = LAYERS * sum(r["old_us"] for r in pick)
        new = LAYERS * sum(r["new_us" if skinny_taken(r, m) else "old_us"] for r in pick)
        lines.append(f"rows {m}: these kernels per step (48 layers) {old:.0f} -> {new:.0f} us")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--try-tiles", action="store_true",
                    help="sweep the skinny-GEMM tiles and the rope head blocks")
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODEL_SHAPES),
                    help="whose projections (the norm and rope rows are Qwen3-30B-A3B's)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shapes = MODEL_SHAPES[args.model]
    import triton

    meta = {"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
            "torch": torch.__version__, "triton": triton.__version__,
            "command": "PYTHONPATH=src python " + " ".join(sys.argv)}
    torch.manual_seed(0)
    ceil = ceilings()
    say = lambda s: print(s, flush=True)  # noqa: E731
    say(f"{meta['device']}: copy {ceil['copy_GBps']:.0f} GB/s (1 GiB device-to-device, "
        "read + write)")
    say(HEADER)
    say("|" + "---|" * (HEADER.count("|") - 1))
    with torch.inference_mode():
        results = bench_projections(shapes, args.rows, ceil, say)
        summary = []
        if args.model == "qwen3-30b-a3b":
            results += bench_norm_and_rope(args.rows, say)
            summary = step_summary(results, args.rows)
        for line in summary:
            say(line)
        tiles = (try_tiles(shapes, args.rows, say, rope=args.model == "qwen3-30b-a3b")
                 if args.try_tiles else [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_decode_kernels.json").write_text(json.dumps(
        {"meta": meta, "ceilings": ceil, "results": results, "summary": summary,
         "try_tiles": tiles}, indent=1))


if __name__ == "__main__":
    main()
