r"""GQA attention over the paged KV cache, Qwen3-30B-A3B's heads (32 query, 4 KV, head dim
128, bf16, one layer), and the small kernels of a decode step.

    PYTHONPATH=src python -m benchmarks attention --out $OUT [--parts decode,extend,kernels] \
        [--sweep] [--results benchmarks/RESULTS.md]

  decode   the decode kernels (partial + combine) at long contexts: one call as a CUDA-graph
           replay of 20 calls, GB/s on the KV bytes a step must read
  extend   the extend (prefill) kernel: one prompt, a chunk after a cached prefix, 8 prompts;
           CUDA events, median of 10 after 3; beside torch's SDPA and varlen_attn
  kernels  the skinny projections, add + RMSNorm and rope of a decode step (step_kernels.py);
           with --fp8 the projections in block-scaled FP8 beside bf16, a section of their own
--sweep times every tile config too (the shipped tiles are chosen from such sweeps) and checks
each one's output against the shipped config's.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks import harness, step_kernels
from benchmarks.harness import Ceilings, RunInfo, table

HELP = "decode and extend attention kernels, and the small kernels of a decode step"
HEADS, KV_HEADS, D = 32, 4, 128
DECODE_CASES = [(1, 8192), (1, 32768), (8, 8192), (32, 8192), (64, 4096), (256, 2048)]
# (BLOCK_N, num_warps, num_stages, max splits)
DECODE_SWEEP = list(itertools.product((32, 64, 128), (4, 8), (2, 3), (32, 64)))
EXTEND_CASES = {"prompt of 1024": [(0, 1024)], "prompt of 4096": [(0, 4096)],
                "prompt of 8192": [(0, 8192)], "2048 after a prefix of 2048": [(2048, 2048)],
                "8 prompts of 512": [(0, 512)] * 8,
                "8192 after a prefix of 24576": [(24576, 8192)],
                "2 x (4096 after 4096)": [(4096, 4096)] * 2}
# (BLOCK_M, BLOCK_N, num_warps, num_stages, split: key blocks before the diagonal unmasked)
EXTEND_SWEEP = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4),
                                      (False, True)))
CALLS = 20
DECODE_METHOD = """\
The decode attention kernels alone (partial + combine, or the partial writing the output when
one split suffices), one layer, pages of 16 slots with the requests interleaved in the pool,
random K/V. Floor = the KV bytes a step must read (batch x (context + 1) x 4 KV heads x 128 x
2 (K and V) x 2 bytes) over the copy bandwidth; % copy = floor / time. One call is a
CUDA-graph replay of 20 calls (as decode steps replay them), the median of 5 replays."""
EXTEND_METHOD = """\
The extend (prefill) kernel over the paged KV cache, keys in randomly permuted slots. Floor =
the causal FLOPs (4 x 128 per visible (query, key) pair and head) over the bf16 GEMM rate.
CUDA events, the median of 10 calls after 3. Baselines on the same data: torch's
scaled_dot_product_attention (is_causal, enable_gqa) on contiguous K/V, where the case is one
fresh prompt, and varlen_attn with the gather of the keys, where torch has it."""


def add_arguments(p: Any) -> None:
    harness.add_output_arguments(p)
    p.add_argument("--parts", default="decode,extend,kernels")
    p.add_argument("--sweep", action="store_true", help="every tile config beside the shipped")
    step_kernels.add_arguments(p)


# --- decode -----------------------------------------------------------------------------------

def decode_setup(batch: int, ctx: int) -> tuple[Any, Any, torch.Tensor]:
    """One layer's cache with `batch` requests of ctx cached tokens each (pages of 16 slots,
    allocated in turn so that requests interleave), their decode batch and queries."""
    from moeserve.batch.forward_batch import ForwardBatch, ForwardMode
    from moeserve.batch.kv_cache import KVCachePool, ReqToTokenPool

    dev = torch.device("cuda")
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


def decode_backend(cfg: Optional[tuple]) -> Any:
    """A triton backend with the shipped tiles, or with cfg = (BLOCK_N, warps, stages, max
    splits) at every batch; each with its own split buffers."""
    from moeserve.kernels.attention.tiles import ATTENTION_TILES
    from moeserve.layers.attention_triton import TritonAttentionBackend

    if cfg is None:
        return TritonAttentionBackend(ATTENTION_TILES)
    return TritonAttentionBackend(dataclasses.replace(
        ATTENTION_TILES, decode=((1 << 62, tuple(cfg[:3])),), max_splits=cfg[3]))


def bench_decode(ceil: Ceilings, sweep: bool) -> list[dict]:
    from moeserve.layers.attention import PagedAttention

    rows = []
    for batch, ctx in DECODE_CASES:
        pool, fb, q = decode_setup(batch, ctx)
        kv_bytes = batch * (ctx + 1) * KV_HEADS * D * 2 * 2
        row: dict[str, Any] = {"batch": batch, "ctx": ctx, "kv_MB": kv_bytes / 1e6,
                               "floor_us": ceil.floor_us(kv_bytes), "configs": []}
        ref = None
        for cfg in [None] + (DECODE_SWEEP if sweep else []):
            backend = decode_backend(cfg)
            layer = PagedAttention(0, HEADS, KV_HEADS, D, D ** -0.5, backend)
            try:
                out = backend.forward(q, layer, fb)
                us = harness.graph_us(lambda: [backend.forward(q, layer, fb)
                                               for _ in range(CALLS)], calls=CALLS, reps=5)
            except Exception as exc:  # a config out of registers or shared memory
                print(f"  {cfg}: {type(exc).__name__}", flush=True)
                continue
            ref = out if ref is None else ref
            row["configs"].append({"config": cfg or "shipped", "us": us,
                                   "max_abs_diff": float((out.float() - ref.float()).abs().max())})
        row["shipped_us"] = row["configs"][0]["us"]
        print(row["batch"], row["ctx"], row["configs"][0], flush=True)
        rows.append(row)
        del pool, fb, q
    return rows


def decode_table(rows: list[dict], ceil: Ceilings) -> list[str]:
    out = []
    for r in rows:
        gbps = r["kv_MB"] * 1e3 / r["shipped_us"]
        best = min(r["configs"], key=lambda c: c["us"])
        out.append([f"{r['batch']} x {r['ctx']}", f"{r['kv_MB']:.0f}", f"{r['floor_us']:.1f}",
                    f"{r['shipped_us']:.1f}",
                    f"{gbps:.0f} ({100 * gbps / ceil.copy_GBps:.0f}%)",
                    f"{best['us']:.1f} {best['config']}" if len(r["configs"]) > 1 else "-",
                    f"{max(c['max_abs_diff'] for c in r['configs']):.2g}"])
    return table(["batch x context", "KV MB", "floor µs", "shipped µs", "GB/s (% copy)",
                  "best of the sweep µs (config)", "max abs diff vs shipped"], out)


# --- extend -----------------------------------------------------------------------------------

def extend_setup(reqs: list[tuple[int, int]]) -> dict:
    """Caches holding every request's prefix and new keys in scattered slots (a random
    permutation, as a long-running pool's pages are), queries of the new tokens."""
    dev = torch.device("cuda")
    total = sum(p + t for p, t in reqs)
    slots = torch.randperm(total, device=dev) + 1
    k_cache = torch.randn(total + 1, KV_HEADS, D, device=dev, dtype=torch.bfloat16)
    table_ = torch.zeros(len(reqs), max(p + t for p, t in reqs), dtype=torch.int32, device=dev)
    at = 0
    for b, (p, t) in enumerate(reqs):
        table_[b, :p + t] = slots[at:at + p + t].to(torch.int32)
        at += p + t
    ext = torch.tensor([t for _, t in reqs], device=dev, dtype=torch.int32)
    i32 = dict(device=dev, dtype=torch.int32)
    return {"q": torch.randn(int(ext.sum()), HEADS, D, device=dev, dtype=torch.bfloat16),
            "k": k_cache, "v": torch.randn_like(k_cache), "table": table_,
            "rows": torch.arange(len(reqs), **i32), "ext": ext,
            "prefix": torch.tensor([p for p, _ in reqs], **i32),
            "starts": (torch.cumsum(ext, 0) - ext).to(torch.int32),
            "max_ext": max(t for _, t in reqs)}


def extend(s: dict, tiles: Optional[tuple] = None, split: Optional[bool] = None) -> torch.Tensor:
    from moeserve.layers import attention_triton as AT

    out = torch.empty_like(s["q"])
    AT.launch_extend(s["q"], s["k"], s["v"], out, s["table"], s["rows"], s["prefix"],
                     s["ext"], s["starts"], s["max_ext"], HEADS // KV_HEADS,
                     D ** -0.5 * AT.LOG2E, AT.NO_WINDOW, tiles=tiles, split=split)
    return out


def events_ms(fn: Any) -> float:
    return harness.time_us(fn, reps=10, warmup=3) / 1e3


def sdpa_ms(s: dict, reqs: list[tuple[int, int]]) -> Optional[float]:
    import torch.nn.functional as F

    if len(reqs) != 1 or reqs[0][0]:
        return None
    slots = s["table"][0, :reqs[0][1]].long()
    q = s["q"].transpose(0, 1)[None]
    k, v = (c[slots].transpose(0, 1)[None] for c in (s["k"], s["v"]))
    return events_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True))


def varlen_ms(s: dict, reqs: list[tuple[int, int]]) -> Optional[float]:
    """torch's varlen_attn (causal aligned to the last key) on each request's keys gathered
    into one packed K/V, the gather timed with it; None where torch lacks it or its GQA."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if "enable_gqa" not in inspect.signature(varlen_attn).parameters:
        return None
    dev = s["q"].device
    keys = torch.cat([s["table"][b, :p + t].long() for b, (p, t) in enumerate(reqs)])
    cu_q = torch.tensor([0] + [t for _, t in reqs], device=dev).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [p + t for p, t in reqs], device=dev).cumsum(0).to(torch.int32)
    max_q, max_k = max(t for _, t in reqs), max(p + t for p, t in reqs)
    return events_ms(lambda: varlen_attn(
        s["q"], s["k"].index_select(0, keys), s["v"].index_select(0, keys), cu_q, cu_k, max_q,
        max_k, scale=D ** -0.5, window_size=(-1, 0), enable_gqa=True))


def bench_extend(ceil: Ceilings, sweep: bool) -> list[dict]:
    rows = []
    for name, reqs in EXTEND_CASES.items():
        s = extend_setup(reqs)
        flops = 4 * D * HEADS * sum(t * p + t * (t + 1) / 2 for p, t in reqs)
        ref = extend(s)
        row: dict[str, Any] = {"case": name, "tflop": flops / 1e12,
                               "floor_ms": ceil.floor_us(flops=flops) / 1e3,
                               "shipped_ms": events_ms(lambda: extend(s)),
                               "sdpa_ms": sdpa_ms(s, reqs), "varlen_ms": varlen_ms(s, reqs),
                               "configs": []}
        for *tiles, split in EXTEND_SWEEP if sweep else []:
            try:
                err = float((extend(s, tuple(tiles), split).float() - ref.float()).abs().max())
                ms = events_ms(lambda: extend(s, tuple(tiles), split))
            except Exception as exc:  # a config out of shared memory or registers
                print(f"  {tiles} split={split}: {type(exc).__name__}", flush=True)
                continue
            row["configs"].append({"tiles": tiles, "split": split, "ms": ms,
                                   "max_abs_diff": err})
        print({k: v for k, v in row.items() if k != "configs"}, flush=True)
        rows.append(row)
        del s
    return rows


def extend_table(rows: list[dict]) -> list[str]:
    def ms(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.3f}"

    out = []
    for r in rows:
        best = min(r["configs"], key=lambda c: c["ms"], default=None)
        out.append([r["case"], f"{r['floor_ms']:.3f}", ms(r["shipped_ms"]),
                    f"{r['tflop'] / r['shipped_ms'] * 1e3:.0f}",
                    f"{best['ms']:.3f} {tuple(best['tiles'])} split={best['split']}"
                    if best else "-", ms(r["sdpa_ms"]), ms(r["varlen_ms"])])
    return table(["case", "floor ms", "shipped ms", "TFLOP/s", "best of the sweep ms (config)",
                  "SDPA ms", "varlen_attn ms"], out)


# --- driver -----------------------------------------------------------------------------------

def run(args: Any, argv: list[str]) -> int:
    harness.require_gpu()
    info = RunInfo.collect("attention", argv)
    torch.manual_seed(0)
    ceil = harness.measure_ceilings()
    print(ceil.line(), flush=True)
    parts = args.parts.split(",")
    out = Path(args.out)
    with torch.inference_mode():
        if "decode" in parts:
            rows = bench_decode(ceil, args.sweep)
            text = harness.section("Decode attention", DECODE_METHOD, info, ceil,
                                   decode_table(rows, ceil))
            harness.save(out, "attention_decode", {"info": info, "ceilings": ceil,
                                                   "rows": rows}, text, args.results)
        if "extend" in parts:
            rows = bench_extend(ceil, args.sweep)
            text = harness.section("Extend attention", EXTEND_METHOD, info, ceil,
                                   extend_table(rows))
            harness.save(out, "attention_extend", {"info": info, "ceilings": ceil,
                                                   "rows": rows}, text, args.results)
        if "kernels" in parts:
            step_kernels.run(args, info, ceil)
    return 0
