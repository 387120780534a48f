"""The fused runner's default tile configs (no tuned table) on this GPU: the plain defaults
against the Hopper ones (kernels/configs.py: default_config(hopper=True)), and the shipped
table where this device and shape have one; align + gate_up + down + top-k sum of one step,
uniform random routing, triton's do_bench (L2 flushed); the median over rounds in which each
candidate takes each place in turn (a fixed order biased the third by 5-7% on an H100, where
two identical configs timed that far apart).

    PYTHONPATH=src python benchmarks/moe_defaults.py [--out DIR]

Shapes: Qwen3-30B-A3B, DeepSeek-V2-Lite, OLMoE-1B-7B and Qwen1.5-MoE-A2.7B (each with a table
for the H100 and the H200 since session 13).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_moe import do_bench, make_weights, routed  # noqa: E402
from moeserve.moe.kernels import configs  # noqa: E402
from moeserve.moe.kernels.fused_moe import fused_experts  # noqa: E402

# name: (experts, hidden, expert intermediate, top-k)
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "deepseek-v2-lite": (64, 2048, 1408, 6),
          "olmoe-1b-7b": (64, 2048, 1024, 8), "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4)}
TOKENS = (256, 1024, 4096, 8192)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    lines = [f"Device: {dev}; {datetime.date.today()}; torch {torch.__version__}.",
             "Command: `PYTHONPATH=src python benchmarks/moe_defaults.py`", "",
             "| shape | tokens | plain defaults µs | Hopper defaults µs | speedup "
             "| shipped table µs |",
             "|---|---|---|---|---|---|"]
    for name, (e, h, i, k) in SHAPES.items():
        w13, w2 = make_weights(e, h, i)
        table = configs.load_tuned(e, h, i, "bfloat16", dev)
        for n in TOKENS:
            x, ids, wts = routed(n, k, e, h)
            weights = wts.view(n, k)
            cands = {"plain": configs.default_config(n, k, e),
                     "hopper": configs.default_config(n, k, e, hopper=True)}
            if table:
                cands["table"] = configs.nearest(table, n)
            outs = {c: fused_experts(x, w13, w2, ids, weights, 0, "silu", cfg)
                    for c, cfg in cands.items()}
            err = max(((o.float() - outs["plain"].float()).norm()
                       / outs["plain"].float().norm()).item() for o in outs.values())
            assert err < 1e-2, (name, n, err)
            times = {c: [] for c in cands}
            keys = list(cands)
            for r in range(args.rounds):  # each candidate takes each place in a round in turn
                for c in keys[r % len(keys):] + keys[:r % len(keys)]:
                    times[c].append(do_bench(lambda: fused_experts(
                        x, w13, w2, ids, weights, 0, "silu", cands[c])) * 1e3)
            t = {c: statistics.median(v) for c, v in times.items()}
            shipped = f"{t['table']:.1f}" if "table" in t else "-"
            if cands.get("table") == cands["hopper"]:
                shipped += " (the Hopper defaults' tiles)"
            line = (f"| {name} | {n} | {t['plain']:.1f} | {t['hopper']:.1f} | "
                    f"{t['plain'] / t['hopper']:.2f}x | {shipped} |")
            print(line, flush=True)
            lines.append(line)
        w13 = w2 = None  # freed before the next shape's weights
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_defaults.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
