"""End to end on one GPU: the Qwen3-30B-A3B shape (or --model, ours only) with dummy bf16
weights: decode steps against their floor, transformers' generate beside them, and `moeserve
bench` on the same engine.

    PYTHONPATH=src python -m benchmarks e2e --out $OUT [--results benchmarks/RESULTS.md]

Each part runs in its own process, so that our model and transformers' never share the GPU:
  ceilings  copy bandwidth and bf16 GEMM rate (benchmarks/harness.py)
  ours      decode step at --batches over --ctx cached tokens (graph replay with its input
            copies; eager at batch 1), the graph replayed back to back, the kernels of the
            steps of --profile-batches (batch 1 by default), experts touched by the dummy
            routing, then one prefill of each --prefill-tokens and `moeserve bench` at
            each --concurrency
  hf        transformers' generate, each experts implementation, batch 1 and 8

With --quantization fp8 (section "End to end, FP8", e2e_fp8.py) the parts are ceilings (with
the FP8 GEMM rate), ours (the bf16 engine's decode steps and prefills) and ours_fp8 (the same
engine with --quantization fp8, all of ours' measurements); `moeserve bench` runs on both
only with --concurrency given, and hf does not run (transformers cannot run our fp8).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks import harness
from benchmarks.harness import Ceilings, RunInfo, table

HELP = "decode step, generate and serving of a whole model on one GPU"
TITLE = "End to end"
MODEL = "preset:qwen3-30b-a3b"
QUANTIZATIONS = ("none", "fp8")
HF_REPS = 5  # transformers' time per token wanders with its host: the median of this many
METHOD = """\
One GPU, dummy bf16 weights, random KV. The floor of a decode step is the bytes it must read
(dense weights, the experts that uniform routing touches, E (1 - (1 - k/E)^B) per MoE layer,
and the KV cache) over the copy bandwidth measured in the same run. moeserve's step is the
runner's decode path (CUDA-graph replay with its input copies) between CUDA events, the median
of the steps after 5 warm-up. The baseline is transformers' `generate` on the same shape with
random weights, each experts implementation, decode ms/token = (time of 1 + n new tokens -
time of 1) / n, the median of 5; it is bound by its host. `moeserve bench` serves random
prompts through the same engine, greedy, ignore_eos."""


def add_arguments(p: Any) -> None:
    harness.add_output_arguments(p)
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="fp8: the engine with --quantization fp8 beside the bf16 one (e2e_fp8.py)")
    p.add_argument("--parts", help="default: ceilings,ours,hf; with --quantization fp8 "
                   "ceilings,ours,ours_fp8")
    p.add_argument("--part", help="run one part in this process (the parent runs each so)")
    p.add_argument("--model", default=MODEL, help="our engine's model (hf: the default only)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--profile-batches", type=int, nargs="*", default=[1],
                   help="batches whose graph decode step is profiled kernel by kernel")
    p.add_argument("--ctx", type=int, default=512, help="cached tokens of each decode request")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--concurrency", type=int, nargs="*",
                   help="`moeserve bench` at each (default: 1 16 64 256; none with fp8)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, nargs="*", default=[],
                   help="also time one prefill of each length (raises the context length)")
    p.add_argument("--experts", default="auto", help="--moe-runner-backend of our engine")
    p.add_argument("--disable-pdl", action="store_true", help="the engine's --disable-pdl")


def resolve_args(args: Any) -> Any:
    """Fill the defaults that follow --quantization (parts, concurrency) and check the parts:
    the same in the parent and in each part's process, which gets the parent's argv."""
    fp8 = args.quantization == "fp8"
    known = ("ceilings", "ours", "ours_fp8") if fp8 else ("ceilings", "ours", "hf")
    if args.parts is None:
        args.parts = ",".join(known)
    if args.concurrency is None:
        args.concurrency = [] if fp8 else [1, 16, 64, 256]
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in known]
    if unknown:
        why = (" (transformers cannot run our fp8: run hf without --quantization)"
               if fp8 and "hf" in unknown else "")
        raise SystemExit(f"--parts {args.parts}: {', '.join(unknown)} is not a part of "
                         f"{'--quantization fp8' if fp8 else 'this run'}; its parts are "
                         f"{', '.join(known)}{why}")
    if "ceilings" not in parts:
        raise SystemExit("--parts must include ceilings: every floor divides by them")
    return args


# --- parts ------------------------------------------------------------------------------------

def part_ceilings(args: Any) -> dict[str, Any]:
    return vars(harness.measure_ceilings(fp8=args.quantization == "fp8"))


def part_ours(args: Any, quantization: Optional[str] = None, detail: bool = True
              ) -> dict[str, Any]:
    """Our engine (with `quantization`, else in bf16): the decode steps and replays at
    --batches, then with `detail` the eager step, the experts touched, the batch-1 kernels and
    the prefills, and `moeserve bench` at --concurrency."""
    from moeserve.bench import random_prompts, run_bench
    from moeserve.parallel.devices import resolve_backends
    from moeserve.runtime.engine import Engine

    from benchmarks import engine_steps as S

    flags: dict[str, Any] = dict(
        load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
        moe_runner_backend=args.experts, context_length=args.ctx + args.output_len + 64,
        max_running_requests=max(args.batches + args.concurrency))
    if quantization is not None:
        flags["quantization"] = quantization
    if args.prefill_tokens:
        longest = max(args.prefill_tokens)
        flags.update(context_length=max(flags["context_length"], longest + 64),
                     chunked_prefill_size=longest)
    if args.disable_pdl:
        flags["disable_pdl"] = True
    t0 = time.perf_counter()
    engine = Engine(args.model, **flags)
    out: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "decode_ms": {},
                           "replay_ms": {}, "eager_ms": {}, "touched": {}, "prefill": [],
                           "bench": []}
    runner = S.engine_runner(engine)
    S.randomize_kv(runner.kv_pool)
    out["backends"] = list(resolve_backends(engine.cfg, runner.device))
    out["graph_buckets"] = list(runner.graphs.buckets) if runner.graphs else []
    for b in args.batches:
        out["decode_ms"][str(b)] = S.decode_ms(runner, b, args.ctx, True, args.steps)
        out["replay_ms"][str(b)] = S.replay_ms(runner, b, args.ctx)
        print(f"{quantization or 'bf16'} decode batch {b}: {out['decode_ms'][str(b)]:.3f} "
              "ms/step", flush=True)
    if detail:
        part_detail(args, runner, out)
    out["prefill"] = [S.prefill_ms(runner, n) for n in args.prefill_tokens]
    for c in args.concurrency:
        prompts = random_prompts(max(2 * c, 8), args.input_len, runner.spec.vocab_size, seed=c)
        s = run_bench(engine, prompts, args.output_len, c, progress=False)
        out["bench"].append({k: v for k, v in s.items() if not isinstance(v, list)})
        print(f"bench concurrency {c}: {s['output_tokens_per_s']:.0f} output tok/s", flush=True)
    engine.shutdown()
    return out


def part_detail(args: Any, runner: Any, out: dict[str, Any]) -> None:
    from benchmarks import engine_steps as S

    out["eager_ms"]["1"] = S.decode_ms(runner, 1, args.ctx, False, 10)
    for b in args.batches:
        seen: list[int] = []
        S.decode_ms(runner, b, args.ctx, False, 1, touched=seen)
        out["touched"][str(b)] = statistics.mean(seen) if seen else None
    out["profiles"] = {str(b): S.kernel_profile(runner, args.ctx, b)
                       for b in args.profile_batches}


def part_hf(args: Any) -> dict[str, Any]:
    import transformers

    from moeserve.config.spec import load_hf_config

    if args.model != MODEL:
        raise SystemExit(f"the hf part builds transformers' Qwen3-MoE only ({MODEL}), not "
                         f"{args.model}: run --parts ceilings,ours for it")
    cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in load_hf_config(MODEL).items()
                                         if k not in ("architectures", "model_type",
                                                      "torch_dtype")})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3MoeForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    model.generation_config.eos_token_id = None
    # what generate runs when no experts implementation is asked for
    out: dict[str, Any] = {"default": getattr(model.config, "_experts_implementation", None),
                           "decode_ms": {}, "context": {}, "errors": {}}
    for impl in ("eager", "grouped_mm", "batched_mm"):
        try:
            model.set_experts_implementation(impl)
        except Exception as exc:  # an implementation this version lacks
            out["errors"][impl] = f"{type(exc).__name__}: {exc}"
            continue
        for b in ("1", "8"):
            # batched_mm gathers every (token, expert) pair's weights: a long prefill of 8
            # requests does not fit, so it retries with a short prompt (decode reads the same
            # weights; only the attention over the cache is shorter)
            for ctx in (args.ctx, 64):
                try:
                    ms = hf_decode_ms(model, cfg.vocab_size, int(b), ctx,
                                      4 if impl == "eager" else 16)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    out["errors"][f"{impl} batch {b} context {ctx}"] = "out of memory"
                    continue
                out["decode_ms"].setdefault(impl, {})[b] = ms
                out["context"].setdefault(impl, {})[b] = ctx
                break
    return out


def hf_decode_ms(model: Any, vocab: int, batch: int, ctx: int, n: int) -> float:
    """(time of generate with 1 + n new tokens - time with 1) / n, ms: the median of HF_REPS
    such differences."""
    ids = torch.randint(0, vocab, (batch, ctx), device="cuda")

    def gen(new: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(2)
    return statistics.median((gen(1 + n) - gen(1)) / n * 1e3 for _ in range(HF_REPS))


PARTS = {"ceilings": part_ceilings, "hf": part_hf,
         # with --quantization fp8, ours is the bf16 step beside ours_fp8's
         "ours": lambda args: part_ours(args, detail=args.quantization == "none"),
         "ours_fp8": lambda args: part_ours(args, "fp8")}


# --- the section ------------------------------------------------------------------------------

def render(res: dict[str, Any]) -> str:
    from moeserve.config.spec import load_model_spec

    from benchmarks.engine_steps import decode_bytes

    a, ours, hf = res["args"], res.get("ours", {}), res.get("hf", {})
    ceil = Ceilings(**res["ceilings"])
    spec = load_model_spec(a["model"])
    bw = ceil.copy_GBps * 1e9
    buckets = ours.get("graph_buckets", [])
    body = [f"moeserve: attention / experts backends {ours.get('backends')}, CUDA-graph buckets "
            f"{buckets[:3]}...{buckets[-1:]}, startup {ours.get('startup_s', 0):.0f} s.", "",
            f"Decode step, context {a['ctx']} tokens per request (floor: bytes / copy bandwidth; "
            f"moeserve: median of {a['steps']} steps):", ""]
    rows, best_hf = [], {}
    for b in map(str, a["batches"]):
        f = decode_bytes(spec, int(b), a["ctx"])
        floor = f["total"] / bw * 1e3
        ms = ours.get("decode_ms", {}).get(b)
        times = [v[b] for v in hf.get("decode_ms", {}).values() if b in v]
        best_hf[b] = min(times) if times else None
        cells = [b, f"{f['total'] / 1e9:.2f} GB ({f['dense'] / 1e9:.2f} + "
                 f"{f['experts'] / 1e9:.2f} + {f['kv'] / 1e9:.2f})", f"{floor:.2f}"]
        cells += ([f"{ms:.2f}", f"{ms / floor:.2f}", f"{f['total'] / ms / 1e6:.0f}",
                   f"{int(b) / ms * 1e3:.0f}"] if ms else ["-"] * 4)
        cells += ([f"{best_hf[b]:.1f}", f"{best_hf[b] / ms:.0f}x"] if best_hf[b] and ms
                  else ["-", "-"])
        rows.append(cells)
    body += table(["batch", "bytes/step (dense + experts + KV)", "floor ms", "moeserve ms/step",
                   "x floor", "GB/s", "tokens/s", "transformers best ms/token", "speedup"], rows)
    body += engine_notes(ours)
    body += render_hf(hf, a["ctx"], ours.get("decode_ms", {}).get("1"))
    body += render_bench(ours.get("bench", []), a, spec, bw, best_hf.get("1"))
    return harness.section(TITLE, METHOD, RunInfo(**res["info"]), ceil, body)


def engine_notes(ours: dict[str, Any], baseline: Optional[dict[str, Any]] = None
                 ) -> list[str]:
    """What a part measured beside its decode steps: the eager step, the graphs replayed back
    to back, the profiled steps' kernels, the prefills (beside the baseline part's prefills,
    the bf16 engine of the same run, where it has them)."""
    body: list[str] = []
    if ours.get("eager_ms", {}).get("1"):
        body += ["", f"Batch 1 without CUDA graphs (eager): {ours['eager_ms']['1']:.2f} ms/step."]
    replays = {b: v for b, v in ours.get("replay_ms", {}).items() if v}
    if replays:
        body += ["", "Decode graph replayed back to back (the device's time when the host is "
                 "ahead): " + ", ".join(f"batch {b} {v:.2f} ms" for b, v in replays.items())
                 + "."]
    for batch, prof in ours.get("profiles", {}).items():
        body += ["", f"Batch-{batch} graph step under torch.profiler: "
                 f"{prof['kernels_per_step']:.0f} kernels, the device busy "
                 f"{prof['busy_ms_per_step']:.2f} ms (their spans summed: "
                 f"{prof['kernel_ms_per_step']:.2f} ms; under PDL a kernel's span holds its "
                 "wait for the one before, its exclusive time does not); the largest by "
                 "exclusive time:", ""]
        body += table(["kernel", "exclusive ms/step", "span ms/step", "launches/step"],
                      [[f"`{k['name'][:60]}`", f"{k['ms']:.3f}", f"{k['span_ms']:.3f}",
                        k["calls"]] for k in prof["top"]])
    if ours.get("prefill"):
        base = {p["tokens"]: p for p in (baseline or {}).get("prefill", [])}
        body += ["", "One prefill (CUDA events; host = the model call"
                 + ("; bf16: the bf16 engine's, same run" if base else "") + "):", ""]
        heads = ["tokens", "eager device ms", "eager host ms", "prefill graphs device ms",
                 "graphs host ms"]
        rows = [[p["tokens"], f"{p['eager_ms']:.2f}", f"{p['eager_host_ms']:.2f}",
                 f"{p['graph_ms']:.2f}" if "graph_ms" in p else "-",
                 f"{p['graph_host_ms']:.2f}" if "graph_ms" in p else "-"]
                for p in ours["prefill"]]
        if base:
            heads += ["bf16 device ms (graphs, else eager)", "/ bf16"]
            for row, p in zip(rows, ours["prefill"]):
                b = base.get(p["tokens"], {})
                mine, theirs = _prefill_device_ms(p), _prefill_device_ms(b)
                row += [f"{theirs:.2f}" if theirs else "-",
                        f"{mine / theirs:.2f}" if theirs else "-"]
        body += table(heads, rows)
    return body


def _prefill_device_ms(p: dict[str, Any]) -> Optional[float]:
    """A prefill's device ms as the engine runs it: through the prefill graphs where a
    captured size holds it, else eagerly."""
    return p.get("graph_ms", p.get("eager_ms"))


def render_hf(hf: dict[str, Any], ctx: int, ours_ms: Any) -> list[str]:
    if not hf.get("decode_ms"):
        return []
    body = ["", f"transformers `generate` (same shape, random bf16, context {ctx}), decode "
            "ms/token by experts implementation:", ""]
    rows = []
    for impl, v in hf["decode_ms"].items():
        used = hf.get("context", {}).get(impl, {})
        cells = [f"{v[b]:.1f}" + ("" if used.get(b) == ctx else f" (context {used.get(b)})")
                 if b in v else "-" for b in ("1", "8")]
        rows.append([impl + (" (the default)" if impl == hf.get("default") else ""), *cells])
    rows += [[what, err[:80], ""] for what, err in hf.get("errors", {}).items()]
    body += table(["implementation", "batch 1", "batch 8"], rows)
    default_ms = hf["decode_ms"].get(hf.get("default"), {}).get("1")
    fastest = [v["1"] for v in hf["decode_ms"].values() if "1" in v]
    if default_ms and ours_ms and fastest:
        body += ["", f"`generate` as shipped (no experts implementation asked for) runs "
                 f"{hf['default']}: {default_ms:.1f} ms/token at batch 1, "
                 f"{default_ms / ours_ms:.1f}x our step; its fastest, {min(fastest):.1f} "
                 "ms/token, is the table's \"best\"."]
    return body


def render_bench(bench: list[dict[str, Any]], a: dict[str, Any], spec: Any, bw: float,
                 hf_best: Any, quant: Optional[Any] = None, engine: str = "the same engine"
                 ) -> list[str]:
    """The rows of `moeserve bench`; `quant`: the engine's weights are fp8 (the floor's
    bytes follow)."""
    from benchmarks.engine_steps import decode_bytes

    if not bench:
        return []
    body = ["", f"`moeserve bench` on {engine}: max(2 x concurrency, 8) prompts of "
            f"{a['input_len']} random tokens, {a['output_len']} output tokens each, greedy, "
            "ignore_eos:", ""]
    body += table(["concurrency", "output tok/s", "TTFT p50 ms", "ITL p50 ms", "ITL p90 ms"],
                  [[s["max_concurrency"], f"{s['output_tokens_per_s']:.0f}",
                    f"{s['ttft_ms_p50'] or 0:.1f}", f"{s['itl_ms_p50'] or 0:.2f}",
                    f"{s['itl_ms_p90'] or 0:.2f}"] for s in bench])
    one = [s for s in bench if s["max_concurrency"] == 1 and s["itl_ms_p50"]]
    if one:  # the per-token time a lone client sees, the host's part included
        itl, mean_ctx = one[0]["itl_ms_p50"], a["input_len"] + a["output_len"] // 2
        floor = decode_bytes(spec, 1, mean_ctx, quant=quant)["total"] / bw * 1e3
        body += ["", f"At concurrency 1 the ITL p50 is {itl:.2f} ms: {itl / floor:.2f}x the "
                 f"batch-1 floor at the mean context ({mean_ctx} tokens)"
                 + (f", {hf_best / itl:.1f}x faster than transformers' best" if hf_best else "")
                 + "."]
    return body


# --- driver -----------------------------------------------------------------------------------

def run(args: Any, argv: list[str]) -> int:
    from moeserve.config.spec import load_model_spec

    out, args = Path(args.out), resolve_args(args)
    if args.part:
        return harness.run_part(out, f"e2e_{args.part}", lambda: PARTS[args.part](args))
    if load_model_spec(args.model).quant is not None:
        raise SystemExit(f"{args.model} ships fp8 weights: e2e measures a bf16 model with dummy "
                         "weights (and with --quantization fp8 the same model quantized at load)")
    fp8 = args.quantization == "fp8"
    res: dict[str, Any] = {"args": vars(args), "info": vars(RunInfo.collect(
        "e2e", argv, extra_versions=() if fp8 else ("transformers",)))}
    for part in args.parts.split(","):
        rc = subprocess.call([sys.executable, "-m", "benchmarks", "e2e", *argv, "--part", part],
                             cwd=harness.REPO)
        path = out / f"e2e_{part}.json"
        if rc or not path.exists():
            print(f"part {part} failed (exit {rc})", flush=True)
            return rc or 1
        res[part] = json.loads(path.read_text())
    if fp8:
        from benchmarks import e2e_fp8

        harness.save(out, "e2e_fp8", res, e2e_fp8.render(res), args.results)
    else:
        harness.save(out, "e2e", res, render(res), args.results)
    return 0
