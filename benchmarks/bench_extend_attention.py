"""The extend (prefill) attention kernel over the paged KV cache, by tile config, against
torch's SDPA on contiguous K/V (Qwen3-30B-A3B's heads: 32 query, 4 KV, head dim 128, bf16).

    PYTHONPATH=src python benchmarks/bench_extend_attention.py --out DIR

Cases: one prompt of T tokens, a chunk of T new tokens after a cached prefix of P, and 8
prompts of 512 tokens in one batch. For each kernel config (BLOCK_M, BLOCK_N, num_warps,
num_stages, split: the key blocks before the diagonal without masks): device time (CUDA
events, median of 10 after 3 warm-up calls) and TFLOP/s on the causal FLOPs (4 D per visible
(query, key) pair and head). SDPA (flash, is_causal, enable_gqa) runs where the case has no
prefix and one request. Every config's output is checked against the shipped config's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from moeserve.layers import attention_tiles as TL  # noqa: E402
from moeserve.layers import attention_triton as AT  # noqa: E402

HEADS, KV_HEADS, D = 32, 4, 128
CASES = {"prompt 1024": [(0, 1024)], "prompt 4096": [(0, 4096)], "prompt 8192": [(0, 8192)],
         "2048 after a prefix of 2048": [(2048, 2048)], "8 prompts of 512": [(0, 512)] * 8,
         "8192 after a prefix of 24576": [(24576, 8192)],
         "2 x (4096 after 4096)": [(4096, 4096)] * 2}
CONFIGS = [c for c in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4),
                                        (False, True))]


def setup(reqs: list[tuple[int, int]], dev: torch.device) -> dict:
    """Caches holding every request's prefix and new keys in scattered slots (a random
    permutation, as a long-running pool's pages are), queries of the new tokens."""
    total = sum(p + t for p, t in reqs)
    slots = torch.randperm(total, device=dev) + 1
    k_cache = torch.randn(total + 1, KV_HEADS, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    width = max(p + t for p, t in reqs)
    table = torch.zeros(len(reqs), width, dtype=torch.int32, device=dev)
    at = 0
    for b, (p, t) in enumerate(reqs):
        table[b, :p + t] = slots[at:at + p + t].to(torch.int32)
        at += p + t
    tokens = sum(t for _, t in reqs)
    q = torch.randn(tokens, HEADS, D, device=dev, dtype=torch.bfloat16)
    ext = torch.tensor([t for _, t in reqs], device=dev, dtype=torch.int32)
    starts = torch.cumsum(ext, 0) - ext
    return {"q": q, "k": k_cache, "v": v_cache, "table": table,
            "rows": torch.arange(len(reqs), device=dev, dtype=torch.int32),
            "prefix": torch.tensor([p for p, _ in reqs], device=dev, dtype=torch.int32),
            "ext": ext, "starts": starts.to(torch.int32), "max_ext": max(t for _, t in reqs)}


def flops(reqs: list[tuple[int, int]]) -> float:
    pairs = sum(t * p + t * (t + 1) / 2 for p, t in reqs)
    return 4 * D * HEADS * pairs


def time_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    times = []
    for i in range(reps + warmup):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def run(s: dict, tiles, split) -> torch.Tensor:
    out = torch.empty_like(s["q"])
    AT.launch_extend(s["q"], s["k"], s["v"], out, s["table"], s["rows"], s["prefix"],
                     s["ext"], s["starts"], s["max_ext"], HEADS // KV_HEADS,
                     D ** -0.5 * AT.LOG2E, AT.NO_WINDOW, tiles=tiles, split=split)
    return out


def sdpa_ms(s: dict, reqs) -> float | None:
    if len(reqs) != 1 or reqs[0][0]:
        return None
    t = reqs[0][1]
    slots = s["table"][0, :t].long()
    q = s["q"].transpose(0, 1)[None]
    k = s["k"][slots].transpose(0, 1)[None]
    v = s["v"][slots].transpose(0, 1)[None]
    return time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                          enable_gqa=True))


def varlen(s: dict, reqs) -> tuple[float, float] | None:
    """torch.nn.attention.varlen.varlen_attn (flash, causal aligned to the last key) on each
    request's prefix and new keys gathered into one packed K/V: (ms with the gather, max |diff|
    against the shipped kernel's output); None where this torch lacks it or its GQA."""
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

    def run_varlen() -> torch.Tensor:
        k, v = s["k"].index_select(0, keys), s["v"].index_select(0, keys)
        return varlen_attn(s["q"], k, v, cu_q, cu_k, max_q, max_k, scale=D ** -0.5,
                           window_size=(-1, 0), enable_gqa=True)

    diff = float((run_varlen().float() - run(s, None, None).float()).abs().max())
    return time_ms(run_varlen), diff


def first_calls(lengths: list[int]) -> None:
    """SDPA's first call at each new prompt length against its second, per backend (a
    serving engine sees a new length with most prompts): ms, CUDA events."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    for name, backend in (("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION)):
        firsts, seconds = [], []
        for t in lengths:
            q = torch.randn(1, HEADS, t, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(1, KV_HEADS, t, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)

            def call() -> float:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                a.record()
                if backend is None:
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                else:
                    with sdpa_kernel(backend):
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                b.record()
                b.synchronize()
                return a.elapsed_time(b)

            firsts.append(call())
            seconds.append(statistics.median([call() for _ in range(5)]))
        print(f"SDPA {name}: first call at a new length ms {[round(x, 2) for x in firsts]}; "
              f"later calls {[round(x, 3) for x in seconds]}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="extend_out")
    p.add_argument("--baselines-only", action="store_true",
                   help="the shipped config, SDPA and varlen_attn; no sweep")
    p.add_argument("--first-calls", type=int, nargs="*",
                   help="only time SDPA's first call at each of these prompt lengths")
    p.add_argument("--warm-up", type=int, nargs="*", metavar="MAX_EXTEND",
                   help="only time the backend's startup warm-up for these extend budgets")
    args = p.parse_args()
    if args.first_calls:
        first_calls(args.first_calls)
        return 0
    if args.warm_up:
        import time

        from moeserve.layers.attention import PagedAttention, create_attention_backend

        for top in args.warm_up:
            backend = create_attention_backend("triton")
            layer = PagedAttention(0, HEADS, KV_HEADS, D, D ** -0.5, backend)
            t0 = time.perf_counter()
            lengths = backend.warm_up(layer, top, torch.bfloat16, torch.device("cuda"))
            torch.cuda.synchronize()
            print(f"warm-up for extends of up to {top} tokens: {len(lengths)} lengths in "
                  f"{time.perf_counter() - t0:.2f} s", flush=True)
        return 0

    dev = torch.device("cuda")
    results = []
    for name, reqs in CASES.items():
        s = setup(reqs, dev)
        shipped = (TL.extend_tiles(s["max_ext"]), TL.EXTEND_SPLIT)
        ref = run(s, *shipped)
        tf = flops(reqs) / 1e12
        base = sdpa_ms(s, reqs)
        vl = varlen(s, reqs)
        row = {"case": name, "tflop": tf, "sdpa_ms": base, "varlen_ms": vl and vl[0],
               "varlen_max_abs_diff": vl and vl[1], "configs": []}
        print(f"{name}: shipped {shipped}; SDPA "
              + (f"{base:.3f} ms ({tf / base * 1e3:.0f} TFLOP/s)" if base else "-")
              + "; varlen_attn with its gather "
              + (f"{vl[0]:.3f} ms ({tf / vl[0] * 1e3:.0f} TFLOP/s, max |diff| {vl[1]:.2g})"
                 if vl else "-"), flush=True)
        for *tiles, split in ([(*shipped[0], shipped[1])] if args.baselines_only else CONFIGS):
            try:
                out = run(s, tuple(tiles), split)
                err = float((out.float() - ref.float()).abs().max())
                ms = time_ms(lambda: run(s, tuple(tiles), split))
            except Exception as e:  # a config out of shared memory or registers
                print(f"  {tiles} split={split}: {type(e).__name__} {str(e)[:160]}", flush=True)
                continue
            row["configs"].append({"tiles": tiles, "split": split, "ms": ms,
                                   "tflops": tf / ms * 1e3, "max_abs_diff": err})
        row["configs"].sort(key=lambda c: c["ms"])
        old = ((64, 64, 4, 2), False)  # the config before session 8
        for c in row["configs"][:6] + [c for c in row["configs"]
                                       if (tuple(c["tiles"]), c["split"]) in (shipped, old)]:
            print(f"  {c['tiles']} split={c['split']}: {c['ms']:.3f} ms, "
                  f"{c['tflops']:.0f} TFLOP/s, max |diff| {c['max_abs_diff']:.2g}", flush=True)
        results.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_extend_attention.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(dev), "shipped": TL.EXTEND_TILES,
         "split": TL.EXTEND_SPLIT, "cases": results},
        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
