"""Host work of one scheduler + runner step, with the model replaced by a stand-in that returns
logits at once: what Python spends between GPU steps (scheduling, KV bookkeeping, batch
building, sampling setup, outputs). Runs on a CPU.

    PYTHONPATH=src python benchmarks/host_overhead.py --batch 256
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from moeserve.config import EngineConfig
from moeserve.parallel.groups import single_process_state
from moeserve.runtime.devices import runtime_config
from moeserve.runtime.engine import make_plan
from moeserve.runtime.request import RequestInput
from moeserve.runtime.sampling import SamplingParams
from moeserve.runtime.worker import Message, RankWorker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; above: every request samples (top_p 0.95, a seed)")
    args = ap.parse_args()
    cfg = runtime_config(EngineConfig(
        model="preset:tiny", load_format="dummy", device="cpu", max_total_tokens=400_000,
        max_running_requests=args.batch, context_length=2048, gpu_memory_gb=4))
    plan = make_plan(cfg)
    worker = RankWorker(cfg, plan.spec, plan, single_process_state(plan.layout), (256,))
    vocab = plan.spec.vocab_size

    def stand_in(ids, positions, fb, step):  # logits at once: only host work is left
        rows = fb.batch_size if fb.logit_rows is not None else ids.shape[0]
        return torch.zeros(rows, vocab)

    worker.runner.model = stand_in
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=args.steps + 1, temperature=args.temperature,
                            ignore_eos=True, **({"top_p": 0.95, "seed": 1}
                                                if args.temperature > 0 else {}))
    worker.iteration([Message("add", RequestInput(
        f"r{i}", tuple(rng.randrange(256) for _ in range(args.prompt_len)), params, 0, True))
        for i in range(args.batch)])  # the prefill step
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        worker.iteration([])
        times.append(time.perf_counter() - start)
    print(f"decode step host work at batch {args.batch}, temperature {args.temperature}: median "
          f"{statistics.median(times) * 1000:.2f} ms over {args.steps} steps")


if __name__ == "__main__":
    main()
