"""How to stream a weight into L2 ahead of its GEMV, and what the GEMV gains (one GPU, bf16).

For each way of prefetching (bulk `cp.async.bulk.prefetch.L2` chunks or one `prefetch.global.L2`
per 128-byte line, from P programs): the prefetch kernel's own time, then the skinny GEMV of
one row over the weight when the prefetch ran before a pause, against the same GEMV cold (L2
flushed by a 256 MiB write before each). The pause stands for the attention kernels a decode
step runs between its qkv and o_proj GEMVs.

    PYTHONPATH=src python benchmarks/l2_prefetch_bench.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from moeserve.layers import l2_prefetch  # noqa: E402
from moeserve.layers.skinny_gemm import skinny_linear  # noqa: E402

SHAPES = {"o_proj 4096->2048": (2048, 4096), "qkv 2048->5120": (5120, 2048),
          "down 8 experts 768->2048": (8 * 2048, 768)}


def launcher(kind: str, programs: int):
    def run(w: torch.Tensor) -> None:
        nbytes = w.numel() * w.element_size()
        kernel = (l2_prefetch._prefetch_kernel if kind == "bulk"
                  else l2_prefetch._prefetch_lines_kernel)
        kernel[(programs,)](w, nbytes, THREADS=128, PDL=False, num_warps=4)
    return run


def measure(w: torch.Tensor, x: torch.Tensor, flush: torch.Tensor, prefetch, pause_cycles: int,
            reps: int = 30) -> dict[str, float]:
    pf_us, gemv_us = [], []
    for i in range(reps + 3):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        flush.zero_()
        ev[0].record()
        if prefetch is not None:
            prefetch(w)
        ev[1].record()
        torch.cuda._sleep(pause_cycles)
        ev[2].record()
        skinny_linear(x, w)
        ev[3].record()
        torch.cuda.synchronize()
        if i >= 3:
            pf_us.append(ev[0].elapsed_time(ev[1]) * 1e3)
            gemv_us.append(ev[2].elapsed_time(ev[3]) * 1e3)
    return {"prefetch_us": statistics.median(pf_us), "gemv_us": statistics.median(gemv_us)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="l2_prefetch_out")
    p.add_argument("--pause-us", type=float, nargs="+", default=[10.0])
    args = p.parse_args()
    dev = torch.device("cuda")
    clock_hz = getattr(torch.cuda.get_device_properties(dev), "clock_rate", 1_980_000) * 1e3
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ways = [("none", 0)] + [(k, n) for k in ("bulk", "lines") for n in (16, 132, 264, 528)]
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        for pause in args.pause_us:
            for kind, programs in ways:
                pf = None if kind == "none" else launcher(kind, programs)
                r = measure(w, x, flush, pf, int(pause * 1e-6 * clock_hz))
                r.update(shape=name, mb=w.numel() * 2 / 1e6, pause_us=pause, way=kind,
                         programs=programs)
                rows.append(r)
                print(f"{name:26s} pause {pause:5.1f} us  {kind:5s} x{programs:3d}: prefetch "
                      f"{r['prefetch_us']:7.2f} us, gemv {r['gemv_us']:6.2f} us", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "l2_prefetch_bench.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(dev), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
