"""Greedy tokens of a small DeepSeek engine (latent attention) run after run, against the torch
MLA backend's: to check and bisect the tokens of CUDA graphs, the overlap schedule and the fused
kernels (it reproduced the host-read race that model_runner.copy_to_host fixed).

    PYTHONPATH=src python benchmarks/graph_tokens.py [--case v3|v2-lite] \
        --modes graphs graphs:no-overlap eager:no-overlap decode-graphs:no-overlap \
                graphs:no-overlap:no-pdl graphs:no-overlap:torch=mla_prep,skinny_linear ...

Each mode is one engine run (the triton MLA backend on moeserve/testing/deepseek_engine.py's
case, as tests/test_mla_gpu.py's engine tests run it), its parts joined by ":":
graphs | decode-graphs | prefill-graphs | eager (which CUDA graphs to capture), no-overlap
(--disable-overlap-schedule), no-pdl (MOESERVE_PDL=0), torch=NAME,... or torch=all (those
fused kernels of layers/fast_path.KERNELS replaced by their torch formulations). A mode may repeat. Prints,
per run, "ok" or the first (request, token) where it left the reference, and the counts.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

from moeserve.testing.deepseek_engine import CASES, ENGINE_FLAGS, greedy_requests, write_config


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=sorted(CASES), default="v3")
    p.add_argument("--modes", nargs="+", default=["graphs:no-overlap", "eager:no-overlap"])
    args = p.parse_args()
    import moeserve.layers.fast_path as FP
    from moeserve.runtime.engine import Engine

    folder = write_config(Path(tempfile.mkdtemp()), args.case)
    prompts, params = greedy_requests()

    def run(backend: str, parts: set[str]) -> list[list[int]]:
        graphs = {"graphs": (True, True), "decode-graphs": (True, False),
                  "prefill-graphs": (False, True)}.get(next(
                      (x for x in parts if x.endswith("graphs")), "eager"), (False, False))
        FP._broken.clear()
        torch_kernels = next((x.split("=", 1)[1] for x in parts if x.startswith("torch=")), "")
        if torch_kernels:
            FP._broken.update(FP.KERNELS if torch_kernels == "all" else torch_kernels.split(","))
        os.environ["MOESERVE_PDL"] = "0" if "no-pdl" in parts else "1"
        with Engine(str(folder), attention_backend=backend, disable_cuda_graph=not graphs[0],
                    disable_piecewise_cuda_graph=not graphs[1],
                    disable_overlap_schedule="no-overlap" in parts, **ENGINE_FLAGS) as engine:
            out = engine.generate(input_ids=prompts, sampling_params=params)
        assert all(o["error"] is None for o in out), out
        return [o["token_ids"] for o in out]

    reference = run("torch", {"eager"})
    counts: collections.Counter = collections.Counter()
    for mode in args.modes:
        tokens = run("triton", set(mode.split(":")))
        diffs = [(i, j) for i, (got, want) in enumerate(zip(tokens, reference))
                 for j in range(len(want)) if got[j] != want[j]]
        firsts = sorted({i: j for i, j in reversed(diffs)}.items())
        verdict = "ok" if not diffs else f"wrong from (request, token) {firsts}"
        counts[mode, not diffs] += 1
        print(f"{mode}: {verdict}", flush=True)
    for (mode, ok), n in sorted(counts.items()):
        print(f"{mode}: {n} run(s) {'ok' if ok else 'wrong'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
