"""What the vendor GEMMs reach on the expert GEMMs of the Qwen3-30B-A3B MoE layer at 8192 tokens
(128 experts, H 2048, I 768, top-8: 65536 pairs), with no padding and no gather: a bound on
what a grouped GEMM can give that layer (issue 7's 70%-of-the-GEMM-rate target).

    PYTHONPATH=src python benchmarks/moe_gemm_bound.py

Every group holds exactly 512 rows (uniform routing at its mean). Timed with CUDA events
(moe_common.time_us), beside the copy and 8192^3 matmul ceilings of the same run:
- torch._grouped_mm (CUTLASS on sm90) over the [E, H, 2I] / [E, I, H] transposed views, as
  the grouped_mm runner calls it;
- torch.bmm over [E, 512, H] x [E, H, 2I] (cuBLAS, one batched GEMM: no per-group sizes);
- the gather of x[token] a runner on either would need first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_common import ceilings, time_us  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    e, h, i, k, n = 128, 2048, 768, 8, 8192
    dev = "cuda"
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) * h ** -0.5
    w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) * i ** -0.5
    pairs = n * k
    counts = torch.full((e,), pairs // e, dtype=torch.int32, device=dev)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    a = torch.randn(pairs, h, device=dev, dtype=torch.bfloat16)
    act = torch.randn(pairs, i, device=dev, dtype=torch.bfloat16)
    print(ceilings())
    fl_up = 2 * pairs * h * 2 * i
    fl_dn = 2 * pairs * i * h
    for name, fn, fl in [
        ("grouped_mm gate_up [P,H]x[E,H,2I]^T-view",
         lambda: torch._grouped_mm(a, w13.transpose(1, 2), offs=offs), fl_up),
        ("grouped_mm down [P,I]x[E,I,H]^T-view",
         lambda: torch._grouped_mm(act, w2.transpose(1, 2), offs=offs), fl_dn),
        ("bmm gate_up (E x 512 rows)", lambda: torch.bmm(a.view(e, -1, h), w13.transpose(1, 2)),
         fl_up),
        ("bmm down", lambda: torch.bmm(act.view(e, -1, i), w2.transpose(1, 2)), fl_dn),
        ("gather x[token]", lambda: a[:n][torch.randint(0, n, (pairs,), device=dev)], 0),
    ]:
        t = time_us(fn, reps=30)
        print(f"{name}: {t:.1f} us, {fl / t / 1e6:.1f} TFLOP/s" if fl else f"{name}: {t:.1f} us")


if __name__ == "__main__":
    main()
