"""End to end on one GPU: the Qwen3-30B-A3B shape (or --model, ours only) with dummy bf16
weights.

    PYTHONPATH=src python benchmarks/bench_e2e.py --out /tmp/e2e          # everything
    PYTHONPATH=src python benchmarks/bench_e2e.py --splice benchmarks/RESULTS.md \
        --from /tmp/e2e/e2e.json                                           # write the section

In one run, each part in its own process (so that our model and transformers' never share
the GPU's memory):
  ceilings  device-to-device copy bandwidth (1 GiB, read + write counted), bf16 GEMM 8192^3
  ours      decode step time at batch 1, 8, 64, 256 over a context of --ctx tokens (random KV),
            timed with CUDA events over steady-state steps after warm-up: the runner's decode
            path (graph replay, inputs copied in) and, for reference, eager at batch 1; then
            `moeserve bench` (bench.run_bench on the same Engine) at several concurrencies
  hf        transformers' generate on the same shape (random bf16 weights), each experts
            implementation ("eager", "grouped_mm", "batched_mm"), batch 1 and 8: decode
            ms/token = (time of 1 + n new tokens - time of 1 new token) / n, the median
            of HF_REPS such differences
The roofline of a decode step: dense weights (attention, router, LM head) + the expected
touched experts E (1 - (1 - k/E)^B) of each MoE layer + the KV bytes read, over the measured
copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

MODEL = "preset:qwen3-30b-a3b"
HF_REPS = 5  # transformers' decode time: the median of this many measurements


# --- the floor --------------------------------------------------------------------------------

def decode_bytes(spec: Any, batch: int, ctx: int, elem: int = 2) -> dict[str, float]:
    """Bytes one decode step of `batch` requests with `ctx` cached tokens each must read."""
    from moeserve.parallel.layout import ParallelLayout
    from moeserve.plan.memory import attention_params, kv_elems_per_token_per_layer

    one_gpu = ParallelLayout(tp=1, dp=1, ep=1, dense_tp=1, a2a=False)
    h, layers = spec.hidden_size, spec.num_layers
    attn = attention_params(spec, one_gpu) + 2 * h  # and the layer's two norms
    moe_layers = len(spec.moe_layers)
    e, k = spec.num_experts, spec.top_k
    touched = e * (1 - (1 - k / e) ** batch)
    expert = 3 * h * spec.moe_intermediate_size
    shared = 3 * h * spec.shared_expert_intermediate_size
    dense = (attn * layers + (e * h + shared) * moe_layers
             + 3 * h * spec.dense_intermediate_size * (layers - moe_layers)
             + spec.vocab_size * h + batch * h) * elem
    experts = touched * expert * moe_layers * elem
    kv = batch * ctx * layers * kv_elems_per_token_per_layer(spec, one_gpu) * elem
    return {"dense": dense, "experts": experts, "kv": kv, "total": dense + experts + kv,
            "touched_experts_per_layer": touched}


# --- parts (each runs in its own process) -----------------------------------------------------

def randomize_kv(pool: Any) -> None:
    """Random cached K/V (or latent rows): the timings never read zeros."""
    storage = pool.kv_LSW if hasattr(pool, "kv_LSW") else pool.kv_LSKD
    storage.normal_(0, 0.5)


def part_ceilings(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from moe_common import ceilings  # the same ceilings bench_moe.py measures

    return {**ceilings(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda}


def expert_backend() -> str:
    import moeserve.moe.experts as X

    if "triton" in X.EXPERTS:
        return "auto"
    return "grouped_mm" if "grouped_mm" in X.EXPERTS else "reference"


def decode_timing(runner: Any, batch: int, ctx: int, graphs: bool, steps: int,
                  touched: Optional[list[int]] = None) -> float:
    """Median ms of one decode step (events around each step) of `batch` requests that hold
    `ctx` tokens each, through the decode graphs or, with graphs=False, eagerly (neither the
    decode nor the prefill graphs); the batch's rows and slots are given back afterwards.
    `touched` (eager only) gets the distinct experts of each MoE layer of the first step."""
    from moeserve.parallel.step import step_from_counts
    from moeserve.runtime.forward_batch import ForwardMode
    from moeserve.runtime.scheduler import ScheduledBatch

    rows = [runner.req_pool.alloc() for _ in range(batch)]
    slots = [runner.kv_pool.alloc(ctx + 1) for _ in rows]
    if None in rows or any(s is None for s in slots):
        raise RuntimeError(f"the KV cache cannot hold {batch} x {ctx + 1} tokens")
    for r, s in zip(rows, slots):
        runner.req_pool.write(r, 0, s)
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, runner.spec.vocab_size, (batch,), generator=gen).tolist()
    loc = torch.stack([s[-1] for s in slots])
    sched = ScheduledBatch(ForwardMode.DECODE, [SimpleNamespace(row=r) for r in rows],
                           [[i] for i in ids], [ctx] * batch, loc, [True] * batch)
    lay = runner.plan.layout
    step = step_from_counts([batch] * lay.tp, lay, 0, runner.plan)
    times = []
    pieces, hooks = runner.prefill_graphs, []
    if not graphs:
        runner.prefill_graphs = None  # their pieces would take an eager decode step
        if touched is not None:
            from moeserve.moe.router import Router

            hooks = [m.register_forward_hook(lambda _m, _i, out: touched.append(
                int(out[0].unique().numel()))) for m in runner.model.modules()
                if isinstance(m, Router)]
    try:
        for i in range(steps + 5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            runner.forward(sched, step, all_decode=graphs)
            b.record()
            b.synchronize()
            for h in hooks:  # the first step's routing only
                h.remove()
            hooks = []
            if i >= 5:
                times.append(a.elapsed_time(b))
    finally:
        runner.prefill_graphs = pieces
        for h in hooks:
            h.remove()
    for r, s in zip(rows, slots):
        runner.kv_pool.free(s)
        runner.req_pool.free(r)
    return statistics.median(times)


def kernel_profile(runner: Any, ctx: int, graphs: bool) -> dict[str, Any]:
    """Kernels of one batch-1 decode step under torch.profiler: count, summed device time,
    the largest by time (where a step's time goes beyond the bytes it moves)."""
    from torch.profiler import ProfilerActivity, profile

    decode_timing(runner, 1, ctx, graphs, 2)  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_timing(runner, 1, ctx, graphs, 1)
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            kernels.setdefault(ev.name[:90], []).append(ev.device_time / 1e3)
    steps = 6  # decode_timing runs 5 warm-up steps + 1
    top = sorted(((sum(v) / steps, len(v) // steps, k) for k, v in kernels.items()),
                 reverse=True)[:12]
    return {"kernels_per_step": sum(len(v) for v in kernels.values()) / steps,
            "kernel_ms_per_step": sum(sum(v) for v in kernels.values()) / steps,
            "top": [{"name": n, "ms": ms, "calls": c} for ms, c, n in top]}


def part_ours(args: argparse.Namespace) -> dict[str, Any]:
    from moeserve.bench import random_prompts, run_bench
    from moeserve.runtime.engine import Engine

    experts = args.experts or expert_backend()
    t0 = time.perf_counter()
    flags = dict(load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                 context_length=args.ctx + args.output_len + 64,
                 max_running_requests=max(args.batches + args.concurrency))
    engine = Engine(args.model, moe_runner_backend=experts, **flags)
    startup = time.perf_counter() - t0
    # the single rank runs in a thread of this process; its loop is idle between requests,
    # so the runner can be driven directly for the step timings
    runner = engine._thread._args[0].runner
    randomize_kv(runner.kv_pool)
    out: dict[str, Any] = {"startup_s": startup, "experts": experts,
                           "graph_buckets": list(runner.graphs.buckets) if runner.graphs
                           else [], "decode_ms": {}, "decode_eager_ms": {}, "bench": []}
    from moeserve.runtime.devices import resolve_backends

    out["backends"] = list(resolve_backends(engine.cfg.replace(moe_runner_backend=experts),
                                            runner.device))
    for b in args.batches:
        out["decode_ms"][b] = decode_timing(runner, b, args.ctx, True, args.steps)
        print(f"decode batch {b}: {out['decode_ms'][b]:.3f} ms/step", flush=True)
    for b in (1,):
        out["decode_eager_ms"][b] = decode_timing(runner, b, args.ctx, False, 10)
        print(f"eager decode batch {b}: {out['decode_eager_ms'][b]:.3f} ms/step", flush=True)
    # the dummy weights' routing, which the floor's uniform-routing count may not match
    out["touched_experts_per_layer"] = {}
    for b in args.batches:
        seen: list[int] = []
        decode_timing(runner, b, args.ctx, False, 1, touched=seen)
        out["touched_experts_per_layer"][b] = statistics.mean(seen) if seen else None
        uniform = decode_bytes(runner.spec, b, args.ctx)["touched_experts_per_layer"]
        print(f"decode batch {b}: {out['touched_experts_per_layer'][b]} experts touched per "
              f"MoE layer (uniform routing: {uniform:.1f})", flush=True)
    try:
        out["profile_batch1"] = kernel_profile(runner, args.ctx, True)
        p = out["profile_batch1"]
        print(f"batch-1 step: {p['kernels_per_step']:.0f} kernels, "
              f"{p['kernel_ms_per_step']:.3f} ms of kernel time", flush=True)
    except Exception as exc:  # the profiler is a lead, not a measurement we depend on
        out["profile_batch1"] = {"error": f"{type(exc).__name__}: {exc}"}
    for c in args.concurrency:
        prompts = random_prompts(max(2 * c, 8), args.input_len, runner.spec.vocab_size, seed=c)
        s = run_bench(engine, prompts, args.output_len, c, progress=False)
        s = {k: v for k, v in s.items() if not isinstance(v, list)}
        out["bench"].append(s)
        print(f"bench concurrency {c}: {s['output_tokens_per_s']:.0f} output tok/s, "
              f"ITL p50 {s['itl_ms_p50']}", flush=True)
    engine.shutdown()
    return out


def part_hf(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    from moeserve.models.spec import load_hf_config

    if args.model != MODEL:
        raise SystemExit(f"the hf part builds transformers' Qwen3-MoE only ({MODEL}), not "
                         f"{args.model}: run --parts ceilings,ours for it")
    cfg_dict = load_hf_config(MODEL)
    cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in cfg_dict.items()
                                         if k not in ("architectures", "model_type",
                                                      "torch_dtype")})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3MoeForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    model.generation_config.eos_token_id = None
    out: dict[str, Any] = {"transformers": transformers.__version__, "decode_ms": {},
                           "errors": {}}
    # what generate runs when no experts implementation is asked for (5.17: grouped_mm where
    # torch has it, else eager)
    out["default"] = getattr(model.config, "_experts_implementation", None)
    for impl in ("eager", "grouped_mm", "batched_mm"):
        try:
            model.set_experts_implementation(impl)
        except Exception as exc:  # an implementation this version lacks
            out["errors"][impl] = f"{type(exc).__name__}: {exc}"
            continue
        for b in (1, 8):
            # batched_mm gathers every (token, expert) pair's weights: a 512-token prefill of 8
            # requests asks for ~200 GB, so it retries with a short prompt (decode reads the
            # same weights; only the attention over the cache is shorter)
            for ctx in (args.ctx, 64):
                try:
                    ms = hf_decode_ms(model, cfg.vocab_size, b, ctx, 4 if impl == "eager" else 16)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    out["errors"][f"{impl} batch {b} context {ctx}"] = "out of memory"
                    continue
                out["decode_ms"].setdefault(impl, {})[b] = ms
                out.setdefault("context", {}).setdefault(impl, {})[b] = ctx
                print(f"transformers {impl} batch {b} context {ctx}: {ms:.1f} ms/token",
                      flush=True)
                break
    return out


def hf_decode_ms(model: Any, vocab: int, batch: int, ctx: int, n: int, reps: int = HF_REPS
                 ) -> float:
    """(time of generate with 1 + n new tokens - time with 1) / n, in ms: the median of reps
    such differences (generate at batch 1 waits on the host, whose speed wanders: one
    difference each moved 50-63 ms/token between two runs on one H200 machine)."""
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
    return statistics.median((gen(1 + n) - gen(1)) / n * 1e3 for _ in range(reps))


PARTS = {"ceilings": part_ceilings, "ours": part_ours, "hf": part_hf}


# --- report -----------------------------------------------------------------------------------

def section(res: dict[str, Any], command: str) -> str:
    from moeserve.models.spec import load_model_spec

    c, ours, hf, a = res["ceilings"], res.get("ours", {}), res.get("hf", {}), res["args"]
    spec = load_model_spec(a.get("model", MODEL))
    bw = c["copy_GBps"] * 1e9
    lines = [f"Device: {c['device']}; {res['date']}; torch {c['torch']} (CUDA {c['cuda']}), "
             f"triton {res.get('triton', '?')}, transformers {hf.get('transformers', '?')}; "
             f"commit {res.get('commit', '?')}.",
             f"Command: `{command}`",
             f"Ceilings measured in the same run: copy {c['copy_GBps']:.0f} GB/s (1 GiB, read + "
             f"write), bf16 GEMM 8192^3 {c['bf16_TFLOPs']:.0f} TFLOP/s.",
             f"moeserve: attention / experts backends {ours.get('backends')}, CUDA-graph buckets "
             f"{ours.get('graph_buckets', [])[:3]}...{ours.get('graph_buckets', [])[-1:]}, "
             f"startup {ours.get('startup_s', 0):.0f} s.", "",
             f"Decode step, context {a['ctx']} tokens per request (floor first: bytes / copy "
             "bandwidth; step = graph replay with its input copies, CUDA events, median of "
             f"{a['steps']} steps after 5 warm-up):", "",
             "| batch | bytes/step (dense + experts + KV) | floor ms | moeserve ms/step | x floor "
             "| GB/s | tokens/s | transformers best ms/token | speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b in a["batches"]:
        f = decode_bytes(spec, b, a["ctx"])
        floor = f["total"] / bw * 1e3
        ms = ours.get("decode_ms", {}).get(str(b))
        best = [v[str(b)] for v in hf.get("decode_ms", {}).values() if str(b) in v]
        hf_best = min(best) if best else None
        lines.append(
            f"| {b} | {f['total'] / 1e9:.2f} GB ({f['dense'] / 1e9:.2f} + "
            f"{f['experts'] / 1e9:.2f} + {f['kv'] / 1e9:.2f}) | {floor:.2f} | "
            + (f"{ms:.2f} | {ms / floor:.2f} | {f['total'] / ms / 1e6:.0f} | {b / ms * 1e3:.0f}"
               if ms else "- | - | - | -")
            + (f" | {hf_best:.1f} | {hf_best / ms:.0f}x |" if hf_best and ms else " | - | - |"))
    eager = ours.get("decode_eager_ms", {}).get("1")
    if eager:
        lines += ["", f"Batch 1 without CUDA graphs (eager): {eager:.2f} ms/step."]
    prof = ours.get("profile_batch1", {})
    if "top" in prof:
        lines += ["", f"Batch-1 graph step under torch.profiler: {prof['kernels_per_step']:.0f} "
                  f"kernels, {prof['kernel_ms_per_step']:.2f} ms of summed kernel time; the "
                  "largest:", "", "| kernel | ms/step | launches/step |", "|---|---|---|"]
        lines += [f"| `{k['name'][:60]}` | {k['ms']:.3f} | {k['calls']} |" for k in prof["top"]]
    if hf.get("decode_ms"):
        lines += ["", "transformers `generate` (same shape, random bf16, context "
                  f"{a['ctx']}), decode ms/token by experts implementation:", "",
                  "| implementation | batch 1 | batch 8 |", "|---|---|---|"]
        ctxs = hf.get("context", {})
        for impl, v in hf["decode_ms"].items():
            cells = [f"{v[b]:.1f}" + ("" if ctxs.get(impl, {}).get(b) == a["ctx"] else
                                      f" (context {ctxs.get(impl, {}).get(b)})")
                     if b in v else "-" for b in ("1", "8")]
            shipped = " (the default)" if impl == hf.get("default") else ""
            lines.append(f"| {impl}{shipped} | {cells[0]} | {cells[1]} |")
        for what, err in hf.get("errors", {}).items():
            lines.append(f"| {what} | {err[:80]} | |")
        default_ms = hf["decode_ms"].get(hf.get("default"), {}).get("1")
        ms = ours.get("decode_ms", {}).get("1")
        if default_ms and ms:
            lines += ["", f"`generate` as shipped (no experts implementation asked for) runs "
                      f"{hf['default']}: {default_ms:.1f} ms/token at batch 1, "
                      f"{default_ms / ms:.1f}x our step; its fastest, "
                      f"{min(v['1'] for v in hf['decode_ms'].values() if '1' in v):.1f} "
                      f"ms/token, is the table's \"best\"."]
    if ours.get("bench"):
        lines += ["", f"`moeserve bench` (bench.run_bench on the same engine): max(2 x "
                  f"concurrency, 8) prompts of {a['input_len']} random tokens, "
                  f"{a['output_len']} output tokens "
                  "each, greedy, ignore_eos:", "",
                  "| concurrency | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p90 ms |",
                  "|---|---|---|---|---|"]
        for s in ours["bench"]:
            lines.append(f"| {s['max_concurrency']} | {s['output_tokens_per_s']:.0f} | "
                         f"{s['ttft_ms_p50'] or 0:.1f} | {s['itl_ms_p50'] or 0:.2f} | "
                         f"{s['itl_ms_p90'] or 0:.2f} |")
        one = [s for s in ours["bench"] if s["max_concurrency"] == 1 and s["itl_ms_p50"]]
        if one:  # the per-token time a lone client sees, the host's part included
            itl = one[0]["itl_ms_p50"]
            f = decode_bytes(spec, 1, a["input_len"] + a["output_len"] // 2)
            best = [v["1"] for v in hf.get("decode_ms", {}).values() if "1" in v]
            lines += ["", f"At concurrency 1 the ITL p50 is {itl:.2f} ms: "
                      f"{itl / (f['total'] / bw * 1e3):.2f}x the batch-1 floor at the mean "
                      f"context ({a['input_len'] + a['output_len'] // 2} tokens)"
                      + (f", {min(best) / itl:.1f}x faster than transformers' best"
                         if best else "") + "."]
    return "\n".join(lines) + "\n"


def splice(results_md: Path, body: str) -> None:
    """Replace the body of the '## End to end' section up to its first subsection (or the
    next section), leaving every other section and subsection as is."""
    text = results_md.read_text()
    head = text.index("## End to end")
    start = text.index("\n", head) + 1
    found = [i for i in (text.find("\n## ", start), text.find("\n### ", start)) if i >= 0]
    nxt = min(found) if found else -1
    end = len(text) if nxt < 0 else nxt + 1
    results_md.write_text(text[:start] + "\n" + body + ("\n" if nxt >= 0 else "") + text[end:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="e2e_out")
    p.add_argument("--parts", default="ceilings,ours,hf")
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--model", default=MODEL, help="our engine's model (the hf part: the "
                   "default only)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--experts", help="--moe-runner-backend of our engine (default: auto when "
                   "the triton runner is registered, else grouped_mm)")
    p.add_argument("--splice", help="RESULTS.md to write the End to end section into")
    p.add_argument("--from", dest="from_json", help="results JSON of an earlier run")
    args = p.parse_args()
    out = Path(args.out)
    if args.part:
        res = PARTS[args.part](args)
        (out / f"{args.part}.json").write_text(json.dumps(res, indent=1))
        return 0
    if args.splice:
        res = json.loads(Path(args.from_json).read_text())
        splice(Path(args.splice), section(res, res["command"]))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, *sys.argv[1:]]
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "args": vars(args),
                           "command": "PYTHONPATH=src python benchmarks/bench_e2e.py "
                           + " ".join(sys.argv[1:]), "commit": os.environ.get("COMMIT", "?")}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        pass
    for part in args.parts.split(","):
        rc = subprocess.call(cmd + ["--part", part])
        path = out / f"{part}.json"
        if part == "ours" and rc and not args.experts:  # e.g. a runner still in development
            print("our engine failed with the default expert runner; again with grouped_mm",
                  flush=True)
            res["ours_default_failed"] = True
            rc = subprocess.call(cmd + ["--part", part, "--experts", "grouped_mm"])
        if rc == 0 and path.exists():
            res[part] = json.loads(path.read_text())
        else:
            print(f"part {part} failed (exit {rc})", flush=True)
    res["args"] = json.loads(json.dumps(res["args"]))
    (out / "e2e.json").write_text(json.dumps(res, indent=1))
    if "ceilings" in res:
        text = section(json.loads(json.dumps(res)), res["command"])
        (out / "e2e_section.md").write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
