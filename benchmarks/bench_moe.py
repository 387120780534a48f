"""The MoE layer (router + experts, tp=1, bf16) at 1..8192 tokens: moeserve's triton runner beside
its grouped_mm runner and transformers' own MoE block, with the device's ceilings from the same
run.

    PYTHONPATH=src python benchmarks/bench_moe.py [--models ...] [--tokens ...] \
        [--out DIR] [--write-results benchmarks/RESULTS.md] [--profile-from N]

Per size: R input batches of fresh random hidden states (R = 4 up to 512 tokens, so that
consecutive layer calls route to different experts and the L2 cache holds no weights of the
previous call), routed by the layer's own router with random bf16 weights. moeserve's layers
are timed as CUDA-graph replays of R consecutive calls (the engine replays graphs at decode);
transformers' block eagerly (it synchronises with the host), with each of its experts
implementations, the fastest kept.

Bytes: experts touched (counted from the actual routing) x 3 H I x 2; FLOPs: 2 N K 3 H I.
DeepSeek-V2-Lite includes its 2 shared experts (one dense MLP of width 2 x 1408, always read)
in every runner, in the bytes and in the FLOPs, since transformers' block includes them.
Floor = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_common import (MODELS, TOKENS, capture, ceilings, kernel_us, model_spec,  # noqa: E402
                        time_us)
from moeserve.layers.mlp import DenseMLP  # noqa: E402
from moeserve.moe.experts import create_experts  # noqa: E402
from moeserve.moe.router import Router  # noqa: E402
from moeserve.parallel.groups import single_process_state  # noqa: E402

DEVICE = "cuda"
HF_BLOCKS = {"qwen3-30b-a3b": ("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
             "mixtral-8x7b": ("mixtral", "MixtralSparseMoeBlock"),
             "deepseek-v2-lite": ("deepseek_v2", "DeepseekV2Moe")}
RUNNERS = ("triton", "grouped_mm")


class Layer:
    """Router + one expert runner (+ DeepSeek's shared experts), sharing weights."""

    def __init__(self, spec, runner: str, weights: dict[str, torch.Tensor]) -> None:
        state = single_process_state(device=DEVICE)
        with torch.device(DEVICE):
            self.router = Router(spec, torch.bfloat16)
            self.experts = create_experts(runner, spec, state, torch.bfloat16)
        self.router.weight.data = weights["gate"]
        self.experts.w13.data = weights["w13"]
        self.experts.w2.data = weights["w2"]
        self.shared = None
        if "sh13" in weights:  # DeepSeek's shared experts: one dense MLP, as MoELayer has it
            with torch.device(DEVICE):
                self.shared = DenseMLP(spec, state, torch.bfloat16, tp_size=1,
                                       intermediate_size=spec.shared_expert_intermediate_size)
            self.shared.gate_up.weight.data = weights["sh13"]
            self.shared.down.weight.data = weights["sh2"]

    def route(self, x):
        return self.router(x)

    def __call__(self, x):
        """As MoELayer.forward on one rank (local dispatcher: rows unchanged)."""
        ids, w = self.router(x)
        y = self.experts(x, ids, w)
        if self.shared is not None:
            y = y + self.shared.partial(x)
        return y


def make_weights(spec) -> dict[str, torch.Tensor]:
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    rnd = lambda *s, fan: (torch.randn(*s, device=DEVICE, dtype=torch.bfloat16) * fan ** -0.5)
    w = {"gate": rnd(e, h, fan=h), "w13": rnd(e, 2 * i, h, fan=h), "w2": rnd(e, h, i, fan=i)}
    if spec.num_shared_experts:
        si = spec.shared_expert_intermediate_size
        w["sh13"], w["sh2"] = rnd(2 * si, h, fan=h), rnd(h, si, fan=si)
    return w


def hf_block(name: str, weights):
    from transformers import AutoConfig

    model_type, cls_name = HF_BLOCKS[name]
    from moeserve.models.presets import PRESETS

    kwargs = {k: v for k, v in PRESETS[name].items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(model_type, **kwargs)
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
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
        names = [n for n in ("grouped_mm", "batched_mm") if n in ALL_EXPERTS_FUNCTIONS]
    except ImportError:
        names = []
    return ["eager", *names]


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def bench_model(name: str, tokens, ceil, log, profile_from: int = 0) -> list[dict]:
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
        routes = [layers["triton"].route(x) for x in xs]
        touched = sum(int(torch.unique(ids[ids >= 0]).numel()) for ids, _ in routes) / reps
        bytes_read = (touched * 3 * h * i + 3 * h * shared_i) * 2
        flops = 2 * n * (k * 3 * h * i + 3 * h * shared_i)
        floor_us = max(bytes_read / ceil["copy_GBps"] / 1e3, flops / ceil["bf16_TFLOPs"] / 1e6)
        row = {"model": name, "tokens": n, "touched": touched, "MB": bytes_read / 1e6,
               "floor_us": floor_us}
        outs = {}
        timed = {r: (lambda layer=layer: [layer(x) for x in xs]) for r, layer in layers.items()}
        experts = layers["triton"].experts
        timed["triton_experts"] = lambda: [experts(x, *rt) for x, rt in zip(xs, routes)]
        for r, fn in timed.items():
            if r in layers:
                outs[r] = layers[r](xs[0])
            try:
                replay = capture(fn)
            except RuntimeError as err:  # not capturable: time it eagerly and say so
                print(f"{name} N={n} {r}: no CUDA graph ({err}); timed eagerly", flush=True)
                row[f"{r}_eager"] = True
                replay = fn
            row[f"{r}_us"] = time_us(replay, reps=20 if n <= 1024 else 8) / reps
            del replay
        if profile_from and n >= profile_from:
            layer = layers["triton"]
            log(f"{name} N={n} triton layer by kernel (eager, µs): " + "; ".join(
                f"{k} {us:.1f}" for k, us in kernel_us(lambda: layer(xs[0]))))
        hf_best = None
        with torch.no_grad():
            for impl in hf_impls():
                if impl == "batched_mm" and n * k * 3 * h * i * 2 > 8e9:
                    continue  # it gathers a copy of the weights per (token, k)
                config._experts_implementation = impl
                try:
                    us = time_us(lambda: [block(x[None]) for x in xs], reps=5, warmup=1) / reps
                except torch.OutOfMemoryError:
                    continue
                row[f"hf_{impl}_us"] = us
                if hf_best is None or us < row["hf_us"]:
                    hf_best, row["hf_us"], row["hf_impl"] = impl, us, impl
            if hf_best is not None:
                config._experts_implementation = hf_best
                outs["hf"] = block(xs[0][None])[0]
        row["err_vs_gmm"] = rel(outs["triton"], outs["grouped_mm"])
        row["err_vs_hf"] = rel(outs["triton"], outs["hf"]) if "hf" in outs else None
        t = row["triton_us"]
        row["GBps"] = bytes_read / t / 1e3
        row["TFLOPs"] = flops / t / 1e6
        row["pct_copy"] = 100 * row["GBps"] / ceil["copy_GBps"]
        row["pct_gemm"] = 100 * row["TFLOPs"] / ceil["bf16_TFLOPs"]
        log(fmt_row(row))
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


HEADER = ("| model | tokens | experts touched | MB read | floor µs | triton µs | triton experts "
          "only µs | GB/s | % copy | TFLOP/s | % GEMM | grouped_mm µs | HF µs (impl) | "
          "vs grouped_mm | vs HF | rel err vs HF |")


def fmt_row(r: dict) -> str:
    hf = f"{r['hf_us']:.1f} ({r['hf_impl']})" if "hf_us" in r else "-"
    vs_hf = f"{r['hf_us'] / r['triton_us']:.1f}x" if "hf_us" in r else "-"
    err = f"{r['err_vs_hf']:.1e}" if r.get("err_vs_hf") is not None else "-"
    return (f"| {r['model']} | {r['tokens']} | {r['touched']:.1f} | {r['MB']:.1f} | "
            f"{r['floor_us']:.1f} | {r['triton_us']:.1f} | {r['triton_experts_us']:.1f} | "
            f"{r['GBps']:.0f} | {r['pct_copy']:.1f}% | {r['TFLOPs']:.1f} | {r['pct_gemm']:.1f}% | "
            f"{r['grouped_mm_us']:.1f} | {hf} | {r['grouped_mm_us'] / r['triton_us']:.2f}x | "
            f"{vs_hf} | {err} |")


def markdown(rows, ceil, meta) -> str:
    lines = [f"Device: {meta['device']}; date {meta['date']}; torch {meta['torch']}, triton "
             f"{meta['triton']}, transformers {meta['transformers']}.",
             f"Command: `{meta['command']}`", "",
             f"Ceilings measured in the same run: copy {ceil['copy_GBps']:.0f} GB/s (1 GiB "
             f"device-to-device, read + write), bf16 matmul 8192³ {ceil['bf16_TFLOPs']:.0f} "
             "TFLOP/s.", "",
             "Layer = router + experts (tp = 1, bf16); DeepSeek-V2-Lite includes its 2 shared "
             "experts (one dense MLP, width 2816) in every column, in bytes and FLOPs. moeserve "
             "times are CUDA-graph replays, transformers' block eager (fastest of its experts "
             "implementations). GB/s and TFLOP/s are the triton layer's; % copy and % GEMM are "
             "ratios to the ceilings above. Floor = max(bytes / copy bandwidth, FLOPs / matmul "
             "rate).", "", HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    lines += [fmt_row(r) for r in rows]
    return "\n".join(lines) + "\n"


def write_section(path: Path, body: str) -> None:
    text = path.read_text()
    head = "## MoE layer (benchmarks/bench_moe.py)\n"
    start = text.index(head) + len(head)
    nxt = re.search(r"^## ", text[start:], re.M)
    end = start + nxt.start() if nxt else len(text)
    path.write_text(text[:start] + "\n" + body + "\n" + text[end:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--write-results", default=None, help="RESULTS.md to update")
    ap.add_argument("--profile-from", type=int, default=0, metavar="N",
                    help="print the triton layer's time by kernel at N tokens and more")
    args = ap.parse_args()
    import transformers
    import triton

    meta = {"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
            "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__,
            "command": "PYTHONPATH=src python " + " ".join(sys.argv)}
    torch.manual_seed(0)
    ceil = ceilings()
    print(f"ceilings: {ceil}", flush=True)
    print(HEADER, flush=True)
    rows = []
    with torch.inference_mode():
        for name in args.models:
            rows += bench_model(name, args.tokens, ceil, lambda s: print(s, flush=True),
                                args.profile_from)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_moe.json").write_text(json.dumps({"meta": meta, "ceilings": ceil,
                                                    "rows": rows}, indent=1))
    body = markdown(rows, ceil, meta)
    (out / "bench_moe.md").write_text(body)
    if args.write_results:
        write_section(Path(args.write_results), body)


if __name__ == "__main__":
    main()
