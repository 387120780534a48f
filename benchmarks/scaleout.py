r"""`moeserve bench` throughput by parallel layout on the GPUs of one host, with one GPU in the
same run as the baseline.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        PYTHONPATH=src python -m benchmarks scaleout --gpus 2 --out $OUT [--results ...]

--model's shape (Qwen3-30B-A3B by default) with dummy weights, bf16 or --quantization fp8.
Layouts: one GPU, then tp N with each ep that divides N, with and without DP attention
(--configs picks some, --dp-attention on / off those with / without DP attention, one GPU
always); a layout whose plan does not fit is a row that says why. Each engine
first serves 16 untimed requests, then --prompts-per-concurrency x C prompts of --input-len
random tokens, --output-len greedy tokens each, at each concurrency C.

--profile: each layout's ranks write where their loop's time goes (runtime/step_profile.py),
and the section gets, per layout, rank 0's host phases of a decode iteration (over all the
layout's iterations: run one concurrency per invocation) and the device kernels of ten decode
forwards, taken in an untimed pass at the last concurrency after the timed ones (the profiler
slows what it watches).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import json
import os
import re

from benchmarks import harness
from benchmarks.harness import Ceilings, RunInfo, table

HELP = "moeserve bench by parallel layout against one GPU (several GPUs)"
MODEL = "preset:qwen3-30b-a3b"
METHOD = """\
Output tokens/s of `moeserve bench` (random prompts, greedy, ignore_eos) through one engine per
layout, one run each. The ceiling of throughput at a batch that fills N GPUs is N times the
one-GPU rate of the same run and concurrency; "x one GPU" is the ratio to that rate, and
"ITL x one GPU" the ratio of the ITL p50s."""


def add_arguments(p: Any) -> None:
    harness.add_output_arguments(p)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--quantization", choices=["none", "fp8"], default="none")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256, 1024])
    p.add_argument("--configs", default="",
                   help="';'-separated layout names to run (default: all; see the log)")
    p.add_argument("--dp-attention", choices=["both", "on", "off"], default="both",
                   help="the layouts with DP attention only (on), without it only (off), or "
                   "both; one GPU is always run, and the section's title says which")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prompts-per-concurrency", type=int, default=1)
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--profile", action="store_true",
                   help="per layout, where the ranks' step time goes (see above)")


def dp_filter(configs: dict[str, dict[str, Any]], dp_attention: str
              ) -> dict[str, dict[str, Any]]:
    """One GPU and the layouts with (on) or without (off) DP attention, or all (both)."""
    if dp_attention == "both":
        return configs
    want = dp_attention == "on"
    return {k: v for k, v in configs.items()
            if v.get("tp_size", 1) == 1 or bool(v.get("enable_dp_attention")) == want}


def layouts(n: int) -> dict[str, dict[str, Any]]:
    """One GPU; tp n with each ep that divides it (ep < n: the gather path); at ep = n each
    MoE transport (gather, all_to_all, nvlink); each of them with and without DP attention."""
    found: dict[str, dict[str, Any]] = {"1 GPU (ep 1)": dict(tp_size=1)}
    dp = dict(dp_size=n, enable_dp_attention=True)
    for ep in (e for e in range(1, n + 1) if n % e == 0):
        backends = ("none", "all_to_all", "nvlink") if ep == n else ("none",)
        for backend in backends:
            name = f"tp{n} ep{ep}" + ("" if backend == "none" else f" {backend}")
            kw = dict(tp_size=n, ep_size=ep, moe_a2a_backend=backend)
            found[name] = kw
            found[f"{name}, DP attention (dp {n})"] = dict(kw, **dp)
    return found


PROFILE_FORWARDS = 10  # decode forwards under torch.profiler, in the untimed pass


def bench(args: Any, only: Optional[list[str]]) -> list[dict]:
    from moeserve.bench import random_prompts, run_bench
    from moeserve.runtime.engine import Engine
    from moeserve.runtime.step_profile import DIR_ENV

    configs = dp_filter(layouts(args.gpus), args.dp_attention)
    print(f"layouts: {list(configs)}", flush=True)
    if only:
        unknown = sorted(set(only) - set(configs))
        if unknown:
            raise SystemExit(f"unknown --configs {unknown}; known: {sorted(configs)}")
        configs = {k: v for k, v in configs.items() if k in only}
    rows = []
    quant = {} if args.quantization == "none" else {"quantization": args.quantization}
    for name, kw in configs.items():
        if args.profile:
            os.environ[DIR_ENV] = str(profile_dir(args, name))
        try:
            # every layout's ranks in processes of their own, as the server runs them (a
            # rank in this process would share its interpreter with the bench's clients)
            engine = Engine(args.model, load_format="dummy", dtype="bfloat16",
                            context_length=args.context_length,
                            mem_fraction_static=args.mem_fraction_static,
                            # (at least one decode graph bucket: a multiple of tp)
                            max_running_requests=max(*args.concurrency, kw.get("tp_size", 1)),
                            in_process=False, **quant, **kw)
        except Exception as exc:  # a plan that does not fit, a layout the model cannot take
            why = " ".join(str(exc).split())[:300]
            print(f"{name}: not run: {why}", flush=True)
            rows.append({"config": name, "error": why})
            continue
        with engine as e:
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
            if args.profile:
                profile_pass(e, args, args.concurrency[-1])
        if args.profile:
            rows[-1]["profile"] = read_profile(profile_dir(args, name))
    os.environ.pop(DIR_ENV, None)
    return rows


def profile_pass(engine: Any, args: Any, c: int) -> None:
    """c prompts, untimed, with PROFILE_FORWARDS of their decode forwards profiled: the
    window starts after the prefills the plan's extend budget needs for them (and two more
    forwards), and the prompts generate past its end."""
    from moeserve.bench import random_prompts, run_bench

    per_rank = -(-c // engine.plan.layout.dp) * args.input_len
    skip = -(-per_rank // engine.plan.budget.extend) + 2
    engine.profile_kernels(PROFILE_FORWARDS, skip=skip)
    run_bench(engine, random_prompts(c, args.input_len, engine.spec.vocab_size, seed=c + 1),
              max(args.output_len, skip + PROFILE_FORWARDS + 2), c, progress=False)


def profile_dir(args: Any, name: str) -> Path:
    return Path(args.out) / "profile" / re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def read_profile(folder: Path) -> dict[str, Any]:
    """Rank 0's decode phases (mean µs per iteration) and its kernel report's lines."""
    steps = json.loads((folder / "rank0_steps.json").read_text())
    kernels = folder / "rank0_kernels.txt"
    return {"decode": steps.get("decode"), "prefill": steps.get("prefill"),
            "kernels": kernels.read_text().splitlines() if kernels.exists() else []}


def render_profile(rows: list[dict]) -> list[str]:
    out: list[str] = []
    for r in rows:
        prof = r.get("profile")
        if not prof or not prof["decode"]:
            continue
        d = prof["decode"]
        phases = ", ".join(f"{k} {v['mean_us']:.0f}" for k, v in d["phases"].items()
                           if k != "iteration")
        out += ["", f"{r['config']}, concurrency {r['concurrency']}: {d['iterations']} decode "
                f"iterations of {d['phases']['iteration']['mean_us']:.0f} µs on rank 0 "
                f"(mean µs per iteration: {phases})", "", "```"]
        out += prof["kernels"][:25] + ["```"]
    return out


def render(rows: list[dict]) -> list[str]:
    one = {r["concurrency"]: r for r in rows
           if r["config"].startswith("1 GPU") and "error" not in r}
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["config"], "-", "not run", "-", "-", "-", r["error"]])
            continue
        base = one.get(r["concurrency"])
        itl, base_itl = r["itl_ms_p50"], base and base["itl_ms_p50"]
        out.append([r["config"], r["concurrency"], f"{r['output_tokens_per_s']:.0f}",
                    f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}"
                    if base else "-",
                    f"{r['ttft_ms_p50'] or 0:.0f}", f"{itl or 0:.1f}",
                    f"{itl / base_itl:.2f}" if itl and base_itl else "-"])
    return table(["config", "concurrency", "output tok/s", "x one GPU", "TTFT p50 ms",
                  "ITL p50 ms", "ITL x one GPU"], out)


def run(args: Any, argv: list[str]) -> int:
    harness.require_gpu(args.gpus)
    info = RunInfo.collect("scaleout", argv, gpus=args.gpus)
    ceil: Ceilings = harness.measure_ceilings(peer=True)
    print(ceil.line(), flush=True)
    rows = bench(args, [c for c in args.configs.split(";") if c])
    model = args.model.removeprefix("preset:")
    quant = "" if args.quantization == "none" else f", {args.quantization}"
    dp = {"both": "", "on": ", DP attention", "off": ", no DP attention"}[args.dp_attention]
    text = harness.section(f"Scale-out, {args.gpus} GPUs, {model}{quant}{dp}", METHOD, info, ceil,
                           render(rows) + (render_profile(rows) if args.profile else []))
    harness.save(Path(args.out), "scaleout", {"info": info, "ceilings": ceil, "rows": rows},
                 text, args.results)
    return 0
