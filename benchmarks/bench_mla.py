"""DeepSeek's latent attention (MLA) on one GPU: the "triton" backend (absorbed, graph-capturable)
against the "torch" reference backend, at DeepSeek-V2-Lite's dims (16 heads, latent 512, rope
64, nope 128, values 128), bf16.

    PYTHONPATH=src python benchmarks/bench_mla.py --out DIR [--parts attention,e2e]

Parts, each in its own process:
  attention  one layer's attention (backend.forward: the absorbing GEMMs, the kernels, the
             output GEMM), random latent cache:
             decode at batch x context: triton as CUDA-graph replays (20 calls per graph),
             with the shipped tiles (split batches' and one-split batches' own) and with
             each --decode-tiles for both, torch eagerly; GB/s on the bytes a step must
             read (the requests' cached rows, (C + R) x 2 bytes each, plus kv_b_proj's
             weight), beside the copy bandwidth measured in the same run;
             extend (prompts, and a chunk after a cached prefix): µs of the absorbed
             kernel (TFLOP/s on its FLOPs: per visible (query, key) pair and head 2 (2C + R))
             and of the expanded form through SDPA (on 2 x 2 (P + R): q/k/v padded to
             P + R dims; after a prefix with the mask aligned to the last key), against the
             torch backend.
  e2e        DeepSeek-V2-Lite with dummy bf16 weights through the Engine, decode step ms at
             batch 1, 8, 64 over --ctx cached tokens (bench_e2e.decode_timing: events around
             the runner's forward, median of steady steps): triton with decode graphs, triton
             eagerly, and the torch backend (eager: it reads host lengths), beside the floor
             (bench_e2e.decode_bytes over the copy bandwidth measured first); and the time to
             first token of one prompt of each --prompt-tokens length (Engine.generate, 1 new
             token, a fresh prompt each time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = "preset:deepseek-v2-lite"
N, C, R, P, V = 16, 512, 64, 128, 128


def _setup(batch: int, ctx_new: list[tuple[int, int]], mode: Any, page_size: int = 1):
    """(layer, triton backend, torch backend, pool, fb, q) for requests of (prefix, new) tokens
    with a random latent cache."""
    from moeserve.layers.attention import create_attention_backend
    from moeserve.layers.mla import mla_backend_for
    from moeserve.models.spec import MLASpec
    from moeserve.runtime.forward_batch import prepare_batch
    from moeserve.runtime.kv_cache import MLAKVCachePool, ReqToTokenPool

    dev, dtype = torch.device("cuda"), torch.bfloat16
    total = sum(a + b for a, b in ctx_new)
    pool = MLAKVCachePool(1, total + 2 * len(ctx_new) * page_size + 64, C, R, dtype, dev,
                          page_size)
    pool.kv_LSW.normal_(0, 0.5)
    rows = ReqToTokenPool(batch + 1, max(a + b for a, b in ctx_new) + 8, dev)
    req_rows = [rows.alloc() for _ in ctx_new]
    for row, (prefix, _) in zip(req_rows, ctx_new):
        if prefix:
            rows.write(row, 0, pool.alloc(prefix))
    fb = prepare_batch(mode, [[0] * b for _, b in ctx_new], [a for a, _ in ctx_new], req_rows,
                       rows, pool)
    w = torch.randn(N * (P + V), C, device=dev, dtype=dtype) * C ** -0.5
    layer = SimpleNamespace(mla=MLASpec(None, C, P, R, V), heads_local=N, layer_id=0,
                            kv_b_proj=SimpleNamespace(weight=w), scaling=(P + R) ** -0.5)
    q = torch.randn(fb.input_ids.shape[0], N, P + R, device=dev, dtype=dtype)
    return (layer, mla_backend_for(create_attention_backend("triton")),
            mla_backend_for(create_attention_backend("torch")), fb, q)


def part_attention(args: argparse.Namespace) -> dict[str, Any]:
    from moe_common import capture, ceilings, time_us
    from moeserve.runtime.forward_batch import ForwardMode

    out: dict[str, Any] = {**ceilings(), "device": torch.cuda.get_device_name(),
                           "decode": [], "extend": []}
    from moeserve.layers import attention_tiles as TL

    w_bytes = N * (P + V) * C * 2
    shipped_tiles, shipped_whole = TL.MLA_DECODE_TILES, TL.MLA_WHOLE_DECODE_TILES
    for ctx in args.ctx_list:
        for b in args.batches:
            layer, fast, ref, fb, q = _setup(b, [(ctx, 1)] * b, ForwardMode.DECODE)
            want = ref.forward(q, layer, fb)
            nbytes = b * (ctx + 1) * (C + R) * 2 + w_bytes
            row: dict[str, Any] = {
                "batch": b, "ctx": ctx, "bytes": nbytes,
                "floor_us": nbytes / out["copy_GBps"] / 1e3,
                "torch_us": time_us(lambda: ref.forward(q, layer, fb), reps=5, warmup=1)}
            # the shipped tiles ("triton": split batches' and one-split batches' own), then
            # each --decode-tiles (BLOCK_N, warps, stages) for both
            for i, tiles in enumerate([None] + args.decode_tiles):
                if tiles is not None:
                    TL.MLA_DECODE_TILES = shipped_tiles[:2] + tuple(tiles)
                    TL.MLA_WHOLE_DECODE_TILES = tuple(tiles)
                key = "triton" if i == 0 else "tiles_" + "_".join(map(str, tiles))
                calls = 20
                try:
                    replay = capture(lambda: [fast.forward(q, layer, fb) for _ in range(calls)])
                except Exception as exc:  # e.g. a tile that needs more shared memory
                    row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    continue
                us = time_us(replay) / calls
                got = fast.forward(q, layer, fb)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                row.update({f"{key}_us": us, f"{key}_GBps": nbytes / us / 1e3,
                            f"{key}_rel_err": err})
            TL.MLA_DECODE_TILES, TL.MLA_WHOLE_DECODE_TILES = shipped_tiles, shipped_whole
            out["decode"].append(row)
            print(json.dumps(row), flush=True)
            del layer, fast, ref, fb, q

    shipped = TL.MLA_SDPA_MIN_EXTEND
    for prefix, new in args.extends:
        layer, fast, ref, fb, q = _setup(1, [(prefix, new)], ForwardMode.EXTEND)
        row: dict[str, Any] = {"prefix": prefix, "new": new}
        pairs = new * prefix + new * (new + 1) // 2
        # the absorbed kernel, then (fresh prompts) the expanded form through SDPA
        for name, threshold in (("kernel", 1 << 62), ("sdpa", 1)):
            TL.MLA_SDPA_MIN_EXTEND = threshold
            fast._meta = None  # the backend decides on the step's first call
            layer_us = time_us(lambda: fast.forward(q, layer, fb), reps=10)
            row[f"{name}_us"] = layer_us
            got = fast.forward(q, layer, fb)
            want = ref.forward(q, layer, fb)
            row[f"{name}_rel_err"] = ((got.float() - want.float()).norm()
                                      / want.float().norm()).item()
            flops = pairs * N * 2 * (2 * C + R if name == "kernel" else 2 * (P + R))
            row[f"{name}_TFLOPs"] = flops / layer_us / 1e6
        TL.MLA_SDPA_MIN_EXTEND = shipped
        row["torch_us"] = time_us(lambda: ref.forward(q, layer, fb), reps=3, warmup=1)
        out["extend"].append(row)
        print(json.dumps(row), flush=True)
        del layer, fast, ref, fb, q
        torch.cuda.empty_cache()
    return out


def part_e2e(args: argparse.Namespace) -> dict[str, Any]:
    from bench_e2e import decode_bytes, decode_timing, randomize_kv
    from moe_common import ceilings
    from moeserve.runtime.engine import Engine

    from moeserve.layers import attention_tiles as TL

    if args.mla_sdpa_min_extend is not None:
        TL.MLA_SDPA_MIN_EXTEND = args.mla_sdpa_min_extend
    if args.mla_head_gemv_max_tokens is not None:
        TL.MLA_HEAD_GEMV_MAX_TOKENS = args.mla_head_gemv_max_tokens
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "backend": args.backend,
                           "mla_sdpa_min_extend": TL.MLA_SDPA_MIN_EXTEND,
                           "mla_head_gemv_max_tokens": TL.MLA_HEAD_GEMV_MAX_TOKENS,
                           **ceilings()}
    t0 = time.perf_counter()
    engine = Engine(MODEL, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                    attention_backend=args.backend,
                    context_length=max(args.ctx, *args.prompt_tokens) + 64,
                    max_running_requests=max(args.batches))
    out["startup_s"] = time.perf_counter() - t0
    runner = engine._thread._args[0].runner
    randomize_kv(runner.kv_pool)
    out["graphs"] = bool(runner.graphs)
    for b in args.batches:  # the roofline: the bytes a step must read / copy bandwidth
        need = decode_bytes(runner.spec, b, args.ctx)["total"]
        out[f"floor_ms_{b}"] = need / out["copy_GBps"] / 1e6
        print(f"batch {b}: {need / 1e9:.2f} GB a step, floor {out[f'floor_ms_{b}']:.3f} ms",
              flush=True)
    modes = [("graphs", True), ("eager", False)] if runner.graphs else [("eager", False)]
    for name, graphs in modes:
        for b in args.batches:
            steps = 30 if graphs or args.backend == "triton" else 5
            ms = decode_timing(runner, b, args.ctx, graphs, steps)
            out[f"decode_{name}_ms_{b}"] = ms
            print(f"{args.backend} {name} decode batch {b}: {ms:.3f} ms/step", flush=True)
    params = [{"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}]
    out["ttft_ms"] = {}
    fresh = 0
    for n in args.prompt_tokens:
        times = []
        for _ in range(4):  # a first token no prompt before had: nothing in the prefix cache
            fresh += 1
            prompt = [[1000 + fresh] + [(7 * j) % 1000 + 5 for j in range(n - 1)]]
            t = time.perf_counter()
            res = engine.generate(input_ids=prompt, sampling_params=params)
            times.append(time.perf_counter() - t)
            assert res[0]["error"] is None, res
        out["ttft_ms"][n] = sorted(times[1:])[1] * 1e3  # median of the last three
        print(f"{args.backend} one {n}-token prompt: {out['ttft_ms'][n]:.1f} ms", flush=True)
    engine.shutdown()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="mla_out")
    p.add_argument("--parts", default="attention,e2e")
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="triton", help=argparse.SUPPRESS)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--ctx", type=int, default=512, help="cached tokens of the e2e decode")
    p.add_argument("--ctx-list", type=int, nargs="+", default=[512, 4096],
                   help="contexts of the attention part's decode")
    p.add_argument("--extends", type=lambda s: tuple(map(int, s.split(":"))), nargs="+",
                   default=[(0, 512), (0, 1024), (0, 4096), (3072, 1024), (12288, 4096)],
                   metavar="PREFIX:NEW")
    p.add_argument("--decode-tiles", type=lambda s: tuple(map(int, s.split(":"))), nargs="*",
                   default=[], metavar="BLOCK_N:WARPS:STAGES",
                   help="decode kernel tiles timed beside the shipped ones (attention part)")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--mla-sdpa-min-extend", type=int,
                   help="attention_tiles.MLA_SDPA_MIN_EXTEND for the e2e part (default: shipped)")
    p.add_argument("--mla-head-gemv-max-tokens", type=int,
                   help="attention_tiles.MLA_HEAD_GEMV_MAX_TOKENS for the e2e part (0: torch.bmm "
                        "at every size; default: shipped)")
    p.add_argument("--backends", default="triton,torch", help="backends of the e2e part")
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.part:
        fn = {"attention": part_attention, "e2e": part_e2e}[args.part]
        tag = "" if args.mla_sdpa_min_extend is None else f"-sdpa{args.mla_sdpa_min_extend}"
        if args.mla_head_gemv_max_tokens is not None:
            tag += f"-gemv{args.mla_head_gemv_max_tokens}"
        (out_dir / f"{args.part}-{args.backend}{tag}.json").write_text(
            json.dumps(fn(args), indent=1))
        return 0
    rc = 0
    jobs = []
    for part in args.parts.split(","):
        jobs += [(part, b) for b in (args.backends.split(",") if part == "e2e" else ("triton",))]
    for part, backend in jobs:
        cmd = [sys.executable, __file__, "--part", part, "--backend", backend,
               *sys.argv[1:]]
        print("$", " ".join(cmd[1:]), flush=True)
        rc |= subprocess.run(cmd, env=os.environ).returncode
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
