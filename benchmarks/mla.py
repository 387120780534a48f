r"""DeepSeek's latent attention (MLA) on one GPU: the "triton" backend (absorbed, graph-
capturable) against the "torch" reference backend, at DeepSeek-V2-Lite's dims (16 heads,
latent 512, rope 64, nope 128, values 128), bf16.

    PYTHONPATH=src python -m benchmarks mla --out $OUT [--parts attention,e2e] \
        [--results benchmarks/RESULTS.md]

Each part (and each backend of e2e) runs in its own process:
  attention  one layer's attention (the absorbing GEMMs, the kernels, the output GEMM) on a
             random latent cache: decode at --batches x --ctx-list (triton as CUDA-graph
             replays of 20 calls, with the shipped tiles and each --decode-tiles; torch
             eagerly); extend at --extends (the absorbed kernel, and the expanded form
             through SDPA), against the torch backend
  e2e        DeepSeek-V2-Lite with dummy bf16 weights through the Engine: decode step ms at
             --batches over --ctx cached tokens (graphs and eager), and the time to first
             token of one fresh prompt of each --prompt-tokens length
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import Ceilings, RunInfo, table

HELP = "latent attention (DeepSeek): one layer and end to end, triton against torch"
MODEL = "preset:deepseek-v2-lite"
N, C, R, P, V = 16, 512, 64, 128, 128  # heads, latent, rope, nope, values
CALLS = 20
LAYER_METHOD = """\
One layer's latent attention, random latent cache, DeepSeek-V2-Lite dims. Decode: floor = the
bytes a step must read (the requests' cached rows, (512 + 64) x 2 bytes each, plus kv_b_proj's
weight) over the copy bandwidth; triton as CUDA-graph replays of 20 calls, both absorbing
GEMMs included. Extend, one request, eager: TFLOP/s on each form's own FLOPs per visible
(query, key) pair and head, 2 (2 x 512 + 64) absorbed and 2 x 2 (128 + 64) expanded. The
baseline is the torch backend (eager: it reads host lengths)."""
E2E_METHOD = """\
DeepSeek-V2-Lite with dummy bf16 weights on one GPU, random latent cache. Floor = the bytes a
decode step must read (e2e.py's decode_bytes) over the copy bandwidth measured in the same
run; the step is the runner's forward between CUDA events, the median of the steps after 5
warm-up. The baseline is the torch MLA backend, eager. Time to first token: Engine.generate of
one fresh prompt with 1 new token (each prompt's first token is new, so the prefix cache holds
none of it), the median of the last three of four."""


def add_arguments(p: Any) -> None:
    harness.add_output_arguments(p)
    p.add_argument("--parts", default="attention,e2e")
    p.add_argument("--part", help="run one part in this process (the parent runs each so)")
    p.add_argument("--backend", default="triton", help="the e2e part's backend (with --part)")
    p.add_argument("--backends", default="triton,torch", help="backends of the e2e part")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--ctx", type=int, default=512, help="cached tokens of the e2e decode")
    p.add_argument("--ctx-list", type=int, nargs="+", default=[512, 4096],
                   help="contexts of the attention part's decode")
    p.add_argument("--extends", type=lambda s: tuple(map(int, s.split(":"))), nargs="+",
                   default=[(0, 512), (0, 1024), (0, 4096), (3072, 1024), (12288, 4096)],
                   metavar="PREFIX:NEW")
    p.add_argument("--decode-tiles", type=lambda s: tuple(map(int, s.split(":"))), nargs="*",
                   default=[], metavar="BLOCK_N:WARPS:STAGES",
                   help="decode tiles timed beside the shipped ones (attention part)")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 2048])


def setup(batch: int, ctx_new: list[tuple[int, int]], mode: Any) -> tuple:
    """(layer, torch backend, forward batch, q) for requests of (prefix, new) tokens over a
    random latent cache."""
    from moeserve.batch.forward_batch import prepare_batch
    from moeserve.batch.kv_cache import MLAKVCachePool, ReqToTokenPool
    from moeserve.config.spec import MLASpec
    from moeserve.layers.mla import TorchMLABackend

    dev, dtype = torch.device("cuda"), torch.bfloat16
    total = sum(a + b for a, b in ctx_new)
    pool = MLAKVCachePool(1, total + 2 * len(ctx_new) + 64, C, R, dtype, dev, 1)
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
    return layer, TorchMLABackend(), fb, q


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def triton_backend(**tiles: Any) -> Any:
    """The triton MLA backend with the shipped tiles but for `tiles` (AttentionTiles fields)."""
    from moeserve.kernels.attention.tiles import ATTENTION_TILES
    from moeserve.layers.mla_triton import TritonMLABackend

    return TritonMLABackend(dataclasses.replace(ATTENTION_TILES, **tiles))


def part_attention(args: Any) -> dict[str, Any]:
    from moeserve.batch.forward_batch import ForwardMode
    from moeserve.kernels.attention.tiles import ATTENTION_TILES

    ceil = harness.measure_ceilings()
    out: dict[str, Any] = {"ceilings": vars(ceil), "decode": [], "extend": []}
    w_bytes = N * (P + V) * C * 2
    for ctx in args.ctx_list:
        for b in args.batches:
            layer, ref, fb, q = setup(b, [(ctx, 1)] * b, ForwardMode.DECODE)
            want = ref.forward(q, layer, fb)
            nbytes = b * (ctx + 1) * (C + R) * 2 + w_bytes
            row: dict[str, Any] = {"batch": b, "ctx": ctx, "floor_us": ceil.floor_us(nbytes),
                                   "GB": nbytes / 1e9, "torch_us": harness.time_us(
                                       lambda: ref.forward(q, layer, fb), reps=5, warmup=1)}
            for tiles in [None, *args.decode_tiles]:  # the shipped tiles first
                key = "triton" if tiles is None else "tiles " + ":".join(map(str, tiles))
                # a variant takes the same tiles for split and one-split batches
                fast = triton_backend() if tiles is None else triton_backend(
                    mla_decode=ATTENTION_TILES.mla_decode[:2] + tuple(tiles),
                    mla_whole_decode=tuple(tiles))
                try:
                    row[f"{key} us"] = harness.graph_us(
                        lambda: [fast.forward(q, layer, fb) for _ in range(CALLS)], calls=CALLS)
                    row[f"{key} rel_err"] = rel_err(fast.forward(q, layer, fb), want)
                except Exception as exc:  # e.g. tiles that need more shared memory
                    row[f"{key} error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            out["decode"].append(row)
            print(json.dumps(row), flush=True)
            del layer, ref, fb, q
    for prefix, new in args.extends:
        layer, ref, fb, q = setup(1, [(prefix, new)], ForwardMode.EXTEND)
        want = ref.forward(q, layer, fb)
        row = {"prefix": prefix, "new": new}
        pairs = new * prefix + new * (new + 1) // 2
        # the absorbed kernel, then the expanded form through SDPA
        for name, at_least, per_pair in (("kernel", 1 << 62, 2 * C + R), ("sdpa", 1, 2 * (P + R))):
            fast = triton_backend(mla_sdpa_min_extend=at_least)
            us = harness.time_us(lambda: fast.forward(q, layer, fb), reps=10)
            row[f"{name}_us"] = us
            row[f"{name}_TFLOPs"] = pairs * N * 2 * per_pair / us / 1e6
            row[f"{name}_rel_err"] = rel_err(fast.forward(q, layer, fb), want)
        row["torch_us"] = harness.time_us(lambda: ref.forward(q, layer, fb), reps=3, warmup=1)
        out["extend"].append(row)
        print(json.dumps(row), flush=True)
        del layer, ref, fb, q
        torch.cuda.empty_cache()
    return out


def part_e2e(args: Any) -> dict[str, Any]:
    from moeserve.runtime.engine import Engine

    from benchmarks import engine_steps as S

    ceil = harness.measure_ceilings()
    out: dict[str, Any] = {"ceilings": vars(ceil), "decode": {}, "ttft_ms": {}}
    t0 = time.perf_counter()
    engine = Engine(MODEL, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                    attention_backend=args.backend,
                    context_length=max(args.ctx, *args.prompt_tokens) + 64,
                    max_running_requests=max(args.batches))
    out["startup_s"] = time.perf_counter() - t0
    runner = S.engine_runner(engine)
    S.randomize_kv(runner.kv_pool)
    out["floor"] = {b: S.decode_bytes(runner.spec, b, args.ctx)["total"] for b in args.batches}
    for graphs in ([True, False] if runner.graphs else [False]):
        for b in args.batches:
            steps = 30 if graphs or args.backend == "triton" else 5
            out["decode"][f"{'graphs' if graphs else 'eager'} {b}"] = S.decode_ms(
                runner, b, args.ctx, graphs, steps)
    params = [{"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}]
    fresh = 0
    for n in args.prompt_tokens:
        times = []
        for _ in range(4):
            fresh += 1
            prompt = [[1000 + fresh] + [(7 * j) % 1000 + 5 for j in range(n - 1)]]
            t = time.perf_counter()
            res = engine.generate(input_ids=prompt, sampling_params=params)
            times.append(time.perf_counter() - t)
            if res[0]["error"] is not None:
                raise RuntimeError(f"a {n}-token prompt failed: {res[0]['error']}")
        out["ttft_ms"][n] = sorted(times[1:])[1] * 1e3
    engine.shutdown()
    return out


def render_layer(att: dict[str, Any], tiles: list) -> list[str]:
    extra = ["tiles " + ":".join(map(str, t)) for t in tiles]
    rows = []
    for r in att["decode"]:
        tri = r.get("triton us")
        cells = [f"{r['batch']} x {r['ctx']}", f"{r['floor_us']:.1f}",
                 f"{tri:.1f}" if tri else r.get("triton error", "-")[:40],
                 f"{r['GB'] * 1e6 / tri:.0f}" if tri else "-", f"{r['torch_us']:.0f}",
                 f"{r['triton rel_err']:.1e}" if tri else "-"]
        rows.append(cells + [f"{r[k + ' us']:.1f}" if k + " us" in r else "-" for k in extra])
    body = ["Decode, one layer:", ""]
    body += table(["batch x context", "floor µs", "triton µs", "GB/s", "torch backend µs",
                   "rel. error", *(f"{k} µs" for k in extra)], rows)
    body += ["", "Extend, one request (eager):", ""]

    def form(r: dict, name: str) -> str:
        return f"{r[name + '_us']:.0f} ({r[name + '_TFLOPs']:.0f})" if name + "_us" in r else "-"

    body += table(["prefix + new tokens", "absorbed kernel µs (TFLOP/s)",
                   "SDPA, expanded µs (TFLOP/s)", "torch backend µs"],
                  [[f"{r['prefix']} + {r['new']}", form(r, "kernel"), form(r, "sdpa"),
                    f"{r['torch_us']:.0f}"] for r in att["extend"]])
    return body


def render_e2e(fast: dict[str, Any], ref: dict[str, Any], batches: list[int]) -> list[str]:
    bw = fast["ceilings"]["copy_GBps"] * 1e9
    rows = []
    for b in map(str, batches):
        graph, eager = fast["decode"].get(f"graphs {b}"), fast["decode"].get(f"eager {b}")
        torch_ms = ref.get("decode", {}).get(f"eager {b}")
        floor = fast["floor"][b] / bw * 1e3
        rows.append([b, f"{fast['floor'][b] / 1e9:.2f} GB", f"{floor:.3f}",
                     f"{graph:.3f}" if graph else "-", f"{graph / floor:.2f}" if graph else "-",
                     f"{eager:.1f}" if eager else "-", f"{torch_ms:.1f}" if torch_ms else "-",
                     f"{torch_ms / graph:.0f}x" if torch_ms and graph else "-"])
    body = table(["batch", "bytes a step", "floor ms", "triton, decode graphs ms", "x floor",
                  "triton eager ms", "torch backend ms", "speedup"], rows)
    body += ["", "Time to first token of one fresh prompt:", ""]
    body += table(["prompt", "triton", "torch backend (eager)"],
                  [[n, f"{ms:.1f} ms", f"{ref['ttft_ms'][n]:.1f} ms" if n in ref.get(
                      "ttft_ms", {}) else "-"] for n, ms in fast["ttft_ms"].items()])
    return body


def run(args: Any, argv: list[str]) -> int:
    out = Path(args.out)
    if args.part:
        part = part_attention if args.part == "attention" else part_e2e
        return harness.run_part(out, f"mla_{args.part}_{args.backend}", lambda: part(args))
    info = RunInfo.collect("mla", argv)
    parts = args.parts.split(",")
    jobs = [("attention", "triton")] if "attention" in parts else []
    jobs += [("e2e", b) for b in args.backends.split(",")] if "e2e" in parts else []
    res: dict[str, Any] = {"info": info}
    for part, backend in jobs:
        rc = subprocess.call([sys.executable, "-m", "benchmarks", "mla", *argv, "--part", part,
                              "--backend", backend], cwd=harness.REPO)
        path = out / f"mla_{part}_{backend}.json"
        if rc or not path.exists():
            print(f"part {part} ({backend}) failed (exit {rc})", flush=True)
            return rc or 1
        res[f"{part} {backend}"] = json.loads(path.read_text())
    if "attention triton" in res:
        att = res["attention triton"]
        text = harness.section("Latent attention (MLA), one layer", LAYER_METHOD, info,
                               Ceilings(**att["ceilings"]), render_layer(att, args.decode_tiles))
        harness.save(out, "mla_layer", res, text, args.results)
    if "e2e triton" in res:
        fast, ref = res["e2e triton"], res.get("e2e torch", {})
        text = harness.section("Latent attention (MLA), end to end", E2E_METHOD, info,
                               Ceilings(**fast["ceilings"]), render_e2e(fast, ref, args.batches))
        harness.save(out, "mla_e2e", res, text, args.results)
    return 0
