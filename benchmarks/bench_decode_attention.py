"""The decode attention (partial + combine kernels) over the paged KV cache at long contexts:
GB/s on the KV bytes each step must read, against the device's copy bandwidth measured in the
same run (Qwen3-30B-A3B's heads: 32 query, 4 KV, head dim 128, bf16; one layer).

    PYTHONPATH=src python benchmarks/bench_decode_attention.py --out DIR

For each (batch, context) and each config (BLOCK_N, num_warps, num_stages, max splits): the
time of one call as a CUDA-graph replay of 20 calls (as decode steps run), the KV bytes read,
GB/s and % of the copy ceiling. Every config's output is compared with the shipped one's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_common import ceilings  # noqa: E402
from moeserve.layers import attention_tiles as TL  # noqa: E402
from moeserve.layers.attention import PagedAttention, create_attention_backend  # noqa: E402
from moeserve.runtime.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from moeserve.runtime.kv_cache import KVCachePool, ReqToTokenPool  # noqa: E402

HEADS, KV_HEADS, D = 32, 4, 128
CASES = [(1, 8192), (1, 32768), (8, 8192), (32, 8192), (64, 4096), (256, 2048)]
CONFIGS = list(itertools.product((32, 64, 128), (4, 8), (2, 3), (32, 64)))
CALLS = 20


def setup(batch: int, ctx: int, dev: torch.device) -> tuple:
    """One layer's cache with `batch` requests of ctx cached tokens each (pages of 16 slots,
    allocated in turn so that requests interleave), and their decode batch."""
    pool = KVCachePool(1, batch * (ctx + 16) + 64, KV_HEADS, D, torch.bfloat16, dev,
                       page_size=16)
    pool.kv_LSKD.normal_()
    rows = ReqToTokenPool(batch + 1, ctx + 16, dev)
    req_rows = [rows.alloc() for _ in range(batch)]
    for row in req_rows:
        rows.write(row, 0, pool.alloc(ctx + 1))
    loc = rows.table[req_rows, ctx].to(torch.int64)
    fb = ForwardBatch.from_requests(ForwardMode.DECODE, [[0]] * batch, [ctx] * batch,
                                    req_rows, loc, rows.table, pool)
    q = torch.randn(batch, HEADS, D, device=dev, dtype=torch.bfloat16)
    return pool, fb, q


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return sorted(times)[2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="decode_attention_out")
    args = p.parse_args()
    dev = torch.device("cuda")
    ceil = ceilings()
    copy_gbs = ceil["copy_GBps"]
    shipped = (TL.DECODE_TILES, TL.MAX_SPLITS)
    print(f"copy ceiling {copy_gbs:.0f} GB/s; shipped {shipped}", flush=True)
    results = []
    for batch, ctx in CASES:
        pool, fb, q = setup(batch, ctx, dev)
        layer = PagedAttention(0, HEADS, KV_HEADS, D, D ** -0.5, create_attention_backend("triton"))
        kv_bytes = batch * (ctx + 1) * KV_HEADS * D * 2 * 2
        row = {"batch": batch, "ctx": ctx, "kv_MB": kv_bytes / 1e6, "configs": []}
        ref = None
        ship = (*TL.decode_tiles(batch), TL.MAX_SPLITS)
        for block_n, warps, stages, splits in [ship] + CONFIGS:
            TL.DECODE_TILES = ((1 << 62, (block_n, warps, stages)),)
            TL.MAX_SPLITS = splits
            backend = create_attention_backend("triton")  # fresh split buffers per config
            layer.backend = backend
            try:
                out = backend.forward(q, layer, fb)
                us = graph_us(lambda: backend.forward(q, layer, fb))
            except Exception as e:  # a config out of registers or shared memory
                print(f"  {(block_n, warps, stages, splits)}: {type(e).__name__}", flush=True)
                continue
            ref = out if ref is None else ref
            row["configs"].append({"tiles": [block_n, warps, stages], "max_splits": splits,
                                   "us": us, "GBps": kv_bytes / us / 1e3,
                                   "pct_copy": kv_bytes / us / 1e3 / copy_gbs * 100,
                                   "max_abs_diff": float((out.float() - ref.float()).abs().max())})
        TL.DECODE_TILES, TL.MAX_SPLITS = shipped
        best = min(row["configs"], key=lambda c: c["us"])
        first = row["configs"][0]
        print(f"batch {batch} ctx {ctx}: KV {kv_bytes / 1e6:.0f} MB; shipped {ship} "
              f"{first['us']:.1f} us "
              f"{first['GBps']:.0f} GB/s ({first['pct_copy']:.0f}% of copy); best "
              f"{best['tiles']} splits {best['max_splits']} {best['us']:.1f} us "
              f"{best['GBps']:.0f} GB/s ({best['pct_copy']:.0f}%), max |diff| "
              f"{max(c['max_abs_diff'] for c in row['configs']):.2g}", flush=True)
        results.append(row)
        del pool
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_decode_attention.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(dev), "ceilings": ceil, "shipped": shipped,
         "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
