r"""`python -m benchmarks moe --fp8`: the MoE layer with block-scaled FP8 experts (128 x 128
blocks, W8A8: kernels/moe/fused_moe_fp8.py) beside the same layer in bf16 (triton and
grouped_mm runners), with the copy bandwidth, the bf16 and the FP8 GEMM rates measured in the
same run.

    PYTHONPATH=src python -m benchmarks moe --fp8 --out $OUT [--models ...] [--tokens ...] \
        [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import Ceilings, RunInfo, table

TITLE = "MoE layer, FP8"
BLOCK = (128, 128)
METHOD = """\
Layer = router + routed experts (tp = 1; DeepSeek-V2-Lite's shared experts left out of every
column), the experts' weights random bf16, quantized per 128 x 128 block for the FP8 column
(the triton runner's W8A8 kernels: the rows quantized once per token per 128 columns, in the
router's top-k launch where the engine's layer does so, gate_up writing its output in fp8 with
its group scales). FP8 bytes = experts touched (counted from the
actual routing) x 3 H I x 1 + their float32 block scales; FLOPs = 2 N K 3 H I. FP8 floor =
max(FP8 bytes / copy bandwidth, FLOPs / FP8 GEMM rate), both measured in the same run (the FP8
rate: torch._scaled_mm 8192^3 with per-tensor scales). Every time is a CUDA-graph replay of R
calls with fresh rows and routings (R = 4 up to 512 tokens). % copy is the FP8 layer's GB/s on
the FP8 bytes over the copy ceiling, % FP8 GEMM its TFLOP/s over the FP8 rate; rel err is the
FP8 layer's output against the bf16 triton layer's (the cost of W8A8). Where the floor is the
FLOPs', "dense µs" is cuBLAS's FP8 GEMM (torch._scaled_mm, per-tensor scales) on the same rows
and shapes as one dense GEMM each, gate_up [N K, H] x [H, 2 I] then down [N K, I] x [I, H]:
what these shapes allow a GEMM without groups or block scales; "% dense" is its time over
the FP8 layer's."""


class Fp8Layer:
    """The router and a triton expert runner with fp8 weights quantized from bf16 ones."""

    def __init__(self, spec: Any, weights: dict[str, torch.Tensor], router: Any) -> None:
        from moeserve.config.quant import QuantSpec
        from moeserve.kernels.fp8 import reference as R
        from moeserve.moe.experts import create_experts
        from moeserve.parallel.groups import single_process_state

        quant = QuantSpec(*BLOCK, from_checkpoint=False)
        with torch.device("cuda"):
            self.experts = create_experts("triton", spec, single_process_state(device="cuda"),
                                          torch.bfloat16, quant)
        for w, s, src in ((self.experts.w13, self.experts.w13_scale_inv, weights["w13"]),
                          (self.experts.w2, self.experts.w2_scale_inv, weights["w2"])):
            q, scale = R.quantize_blocks(src, BLOCK)
            w.data, s.data = q, scale
        self.router = router

    def __call__(self, x_NH: torch.Tensor) -> torch.Tensor:
        """As MoELayer.forward on one rank: the router's top-k launch quantizes the rows
        where it can (the experts then take them quantized), else the experts do."""
        n, h = x_NH.shape
        q = torch.empty(n, h, dtype=torch.float8_e4m3fn, device=x_NH.device)
        s = torch.empty(n, -(-h // BLOCK[1]), dtype=torch.float32, device=x_NH.device)
        ids, w, quantized = self.router.route(x_NH, None, (BLOCK[1], q, s))
        return self.experts(q, ids, w, s) if quantized else self.experts(x_NH, ids, w)


def bench_model(name: str, tokens: list[int], ceil: Ceilings) -> list[dict]:
    from benchmarks.moe import Layer, make_weights, model_spec, rel

    spec = model_spec(name)
    k, h, i = spec.top_k, spec.hidden_size, spec.moe_intermediate_size
    weights = {key: v for key, v in make_weights(spec).items() if not key.startswith("sh")}
    # no "sh13": the routed experts alone in every column
    layers: dict[str, Any] = {r: Layer(spec, r, weights) for r in ("triton", "grouped_mm")}
    layers["fp8"] = Fp8Layer(spec, weights, layers["triton"].router)
    bn, bk = BLOCK
    scale_bytes = 4 * (-(-2 * i // bn) * -(-h // bk) + -(-h // bn) * -(-i // bk))
    rows = []
    for n in tokens:
        reps = 4 if n <= 512 else 1
        xs = [torch.randn(n, h, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]
        routes = [layers["triton"].router(x) for x in xs]
        touched = sum(int(torch.unique(ids[ids >= 0]).numel()) for ids, _ in routes) / reps
        nbytes = touched * (3 * h * i + scale_bytes)
        flops = 2 * n * k * 3 * h * i
        row: dict[str, Any] = {"model": name, "tokens": n, "touched": touched,
                               "MB": nbytes / 1e6, "floor_us": ceil.fp8_floor_us(nbytes, flops)}
        for r, layer in layers.items():
            row[f"{r}_us"] = harness.graph_us(lambda layer=layer: [layer(x) for x in xs],
                                              calls=reps, reps=20 if n <= 1024 else 8)
        row["err_vs_bf16"] = rel(layers["fp8"](xs[0]), layers["triton"](xs[0]))
        if ceil.fp8_floor_us(flops=flops) > ceil.fp8_floor_us(nbytes=nbytes):  # FLOP-bound
            pairs = n * k
            row["dense_us"] = harness.fp8_gemm_us([(pairs, 2 * i, h), (pairs, h, i)], reps=8)
        t = row["fp8_us"]
        row.update(GBps=nbytes / t / 1e3, TFLOPs=flops / t / 1e6)
        row.update(pct_copy=100 * row["GBps"] / ceil.copy_GBps,
                   pct_fp8_gemm=100 * row["TFLOPs"] / ceil.fp8_TFLOPs)
        print(row, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


HEADER = ["model", "tokens", "experts touched", "FP8 MB read", "FP8 floor µs", "FP8 µs",
          "x floor", "GB/s", "% copy", "TFLOP/s", "% FP8 GEMM", "bf16 triton µs",
          "bf16 grouped_mm µs", "FP8 vs bf16", "rel err vs bf16", "dense µs", "% dense"]


def cells(r: dict) -> list[str]:
    return [r["model"], str(r["tokens"]), f"{r['touched']:.1f}", f"{r['MB']:.1f}",
            f"{r['floor_us']:.1f}", f"{r['fp8_us']:.1f}", f"{r['fp8_us'] / r['floor_us']:.2f}",
            f"{r['GBps']:.0f}", f"{r['pct_copy']:.0f}%", f"{r['TFLOPs']:.1f}",
            f"{r['pct_fp8_gemm']:.0f}%", f"{r['triton_us']:.1f}", f"{r['grouped_mm_us']:.1f}",
            f"{r['triton_us'] / r['fp8_us']:.2f}x", f"{r['err_vs_bf16']:.1e}",
            f"{r['dense_us']:.1f}" if "dense_us" in r else "-",
            f"{100 * r['dense_us'] / r['fp8_us']:.0f}%" if "dense_us" in r else "-"]


def run(args: Any, argv: list[str]) -> int:
    harness.require_gpu()
    info = RunInfo.collect("moe", argv)
    torch.manual_seed(0)
    ceil = harness.measure_ceilings(fp8=True)
    print(ceil.line(), flush=True)
    rows: list[dict] = []
    with torch.inference_mode():
        for name in args.models:
            rows += bench_model(name, args.tokens, ceil)
    text = harness.section(TITLE, METHOD, info, ceil, table(HEADER, [cells(r) for r in rows]))
    harness.save(Path(args.out), "moe_fp8", {"info": info, "ceilings": ceil, "rows": rows},
                 text, args.results)
    return 0
