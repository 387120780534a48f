"""Scale-out run on the GPUs of one host (issue 8): correctness across layouts, the all-to-all
against NCCL's all_to_all_single, plan bytes against the allocator, and `moeserve bench`
throughput by layout.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        PYTHONPATH=src python benchmarks/scaleout.py --gpus 2 --out $OUT

Parts (each can be skipped): `correct` (greedy tokens of every layout vs one GPU), `a2a` (per
MoE layer dispatch + combine time at decode sizes and bandwidth at prefill sizes, beside NCCL's
all_to_all_single moving the same bytes), `memory` (the a2a workspace the plan records vs what
the allocator handed out, on every rank), `bench` (output tokens/s at several concurrencies for
ep 1..N, DP attention on and off). `correct_fp32_*`: the greedy tokens in fp32, with the
portable backends (no graphs) on several shapes, or through the decode and prefill CUDA graphs
(`correct_fp32_graphs`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import date

import torch
import torch.distributed as dist

MODEL = "preset:qwen3-30b-a3b"


def layouts(n: int) -> dict[str, dict]:
    return {
        "1gpu": dict(tp_size=1),
        f"tp{n}-ep{n}-gather": dict(tp_size=n, ep_size=n),
        f"tp{n}-ep{n}-a2a": dict(tp_size=n, ep_size=n, moe_a2a_backend="all_to_all"),
        f"tp{n}-dp{n}-ep{n}": dict(tp_size=n, dp_size=n, enable_dp_attention=True, ep_size=n),
    }


def engine_flags(**kw) -> dict:
    return dict(load_format="dummy", dtype="bfloat16", context_length=4096,
                mem_fraction_static=0.85, **kw)


def correctness(n: int, model: str = MODEL, num_prompts: int = 8, new_tokens: int = 16,
                **extra) -> dict:
    from moeserve.runtime.engine import Engine

    prompts = [[(7 * i + 3 * j) % 1000 + 10 for j in range(16 + 4 * i)]
               for i in range(num_prompts)]
    params = dict(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    tokens = {}
    # the one-GPU engine runs in this process: run it last, so no other engine waits for the
    # memory it hands back
    for name, kw in reversed(list(layouts(n).items())):
        with Engine(model, **{**engine_flags(**kw), **extra}) as e:
            tokens[name] = [r["token_ids"] for r in e.generate(input_ids=prompts,
                                                               sampling_params=params)]
        del e
    ref = tokens["1gpu"]
    out = {}
    for name, got in tokens.items():
        # bf16 sums in a different order can flip a near-tie: count tokens up to the first
        # difference of each request
        same = sum(next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
                   for r, g in zip(ref, got))
        out[name] = {"identical_requests": sum(r == g for r, g in zip(ref, got)),
                     "requests": len(ref), "tokens_before_first_difference": same,
                     "tokens": sum(len(r) for r in ref)}
    return out


# fp32 with the portable backends: no bf16 near-ties, so every layout should give the same tokens
FP32_PORTABLE = dict(dtype="float32", attention_backend="torch", moe_runner_backend="reference",
                     disable_cuda_graph=True)


# fp32 through the CUDA graphs (decode and prefill): Triton attention, reference experts
FP32_GRAPHS = dict(dtype="float32", attention_backend="triton", moe_runner_backend="reference")


def correct_fp32_qwen3(n: int, model: str = MODEL) -> dict:
    """fp32 tokens of the Qwen3-30B-A3B shape. Its 122 GB of fp32 weights fit one H200 only
    just: try the whole model, and if one GPU cannot hold it, the same shape cut to 24 layers
    (a config.json in a temporary folder, read as a checkpoint folder with dummy weights)."""
    import gc
    import tempfile

    from moeserve.models.spec import load_hf_config

    try:
        return {"layers": "all", **correctness(n, model, 4, 12, mem_fraction_static=0.93,
                                                **FP32_PORTABLE)}
    except Exception as exc:  # noqa: BLE001 - report why, then run the cut shape
        whole = f"{type(exc).__name__}: {str(exc)[:600]}"
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    folder = tempfile.mkdtemp(prefix="qwen3-24-layers-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**load_hf_config(model), "num_hidden_layers": 24}, f)
    return {"layers": 24, "whole_model_error": whole,
            **correctness(n, folder, 4, 12, skip_tokenizer_init=True, **FP32_PORTABLE)}


def _a2a_rank(rank: int, world: int, sizes: list[int], result_path: str) -> None:
    from moeserve.config import EngineConfig
    from moeserve.moe.dispatch.base import create_dispatcher
    from moeserve.parallel.groups import init_parallel_state
    from moeserve.parallel.step import step_from_counts
    from moeserve.plan.capacity import build_plan

    torch.cuda.set_device(rank)
    cfg = EngineConfig(model=MODEL, tp_size=world, ep_size=world, dp_size=world,
                       enable_dp_attention=True, moe_a2a_backend="all_to_all",
                       chunked_prefill_size=max(sizes) * world, max_running_requests=256 * world,
                       gpu_memory_gb=141)
    plan = build_plan(cfg)
    state = init_parallel_state(plan.layout, torch.device("cuda", rank))
    before = torch.cuda.memory_allocated()
    disp = create_dispatcher(plan.spec, state, plan, torch.bfloat16)
    allocated = torch.cuda.memory_allocated() - before
    spec = plan.spec
    rows = []
    for m in sizes:
        x = torch.randn(m, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
        ids = torch.randint(0, spec.num_experts, (m, spec.top_k), device="cuda",
                            dtype=torch.int32)
        w = torch.rand(m, spec.top_k, device="cuda", dtype=torch.float32)
        step = step_from_counts([m] * world, plan.layout, rank, plan)

        def moe_exchange():
            toks, handle = disp.dispatch(x, ids, w, step)
            return disp.combine(toks.x_NH, handle)  # identity experts: the exchange alone

        payload = disp.payload
        send = torch.empty(world * m * payload, dtype=torch.uint8, device="cuda")
        recv = torch.empty_like(send)
        comb = torch.empty(world * m * spec.hidden_size * 2, dtype=torch.uint8, device="cuda")
        comb_r = torch.empty_like(comb)

        def nccl_exchange():
            dist.all_to_all_single(recv, send)
            dist.all_to_all_single(comb_r, comb)

        times = {}
        for label, fn in (("moeserve", moe_exchange), ("nccl", nccl_exchange)):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            samples = []
            for _ in range(30):
                dist.barrier()
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) * 1000)
            times[label] = statistics.median(samples)
        moved = world * m * (payload + spec.hidden_size * 2)  # bytes this rank sends, both ways
        rows.append({"tokens_per_rank": m, "moeserve_us": times["moeserve"],
                     "nccl_all_to_all_single_us": times["nccl"],
                     "moeserve_GBps": moved / times["moeserve"] / 1e3,
                     "nccl_GBps": moved / times["nccl"] / 1e3})
    record_bytes = plan.buffer("a2a.send").bytes + plan.buffer("a2a.recv").bytes
    with open(f"{result_path}.{rank}", "w") as f:
        json.dump({"rows": rows, "plan_workspace_bytes": record_bytes,
                   "allocator_bytes": allocated}, f)


def a2a_and_memory(n: int, out_dir: str) -> dict:
    import torch.multiprocessing as mp

    from moeserve.net import free_port

    sizes = [1, 8, 32, 128, 256, 1024, 4096, 8192]
    path = os.path.join(out_dir, "a2a.json")
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_a2a_main, args=(r, n, port, sizes, path)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    return {r: json.load(open(f"{path}.{r}")) for r in range(n) if os.path.exists(f"{path}.{r}")}


def _a2a_main(rank: int, world: int, port: int, sizes: list[int], path: str) -> None:
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    try:
        _a2a_rank(rank, world, sizes, path)
    finally:
        dist.destroy_process_group()


def bench_configs(n: int) -> dict[str, dict]:
    configs = {"ep1 (1 GPU)": dict(tp_size=1)}  # the baseline; ep 1 with N GPUs is plain TP
    for ep in range(1, n + 1):
        if n % ep == 0:
            configs[f"ep{ep} tp{n}"] = dict(tp_size=n, ep_size=ep)
            configs[f"ep{ep} tp{n} dp-attn"] = dict(tp_size=n, ep_size=ep, dp_size=n,
                                                     enable_dp_attention=True)
    return configs


def bench(n: int, concurrencies: list[int], only: list[str] | None = None) -> list[dict]:
    from moeserve.bench import random_prompts, run_bench
    from moeserve.runtime.engine import Engine

    rows = []
    configs = bench_configs(n)
    if only:
        unknown = sorted(set(only) - set(configs))
        if unknown:
            raise SystemExit(f"unknown --bench-configs {unknown}; known: {sorted(configs)}")
        configs = {k: v for k, v in configs.items() if k in only}
    for name, kw in configs.items():
        with Engine(MODEL, **engine_flags(max_running_requests=max(concurrencies), **kw)) as e:
            # a short untimed run first, so Triton's first-use compilation stays out of the rows
            run_bench(e, random_prompts(16, 128, e.spec.vocab_size, seed=0), 4, 16,
                      progress=False)
            for c in concurrencies:
                prompts = random_prompts(c, 128, e.spec.vocab_size, seed=c)
                s = run_bench(e, prompts, 32, c, progress=False)
                rows.append({"config": name, "concurrency": c, **{
                    k: s[k] for k in ("output_tokens_per_s", "input_tokens_per_s",
                                      "ttft_ms_p50", "itl_ms_p50", "completed", "num_prompts")}})
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--out", default=".")
    ap.add_argument("--parts", default="a2a,correct,correct_v2lite,bench")
    ap.add_argument("--concurrency", default="64,256,1024")
    ap.add_argument("--bench-configs", default="",
                    help="';'-separated names from bench_configs() (default: all)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    report = {"device": torch.cuda.get_device_name(0), "gpus": args.gpus,
              "date": date.today().isoformat(), "torch": torch.__version__}
    t0 = time.time()
    steps = {"a2a": lambda: a2a_and_memory(args.gpus, args.out),
             "correct": lambda: correctness(args.gpus),
             "correct_v2lite": lambda: correctness(args.gpus, "preset:deepseek-v2-lite", 4, 8),
             **{f"correct_fp32_{m}": (lambda m=m: correctness(
                 args.gpus, f"preset:{m}", 4, 12, **FP32_PORTABLE))
                for m in ("olmoe-1b-7b", "qwen1.5-moe-a2.7b")},
             # the same comparison on the two shapes the issue names (DeepSeek-V2-Lite whole;
             # Qwen3-30B-A3B whole if fp32 fits one GPU, else its first 24 layers)
             "correct_fp32_deepseek-v2-lite": lambda: correctness(
                 args.gpus, "preset:deepseek-v2-lite", 4, 12, **FP32_PORTABLE),
             "correct_fp32_qwen3-30b-a3b": lambda: correct_fp32_qwen3(args.gpus),
             # decode and prefill CUDA graphs in every layout (fp32, Triton attention); one
             # prompt alone leaves the other DP ranks idle through its steps
             "correct_fp32_graphs": lambda: {
                 f"{k}_prompts": correctness(args.gpus, "preset:olmoe-1b-7b", k, 12,
                                             **FP32_GRAPHS, context_length=1024,
                                             cuda_graph_max_bs=16,
                                             piecewise_cuda_graph_max_tokens=256)
                 for k in (4, 1)},
             # the same for latent attention (the triton MLA backend, its decode and prefill
             # graphs) in every layout; 3 prompts: DP ranks of 2 and 1 requests
             "correct_fp32_graphs_v2lite": lambda: correctness(
                 args.gpus, "preset:deepseek-v2-lite", 3, 12, **FP32_GRAPHS,
                 context_length=1024, cuda_graph_max_bs=16,
                 piecewise_cuda_graph_max_tokens=256),
             "bench": lambda: bench(args.gpus, [int(c) for c in args.concurrency.split(",")],
                                    [c for c in args.bench_configs.split(";") if c])}
    for name, run in steps.items():
        if name not in parts:
            continue
        try:  # one part failing must not lose the others' numbers
            report[name] = run()
        except Exception as exc:
            import traceback

            report[name] = {"error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()[-3000:]}
        report["seconds"] = time.time() - t0
        print(name, json.dumps(report[name], indent=1)[:4000], flush=True)
        with open(os.path.join(args.out, "scaleout.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
