r"""`moeserve bench` throughput by parallel layout on the GPUs of one host, with one GPU in the
same run as the baseline.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        PYTHONPATH=src python -m benchmarks scaleout --gpus 2 --out $OUT [--results ...]

The Qwen3-30B-A3B shape with dummy bf16 weights. Layouts: one GPU, then tp N with each ep
that divides N, with and without DP attention (--configs picks some). Each engine first
serves 16 untimed requests (Triton compiles on first use), then --prompts-per-concurrency x C
prompts of --input-len random tokens, --output-len greedy tokens each, at each concurrency C.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from benchmarks import harness
from benchmarks.harness import Ceilings, RunInfo, table

HELP = "moeserve bench by parallel layout against one GPU (several GPUs)"
MODEL = "preset:qwen3-30b-a3b"
METHOD = """\
Output tokens/s of `moeserve bench` (random prompts, greedy, ignore_eos) through one engine per
layout, one run each. The ceiling of throughput at a batch that fills N GPUs is N times the
one-GPU rate of the same run and concurrency; "x one GPU" is the ratio to that rate."""


def add_arguments(p: Any) -> None:
    harness.add_output_arguments(p)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--configs", default="",
                   help="';'-separated layout names to run (default: all; see the log)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prompts-per-concurrency", type=int, default=1)
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)


def layouts(n: int) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {"1 GPU (ep 1)": dict(tp_size=1)}
    for ep in range(1, n + 1):
        if n % ep == 0:
            found[f"tp{n} ep{ep}"] = dict(tp_size=n, ep_size=ep)
            found[f"tp{n} ep{ep}, DP attention (dp {n})"] = dict(
                tp_size=n, ep_size=ep, dp_size=n, enable_dp_attention=True)
    for backend in ("all_to_all", "nvlink"):  # whole experts per rank: ep = tp
        found[f"tp{n} ep{n} {backend}"] = dict(tp_size=n, ep_size=n, moe_a2a_backend=backend)
        found[f"tp{n} ep{n} {backend}, DP attention (dp {n})"] = dict(
            tp_size=n, ep_size=n, dp_size=n, enable_dp_attention=True, moe_a2a_backend=backend)
    return found


def bench(args: Any, only: Optional[list[str]]) -> list[dict]:
    from moeserve.bench import random_prompts, run_bench
    from moeserve.runtime.engine import Engine

    configs = layouts(args.gpus)
    print(f"layouts: {list(configs)}", flush=True)
    if only:
        unknown = sorted(set(only) - set(configs))
        if unknown:
            raise SystemExit(f"unknown --configs {unknown}; known: {sorted(configs)}")
        configs = {k: v for k, v in configs.items() if k in only}
    rows = []
    for name, kw in configs.items():
        with Engine(MODEL, load_format="dummy", dtype="bfloat16",
                    context_length=args.context_length,
                    mem_fraction_static=args.mem_fraction_static,
                    max_running_requests=max(args.concurrency), **kw) as e:
            run_bench(e, random_prompts(16, args.input_len, e.spec.vocab_size, seed=0), 4, 16,
                      progress=False)
            for c in args.concurrency:
                prompts = random_prompts(c * args.prompts_per_concurrency, args.input_len,
                                         e.spec.vocab_size, seed=c)
                s = run_bench(e, prompts, args.output_len, c, progress=False)
                rows.append({"config": name, "concurrency": c, **{
                    k: s[k] for k in ("output_tokens_per_s", "input_tokens_per_s",
                                      "ttft_ms_p50", "itl_ms_p50", "completed", "num_prompts")}})
                print(rows[-1], flush=True)
    return rows


def render(rows: list[dict]) -> list[str]:
    one = {r["concurrency"]: r["output_tokens_per_s"] for r in rows
           if r["config"].startswith("1 GPU")}
    out = []
    for r in rows:
        base = one.get(r["concurrency"])
        out.append([r["config"], r["concurrency"], f"{r['output_tokens_per_s']:.0f}",
                    f"{r['output_tokens_per_s'] / base:.2f}" if base else "-",
                    f"{r['ttft_ms_p50'] or 0:.0f}", f"{r['itl_ms_p50'] or 0:.1f}"])
    return table(["config", "concurrency", "output tok/s", "x one GPU", "TTFT p50 ms",
                  "ITL p50 ms"], out)


def run(args: Any, argv: list[str]) -> int:
    harness.require_gpu(args.gpus)
    info = RunInfo.collect("scaleout", argv, gpus=args.gpus)
    ceil: Ceilings = harness.measure_ceilings(peer=True)
    print(ceil.line(), flush=True)
    rows = bench(args, [c for c in args.configs.split(";") if c])
    text = harness.section(f"Scale-out, {args.gpus} GPUs", METHOD, info, ceil, render(rows))
    harness.save(Path(args.out), "scaleout", {"info": info, "ceilings": ceil, "rows": rows},
                 text, args.results)
    return 0
