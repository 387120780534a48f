"""Where a serving step's time goes beyond its graph replay: the rank loop at batch 1, phase
by phase, and the inter-token latency that a client sees.

    PYTHONPATH=src python benchmarks/loop_phases.py --out DIR [--model preset:qwen3-30b-a3b]

Three ways to run the same requests (greedy, --input-len prompt, --output-len tokens, one at
a time), each in its own process, with the overlap schedule on and off (--overlap 1 0):
  loop     a RankWorker driven by hand (no engine, no other thread): the host's own cost
  thread   the Engine with its rank in a thread of the engine's process (the default for one
           GPU): `moeserve bench` at concurrency 1
  process  the Engine with its rank in a process of its own (what `moeserve serve` uses)
For loop and thread, each decode iteration is cut into phases by wrappers (median µs):
schedule; launch (the forward's host time: inputs copied, graph launched; then the sampler's
launches); collect (the wait for the tokens of the step in flight: with overlap, the step
launched one iteration before, else this one; then their read-back); process; the gap between
iterations (the serve loop: inbox, stats, outbox).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

PHASES = ("schedule", "launch", "collect", "process", "between")


class PhaseClock:
    """Wraps the worker's methods; one record per iteration that launched a decode of one
    request."""

    def __init__(self, worker: Any) -> None:
        self.rows: list[dict[str, float]] = []
        self.cur: dict[str, float] = {}
        self.mode = None
        self.last_end = None
        sched, runner = worker.scheduler, worker.runner

        def timed(name: str, fn: Callable) -> Callable:
            def call(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                out = fn(*a, **k)
                self.cur[name] = self.cur.get(name, 0.0) + (time.perf_counter() - t0) * 1e6
                return out
            return call

        def schedule() -> Any:
            batch = timed("schedule", orig_schedule)()
            self.mode = None if batch is None else (batch.mode.name, len(batch.reqs))
            return batch

        def iteration(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            self.cur, self.mode = {}, None
            if self.last_end is not None:
                self.cur["between"] = (t0 - self.last_end) * 1e6
            out = orig_iteration(*a, **k)
            self.last_end = time.perf_counter()
            self.cur["total"] = (self.last_end - t0) * 1e6 + self.cur.get("between", 0.0)
            if self.mode == ("DECODE", 1) and "between" in self.cur:
                self.rows.append(self.cur)
            return out

        orig_schedule, orig_iteration = sched.schedule, worker.iteration
        sched.schedule, worker.iteration = schedule, iteration
        runner.launch = timed("launch", runner.launch)
        runner.collect = timed("collect", runner.collect)
        sched.process = timed("process", sched.process)

    def summary(self) -> dict[str, float]:
        rows = self.rows[2:]  # the first decodes after a prefill
        return {n: statistics.median(r.get(n, 0.0) for r in rows) for n in (*PHASES, "total")}


def flags(args: argparse.Namespace) -> dict[str, Any]:
    return dict(load_format="dummy", dtype="bfloat16" if args.device == "cuda" else "float32",
                device=args.device, skip_tokenizer_init=True,
                disable_overlap_schedule=not args.overlap_on,
                context_length=args.input_len + args.output_len + 64, max_running_requests=8)


def run_loop(args: argparse.Namespace) -> dict[str, Any]:
    """One request after another through a hand-driven RankWorker."""
    from moeserve.bench import random_prompts
    from moeserve.config import EngineConfig
    from moeserve.parallel.groups import single_process_state
    from moeserve.runtime.devices import rank_device, runtime_config
    from moeserve.runtime.engine import make_plan
    from moeserve.runtime.request import RequestInput
    from moeserve.runtime.sampling import SamplingParams
    from moeserve.runtime.worker import Message, RankWorker

    cfg = runtime_config(EngineConfig(model=args.model, **flags(args)))
    plan = make_plan(cfg)
    worker = RankWorker(cfg, plan.spec, plan,
                        single_process_state(plan.layout, rank_device(cfg, 0)), ())
    clock = PhaseClock(worker)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    itl: list[float] = []
    for i, ids in enumerate(random_prompts(args.requests, args.input_len,
                                           plan.spec.vocab_size, seed=0)):
        msgs = [Message("add", RequestInput(f"r{i}", tuple(ids), params, 0, True))]
        last = None
        while True:
            outs, _, has_work = worker.iteration(msgs)
            msgs = []
            now = time.perf_counter()
            if any(o.token_ids for o in outs):
                if last is not None:
                    itl.append((now - last) * 1e3)
                last = now
            if not has_work:
                break
    return {"itl_ms_p50": statistics.median(itl), "phases_us": clock.summary()}


def run_engine(args: argparse.Namespace, in_process: bool) -> dict[str, Any]:
    from moeserve.bench import random_prompts, run_bench
    from moeserve.runtime.engine import Engine

    engine = Engine(args.model, in_process=in_process, **flags(args))
    clock = PhaseClock(engine._thread._args[0]) if in_process else None
    prompts = random_prompts(args.requests, args.input_len, engine.spec.vocab_size, seed=0)
    s = run_bench(engine, prompts, args.output_len, 1, progress=False)
    engine.shutdown()
    out = {"itl_ms_p50": s["itl_ms_p50"], "itl_ms_p90": s["itl_ms_p90"],
           "output_tokens_per_s": s["output_tokens_per_s"]}
    if clock is not None:
        out["phases_us"] = clock.summary()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="loop_out")
    p.add_argument("--model", default="preset:qwen3-30b-a3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", nargs="+", default=["loop", "thread", "process"])
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--overlap", type=int, nargs="+", default=[1, 0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--overlap-on", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        res = (run_loop(args) if args.child == "loop"
               else run_engine(args, in_process=args.child == "thread"))
        name = f"loop_{args.child}_overlap{args.overlap_on}.json"
        (out / name).write_text(json.dumps(res, indent=1))
        return 0
    results = {}
    for mode in args.modes:
        for on in args.overlap:
            subprocess.check_call([sys.executable, __file__, *sys.argv[1:], "--child", mode,
                                   "--overlap-on", str(on)])
            name = f"loop_{mode}_overlap{on}.json"
            results[f"{mode}, overlap {on}"] = json.loads((out / name).read_text())
            (out / name).unlink()
    print(f"batch-1 decode, {args.model}, {args.input_len} in / {args.output_len} out")
    print("| mode | ITL p50 ms | " + " | ".join(f"{n} µs" for n in (*PHASES, "total")) + " |")
    print("|---" * (len(PHASES) + 3) + "|")
    for mode, r in results.items():
        ph = r.get("phases_us", {})
        cells = [f"{ph[n]:.0f}" if n in ph else "-" for n in (*PHASES, "total")]
        print(f"| {mode} | {r['itl_ms_p50']:.3f} | " + " | ".join(cells) + " |")
    (out / "loop_phases.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
