"""`moeserve bench` with a feature on and off, at several concurrencies, on the Qwen3-30B-A3B
shape with dummy weights (one GPU): output tokens/s, TTFT and ITL. The feature is the overlap
schedule unless --flag names another engine flag that turns one off (e.g.
--disable-piecewise-cuda-graph for the prefill graphs).

    PYTHONPATH=src python benchmarks/bench_overlap.py --out DIR [--concurrency 1 16 64 256] \
        [--flag=--disable-overlap-schedule]

Each (concurrency, setting) is one `moeserve bench` process, the two settings alternating,
so both see the same machine in the same run. Concurrency C runs 2C prompts (8 at C = 1) of
--input-len random tokens, --output-len greedy tokens each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def bench(args: argparse.Namespace, c: int, on: bool, out: Path) -> dict:
    path = out / f"bench_c{c}_on{int(on)}.json"
    cmd = [sys.executable, "-m", "moeserve.cli", "bench", "--model", args.model,
           "--load-format", "dummy", "--skip-tokenizer-init",
           "--max-running-requests", str(max(args.concurrency)),
           "--context-length", str(args.input_len + args.output_len + 128),
           "--num-prompts", str(8 if c == 1 else 2 * c), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--max-concurrency", str(c),
           "--no-progress", "--json", str(path)] + ([] if on else [args.flag])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ))
    res = json.loads(path.read_text())
    path.unlink()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="overlap_out")
    p.add_argument("--model", default="preset:qwen3-30b-a3b")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--flag", default="--disable-overlap-schedule",
                   help="the engine flag that turns the compared feature off")
    args = p.parse_args()
    feature = args.flag.removeprefix("--disable-").replace("-", "_")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for c in args.concurrency:
        for on in (True, False):
            s = bench(args, c, on, out)
            rows.append({"concurrency": c, feature: on, **{
                k: s[k] for k in ("output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p90",
                                  "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "completed")}})
            print(json.dumps(rows[-1]), flush=True)
    (out / f"bench_{feature}.json").write_text(json.dumps(rows, indent=1))
    print(f"| concurrency | {feature} | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p90 ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {'on' if r[feature] else 'off'} | "
              f"{r['output_tokens_per_s']:.0f} | {r['ttft_ms_p50']:.1f} | "
              f"{r['itl_ms_p50']:.2f} | {r['itl_ms_p90']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
