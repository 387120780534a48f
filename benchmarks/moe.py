r"""The MoE layer (router + experts, tp = 1, bf16) at 1..8192 tokens: moeserve's triton runner
beside its grouped_mm runner (torch._grouped_mm) and transformers' own MoE block.

    PYTHONPATH=src python -m benchmarks moe --out $OUT [--models ...] [--tokens ...] \
        [--profile-from N] [--fp8] [--results benchmarks/RESULTS.md]

With --fp8: the layer with block-scaled FP8 experts beside bf16 (benchmarks/moe_fp8.py).

Per size: R batches of fresh random hidden states (R = 4 up to 512 tokens, so that
consecutive calls route to different experts and L2 holds no weights of the call before),
routed by the layer's own router with random bf16 weights. moeserve's layers are timed as
CUDA-graph replays of the R calls (the engine replays graphs at decode); transformers' block
eagerly (it synchronises with the host), each experts implementation, the fastest kept.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import Ceilings, RunInfo, table

HELP = "the MoE layer against grouped_mm and transformers' block"
TITLE = "MoE layer"
MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite")
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
HF_BLOCKS = {"qwen3-30b-a3b": ("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
             "mixtral-8x7b": ("mixtral", "MixtralSparseMoeBlock"),
             "deepseek-v2-lite": ("deepseek_v2", "DeepseekV2Moe")}
RUNNERS = ("triton", "grouped_mm")
METHOD = """\
Layer = router + experts (tp = 1, bf16); DeepSeek-V2-Lite includes its 2 shared experts (one
dense MLP, width 2816) in every column, in bytes and FLOPs. Bytes = experts touched (counted
from the actual routing) x 3 H I x 2; FLOPs = 2 N K 3 H I. Floor = max(bytes / copy
bandwidth, FLOPs / bf16 matmul rate), both measured in the same run. moeserve times are
CUDA-graph replays, transformers' block eager (the fastest of its experts implementations);
GB/s and TFLOP/s are the triton layer's, % copy and % GEMM their ratios to the ceilings.
"triton experts only" is the routed experts alone (same routing), without the router and
without DeepSeek's shared MLP. GB/s above 100% of the copy ceiling is possible: the copy
counts read + write, the layer almost only reads."""


def model_spec(name: str) -> Any:
    from moeserve.config.presets import PRESETS
    from moeserve.config.spec import spec_from_hf_config

    return spec_from_hf_config(dict(PRESETS[name]), name=name)


def add_arguments(p: Any) -> None:
    harness.add_output_arguments(p)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--profile-from", type=int, default=0, metavar="N",
                   help="print the triton layer's time by kernel at N tokens and more")
    p.add_argument("--fp8", action="store_true",
                   help="the layer with block-scaled FP8 experts beside bf16, with the FP8 "
                        "GEMM rate (benchmarks/moe_fp8.py)")


class Layer:
    """Router + one expert runner (+ DeepSeek's shared experts), sharing weights."""

    def __init__(self, spec: Any, runner: str, weights: dict[str, torch.Tensor]) -> None:
        from moeserve.layers.mlp import DenseMLP
        from moeserve.moe.experts import create_experts
        from moeserve.moe.router import Router
        from moeserve.parallel.groups import single_process_state

        state = single_process_state(device="cuda")
        with torch.device("cuda"):
            self.router = Router(spec, torch.bfloat16)
            self.experts = create_experts(runner, spec, state, torch.bfloat16)
        self.router.weight.data = weights["gate"]
        self.experts.w13.data = weights["w13"]
        self.experts.w2.data = weights["w2"]
        self.shared = None
        if "sh13" in weights:  # one dense MLP, as MoELayer holds them
            with torch.device("cuda"):
                self.shared = DenseMLP(spec, state, torch.bfloat16, tp_size=1,
                                       intermediate_size=spec.shared_expert_intermediate_size)
            self.shared.gate_up.weight.data = weights["sh13"]
            self.shared.down.weight.data = weights["sh2"]

    def __call__(self, x_NH: torch.Tensor) -> torch.Tensor:
        """As MoELayer.forward on one rank (the local dispatcher leaves rows as they are)."""
        ids, w = self.router(x_NH)
        y = self.experts(x_NH, ids, w)
        return y if self.shared is None else y + self.shared.partial(x_NH)


def make_weights(spec: Any) -> dict[str, torch.Tensor]:
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size

    def rnd(*shape: int, fan: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * fan ** -0.5

    w = {"gate": rnd(e, h, fan=h), "w13": rnd(e, 2 * i, h, fan=h), "w2": rnd(e, h, i, fan=i)}
    if spec.num_shared_experts:
        si = spec.shared_expert_intermediate_size
        w["sh13"], w["sh2"] = rnd(2 * si, h, fan=h), rnd(h, si, fan=si)
    return w


def hf_block(name: str, weights: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    from transformers import AutoConfig

    from moeserve.config.presets import PRESETS

    model_type, cls_name = HF_BLOCKS[name]
    kwargs = {k: v for k, v in PRESETS[name].items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(model_type, **kwargs)
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            block = getattr(module, cls_name)(config).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(old)
    block.gate.weight.data = weights["gate"]
    block.experts.gate_up_proj.data = weights["w13"]
    block.experts.down_proj.data = weights["w2"]
    if "sh13" in weights:
        si = weights["sh2"].shape[1]
        sh = block.shared_experts
        sh.gate_proj.weight.data = weights["sh13"][:si]
        sh.up_proj.weight.data = weights["sh13"][si:]
        sh.down_proj.weight.data = weights["sh2"]
    return block, config


def hf_impls() -> list[str]:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return ["eager"]
    return ["eager", *(n for n in ("grouped_mm", "batched_mm") if n in ALL_EXPERTS_FUNCTIONS)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def bench_model(name: str, tokens: list[int], ceil: Ceilings, profile_from: int) -> list[dict]:
    spec = model_spec(name)
    k, h, i = spec.top_k, spec.hidden_size, spec.moe_intermediate_size
    weights = make_weights(spec)
    layers = {r: Layer(spec, r, weights) for r in RUNNERS}
    block, config = hf_block(name, weights)
    shared_i = spec.shared_expert_intermediate_size if spec.num_shared_experts else 0
    rows = []
    for n in tokens:
        reps = 4 if n <= 512 else 1
        xs = [torch.randn(n, h, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]
        routes = [layers["triton"].router(x) for x in xs]
        touched = sum(int(torch.unique(ids[ids >= 0]).numel()) for ids, _ in routes) / reps
        nbytes = (touched * 3 * h * i + 3 * h * shared_i) * 2
        flops = 2 * n * (k * 3 * h * i + 3 * h * shared_i)
        row: dict[str, Any] = {"model": name, "tokens": n, "touched": touched,
                               "MB": nbytes / 1e6, "floor_us": ceil.floor_us(nbytes, flops)}
        outs = {r: layer(xs[0]) for r, layer in layers.items()}
        timed = {r: (lambda layer=layer: [layer(x) for x in xs]) for r, layer in layers.items()}
        experts = layers["triton"].experts
        timed["triton_experts"] = lambda: [experts(x, *rt) for x, rt in zip(xs, routes)]
        for r, fn in timed.items():
            try:
                row[f"{r}_us"] = harness.graph_us(fn, calls=reps, reps=20 if n <= 1024 else 8)
            except RuntimeError as err:  # not capturable: timed eagerly, and the row says so
                print(f"{name} N={n} {r}: no CUDA graph ({err}); timed eagerly", flush=True)
                row[f"{r}_eager"] = True
                row[f"{r}_us"] = harness.time_us(fn, reps=20 if n <= 1024 else 8) / reps
        if profile_from and n >= profile_from:
            row["kernels"] = harness.kernel_us(lambda: layers["triton"](xs[0]))
        with torch.no_grad():
            for impl in hf_impls():
                if impl == "batched_mm" and n * k * 3 * h * i * 2 > 8e9:
                    continue  # it gathers a copy of the weights per (token, k)
                config._experts_implementation = impl
                try:
                    us = harness.time_us(lambda: [block(x[None]) for x in xs], reps=5,
                                         warmup=1) / reps
                except torch.OutOfMemoryError:
                    continue
                row[f"hf_{impl}_us"] = us
                if "hf_us" not in row or us < row["hf_us"]:
                    row["hf_us"], row["hf_impl"] = us, impl
            if "hf_impl" in row:
                config._experts_implementation = row["hf_impl"]
                outs["hf"] = block(xs[0][None])[0]
        row["err_vs_gmm"] = rel(outs["triton"], outs["grouped_mm"])
        row["err_vs_hf"] = rel(outs["triton"], outs["hf"]) if "hf" in outs else None
        t = row["triton_us"]
        row.update(GBps=nbytes / t / 1e3, TFLOPs=flops / t / 1e6)
        row.update(pct_copy=100 * row["GBps"] / ceil.copy_GBps,
                   pct_gemm=100 * row["TFLOPs"] / ceil.bf16_TFLOPs)
        print(row, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


HEADER = ["model", "tokens", "experts touched", "MB read", "floor µs", "triton µs",
          "triton experts only µs", "GB/s", "% copy", "TFLOP/s", "% GEMM", "grouped_mm µs",
          "HF µs (impl)", "vs grouped_mm", "vs HF", "rel err vs HF"]


def cells(r: dict) -> list[str]:
    has_hf = "hf_us" in r
    return [r["model"], str(r["tokens"]), f"{r['touched']:.1f}", f"{r['MB']:.1f}",
            f"{r['floor_us']:.1f}", f"{r['triton_us']:.1f}", f"{r['triton_experts_us']:.1f}",
            f"{r['GBps']:.0f}", f"{r['pct_copy']:.0f}%", f"{r['TFLOPs']:.1f}",
            f"{r['pct_gemm']:.0f}%", f"{r['grouped_mm_us']:.1f}",
            f"{r['hf_us']:.1f} ({r['hf_impl']})" if has_hf else "-",
            f"{r['grouped_mm_us'] / r['triton_us']:.2f}x",
            f"{r['hf_us'] / r['triton_us']:.1f}x" if has_hf else "-",
            f"{r['err_vs_hf']:.1e}" if r.get("err_vs_hf") is not None else "-"]


def run(args: Any, argv: list[str]) -> int:
    if args.fp8:
        from benchmarks import moe_fp8

        return moe_fp8.run(args, argv)
    harness.require_gpu()
    info = RunInfo.collect("moe", argv, extra_versions=("transformers",))
    torch.manual_seed(0)
    ceil = harness.measure_ceilings()
    print(ceil.line(), flush=True)
    rows: list[dict] = []
    with torch.inference_mode():
        for name in args.models:
            rows += bench_model(name, args.tokens, ceil, args.profile_from)
    body = table(HEADER, [cells(r) for r in rows])
    for r in rows:
        if r.get("kernels"):
            body += ["", f"{r['model']} at {r['tokens']} tokens, the triton layer by kernel "
                     "(eager, µs): " + ", ".join(f"`{k}` {us:.1f}" for k, us in r["kernels"])
                     + "."]
    text = harness.section(TITLE, METHOD, info, ceil, body)
    harness.save(Path(args.out), "moe", {"info": info, "ceilings": ceil, "rows": rows}, text,
                 args.results)
    return 0
