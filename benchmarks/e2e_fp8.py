"""`python -m benchmarks e2e --quantization fp8`: the decode step on one GPU with block-scaled
FP8 weights against its FP8 floor, beside the same model's bf16 step measured in the same run;
the section "End to end, FP8" (e2e.py runs the parts: ceilings, ours in bf16, ours_fp8).

    PYTHONPATH=src python -m benchmarks e2e --quantization fp8 --out $OUT \
        [--batches 1 8 64 256] [--concurrency ...] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

from typing import Any, Optional

from benchmarks import harness
from benchmarks.harness import Ceilings, RunInfo, table

TITLE = "End to end, FP8"
# issue 37's acceptance for Qwen3-30B-A3B in FP8: (batch, measure, at most)
ACCEPTANCE = ((1, "x floor", 1.6), (1, "FP8 / bf16", 0.65), (64, "x floor", 1.25))
METHOD = """\
One GPU, dummy bf16 weights quantized at load (--quantization fp8: float8_e4m3fn with a float32
scale per 128 x 128 block; W8A8, activations quantized per token per 128 columns), random KV in
bf16. The FP8 floor of a decode step is the bytes it must read as they are stored, over the
copy bandwidth measured in the same run: the projections the quantizer converts (attention,
dense and shared MLPs, routed experts) at a byte a value plus their block scales; norms,
router, the batch's embedding rows and the LM head in bf16 (the planner's weight bytes,
plan/memory.py); of the routed experts those that uniform routing touches, E (1 - (1 - k/E)^B)
per MoE layer; and the KV cache. A step is the runner's decode path (CUDA-graph replay with its
input copies) between CUDA events, the median of the steps after 5 warm-up; the bf16 column is
the same engine without --quantization, in a process of its own in the same run."""


def rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per batch: the FP8 step's bytes (dense, experts, KV, total), its floor and the bf16
    one (ms), the FP8 and bf16 steps (ms, None where a part did not run)."""
    from moeserve.config.quant import resolve_quant
    from moeserve.config.spec import load_model_spec

    from benchmarks.engine_steps import decode_bytes

    a = res["args"]
    spec = load_model_spec(a["model"])
    quant = resolve_quant(a["quantization"], spec.quant)
    bw = Ceilings(**res["ceilings"]).copy_GBps * 1e9
    fp8, bf16 = (res.get(p, {}).get("decode_ms", {}) for p in ("ours_fp8", "ours"))
    found = []
    for b in a["batches"]:
        f = decode_bytes(spec, b, a["ctx"], quant=quant)
        found.append({"batch": b, **{k: f[k] for k in ("dense", "experts", "kv", "total")},
                      "floor_ms": f["total"] / bw * 1e3,
                      "bf16_floor_ms": decode_bytes(spec, b, a["ctx"])["total"] / bw * 1e3,
                      "fp8_ms": fp8.get(str(b)), "bf16_ms": bf16.get(str(b))})
    return found


def ratio(row: dict[str, Any], measure: str) -> Optional[float]:
    """A row's "x floor" (the FP8 step over its floor) or "FP8 / bf16" (over the bf16 step)."""
    if row["fp8_ms"] is None:
        return None
    if measure == "x floor":
        return row["fp8_ms"] / row["floor_ms"]
    return None if row["bf16_ms"] is None else row["fp8_ms"] / row["bf16_ms"]


def acceptance_line(found: list[dict[str, Any]]) -> str:
    by_batch = {r["batch"]: r for r in found}
    parts = []
    for b, measure, bound in ACCEPTANCE:
        got = ratio(by_batch[b], measure) if b in by_batch else None
        what = "its FP8 floor" if measure == "x floor" else "the bf16 step"
        parts.append(f"batch {b}, {what}: not measured" if got is None else
                     f"batch {b} at {got:.2f}x {what} (at most {bound}: "
                     f"{'met' if got <= bound else 'missed'})")
    return "Acceptance (issue 37): " + "; ".join(parts) + "."


def render(res: dict[str, Any]) -> str:
    from moeserve.config.quant import resolve_quant
    from moeserve.config.spec import load_model_spec

    from benchmarks.e2e import engine_notes, render_bench

    a, fp8, bf16 = res["args"], res.get("ours_fp8", {}), res.get("ours", {})
    ceil = Ceilings(**res["ceilings"])
    spec = load_model_spec(a["model"])
    quant = resolve_quant(a["quantization"], spec.quant)
    buckets = fp8.get("graph_buckets", [])
    body = [f"moeserve FP8 ({quant.describe()}): attention / experts backends "
            f"{fp8.get('backends')}, CUDA-graph buckets {buckets[:3]}...{buckets[-1:]}, startup "
            f"{fp8.get('startup_s', 0):.0f} s; bf16: backends {bf16.get('backends')}, startup "
            f"{bf16.get('startup_s', 0):.0f} s.", "",
            f"Decode step, context {a['ctx']} tokens per request (floor: the FP8 step's bytes / "
            f"copy bandwidth; steps: median of {a['steps']}):", ""]
    found = rows(res)
    cells = []
    for r in found:
        fp8_ms, bf16_ms, x = r["fp8_ms"], r["bf16_ms"], ratio(r, "FP8 / bf16")
        cells.append([r["batch"], f"{r['total'] / 1e9:.2f} GB ({r['dense'] / 1e9:.2f} + "
                      f"{r['experts'] / 1e9:.2f} + {r['kv'] / 1e9:.2f})", f"{r['floor_ms']:.2f}",
                      "-" if fp8_ms is None else f"{fp8_ms:.2f}",
                      "-" if fp8_ms is None else f"{ratio(r, 'x floor'):.2f}",
                      "-" if bf16_ms is None else f"{bf16_ms:.2f}",
                      "-" if bf16_ms is None else f"{bf16_ms / r['bf16_floor_ms']:.2f}",
                      "-" if x is None else f"{x:.2f}"])
    body += table(["batch", "FP8 bytes/step (dense + experts + KV)", "FP8 floor ms",
                   "FP8 ms/step", "x floor", "bf16 ms/step (same run)", "bf16 x its floor",
                   "FP8 / bf16"], cells)
    body += ["", acceptance_line(found)]
    body += engine_notes(fp8, bf16)
    bw = ceil.copy_GBps * 1e9
    body += render_bench(fp8.get("bench", []), a, spec, bw, None, quant, "the FP8 engine")
    body += render_bench(bf16.get("bench", []), a, spec, bw, None, None, "the bf16 engine")
    return harness.section(TITLE, METHOD, RunInfo(**res["info"]), ceil, body)
