"""The engine process's output path without a model: how many tokens a second its output
thread (the ranks' queue, detokenization, delivery) and its clients take.

    PYTHONPATH=src python -m benchmarks outputs --out $OUT [--results benchmarks/RESULTS.md]

An Engine on preset:tiny whose rank is a stand-in process (moeserve.testing.synthetic_ranks)
that puts one output per running request a step on the engine's queue, in messages of
--batch outputs, a step every --step-ms. The engine's side is all real: unpickling,
RequestState.translate (the preset's byte-level tokenizer, or none: skip_tokenizer_init),
delivery, and its clients:
  bench   `moeserve bench`'s driver (moeserve.bench.run_bench)
  stream  one thread per request iterating Engine.stream (as a caller of the API would)
A row is the median of --repeats runs, each with an engine of its own. It runs on any CPU and
measures that CPU. --profile: cProfile of the output thread and of the clients (the bench's
own thread, or every client thread), their functions by own time.
"""

from __future__ import annotations

import cProfile
import dataclasses
import io
import os
import pstats
import statistics
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from benchmarks import harness
from benchmarks.harness import RunInfo, table

HELP = "the engine's output path (router, detokenizer, clients) without a model, on the CPU"
TITLE = "Engine output path"
METHOD = """\
Output tokens/s delivered to clients by an Engine whose rank is a stand-in without a model
(moeserve.testing.synthetic_ranks): a step every "step ms", one token for each running request,
on the engine's queue as a rank puts them. Where the offered rate (concurrency / step) is above
what the engine's process can take, the row is that process's ceiling on this CPU whatever the
GPUs do; below it, the row should be the offered rate less the ramp at the start and end.
Prompts of 16 random tokens, --output-len tokens each, --waves x concurrency requests a run.
"bench" is `moeserve bench`'s driver, "stream" a thread per request over Engine.stream."""


def add_arguments(p: Any) -> None:
    harness.add_output_arguments(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--clients", nargs="+", choices=("bench", "stream"),
                   default=["bench", "stream"])
    p.add_argument("--tokenizer", nargs="+", choices=("on", "off"), default=["on", "off"])
    p.add_argument("--batch", type=int, nargs="+", default=[1024],
                   help="outputs per message on the engine's queue (a DP group's share of a step)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--step-ms", type=float, nargs="+", default=[2.0, 20.0],
                   help="the stand-in's step time (0: as fast as it can)")
    p.add_argument("--repeats", type=int, default=3, help="runs per row (the median)")
    p.add_argument("--profile", action="store_true")


def stream_clients(engine: Any, prompts: Sequence[Sequence[int]], output_len: int,
                   concurrency: int) -> dict[str, Any]:
    """A thread per request at a time over Engine.stream: tokens/s, and whether every request
    got the stand-in's tokens."""
    from moeserve.testing.synthetic_ranks import expected_tokens

    todo = iter(range(len(prompts)))
    lock = threading.Lock()
    wrong: list[int] = []
    total = [0]

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            got: list[int] = []
            for chunk in engine.stream(input_ids=prompts[i],
                                       sampling_params={"max_new_tokens": output_len}):
                got += chunk["token_ids"]
            with lock:
                total[0] += len(got)
                if got != expected_tokens(prompts[i], output_len):
                    wrong.append(i)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    duration = time.perf_counter() - start
    return {"output_tokens": total[0], "output_tokens_per_s": total[0] / duration,
            "wrong": len(wrong)}


@contextmanager
def profiled_threads() -> Iterator[list[tuple[str, cProfile.Profile]]]:
    """A cProfile of every thread started inside (cProfile sees only its own thread)."""
    found: list[tuple[str, cProfile.Profile]] = []
    run = threading.Thread.run

    def profiled(self: threading.Thread) -> None:
        prof = cProfile.Profile()
        found.append((self.name, prof))
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()

    threading.Thread.run = profiled  # type: ignore[method-assign]
    try:
        yield found
    finally:
        threading.Thread.run = run  # type: ignore[method-assign]


def top(profiles: Sequence[cProfile.Profile], lines: int = 18) -> list[str]:
    buf = io.StringIO()
    stats = pstats.Stats(profiles[0], stream=buf)
    for p in profiles[1:]:
        stats.add(p)
    stats.sort_stats("tottime").print_stats(lines)
    text = buf.getvalue()
    return text[text.index("   ncalls"):].rstrip().splitlines()


def measure(args: Any, tokenizer: str, batch: int, step_ms: float, concurrency: int,
            clients: str) -> dict[str, Any]:
    """One row: the median of --repeats runs, each with an engine of its own (the profile,
    of the first, is then of this row alone)."""
    runs = [run_once(args, tokenizer, batch, step_ms, concurrency, clients,
                     profile=args.profile and k == 0) for k in range(args.repeats)]
    rates = sorted(r["output_tokens_per_s"] for r in runs)
    row = {"clients": clients, "concurrency": concurrency, "tokenizer": tokenizer,
           "batch": batch, "step_ms": step_ms, "output_tokens_per_s": statistics.median(rates),
           "runs": rates, "itl_ms_p99": runs[0].get("itl_ms_p99"),
           "output_tokens": [r["output_tokens"] for r in runs],
           "wrong": sum(r["wrong"] for r in runs)}
    print({k: row[k] for k in row}, flush=True)
    return {**row, **{k: v for k, v in runs[0].items() if k.startswith("profile")}}


def run_once(args: Any, tokenizer: str, batch: int, step_ms: float, concurrency: int,
             clients: str, profile: bool) -> dict[str, Any]:
    from moeserve.bench import random_prompts, run_bench
    from moeserve.testing.synthetic_ranks import SyntheticEngine

    with profiled_threads() if profile else _nothing() as threads:
        engine = SyntheticEngine(skip_tokenizer_init=tokenizer == "off", batch=batch,
                                 step_s=step_ms / 1e3)
        main = cProfile.Profile()
        with engine as e:
            vocab = e.spec.vocab_size
            run_bench(e, random_prompts(32, 16, vocab, seed=0), 8, 32, progress=False)
            prompts = random_prompts(concurrency * args.waves, 16, vocab, seed=concurrency)
            if profile:
                main.enable()
            if clients == "bench":
                s = run_bench(e, prompts, args.output_len, concurrency, progress=False)
                s["wrong"] = s["num_prompts"] - s["completed"] + (
                    s["output_tokens"] != len(prompts) * args.output_len)
            else:
                s = stream_clients(e, prompts, args.output_len, concurrency)
            main.disable()
        e._router.join(timeout=5.0)  # its profile ends with it
    if threads is not None:
        s["profile_router"] = top([p for name, p in threads if name == "moeserve-router"])
        s["profile_clients"] = top([main] + [
            p for name, p in threads if not name.startswith(("moeserve-", "QueueFeeder"))])
    return s


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def render(rows: list[dict[str, Any]]) -> list[str]:
    out = table(["clients", "concurrency", "tokenizer", "outputs per message", "step ms",
                 "offered tok/s", "output tok/s (median)", "runs", "ITL p99 ms"],
                [[r["clients"], r["concurrency"], r["tokenizer"], r["batch"], f"{r['step_ms']:g}",
                  f"{r['concurrency'] / r['step_ms'] * 1e3:.0f}" if r["step_ms"] else "-",
                  f"{r['output_tokens_per_s']:.0f}",
                  " ".join(f"{x / 1e3:.1f}k" for x in r["runs"]),
                  "-" if r["itl_ms_p99"] is None else f"{r['itl_ms_p99']:.1f}"] for r in rows])
    for r in rows:
        if "profile_router" in r:
            out += ["", f"{r['clients']}, concurrency {r['concurrency']}, tokenizer "
                    f"{r['tokenizer']}: the router thread, then the clients (cProfile, own "
                    "time first)", "", "```", *r["profile_router"], "", *r["profile_clients"],
                    "```"]
    return out


def run(args: Any, argv: list[str]) -> int:
    info = RunInfo.collect("outputs", argv)
    info = dataclasses.replace(info, device=f"{cpu_name()}, {os.cpu_count()} cores")
    rows = [measure(args, tok, b, step, c, clients) for tok in args.tokenizer
            for b in args.batch for step in args.step_ms for c in args.concurrency
            for clients in args.clients]
    bad = [r for r in rows if r["wrong"]]
    text = harness.section(TITLE, METHOD, info, None, render(rows))
    harness.save(Path(args.out), "outputs", {"info": info, "rows": rows}, text, args.results)
    if bad:
        print(f"requests with wrong or missing tokens: {bad}")
    return 1 if bad else 0
