"""Structured output against the same requests unconstrained, one engine, one run (issue 38's
GPU acceptance: at concurrency 64 it costs at most 10% of the output tok/s).

    PYTHONPATH=src python -m benchmarks structured --out $OUT [--results benchmarks/RESULTS.md]

The Qwen3-30B-A3B shape (or --model) with dummy bf16 weights and, for a preset, a synthetic
byte-level vocabulary of the model's full size (benchmarks/vocab.py; --vocab preset keeps the
preset's 257-token stand-in). Each request of the constrained run carries one of the JSON
schemas of benchmarks/schemas.py, in turn. Before timing, every schema's request runs once
(its grammar compiled and its output checked: a JSON object's text, and the complete ones
parse and validate), then a round of each mode, untimed. A third run, unconstrained with each
request capped at the tokens its constrained run produced, is the control: the same requests
ending early and their successors prefilled between decode steps, without the grammars.
"""

from __future__ import annotations

import importlib.metadata
import json
import queue
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks import harness
from benchmarks.harness import Ceilings, RunInfo, table

HELP = "structured output (JSON schemas) against the same requests unconstrained"
TITLE = "Structured output"
MODEL = "preset:qwen3-30b-a3b"
CHECK_TOKENS = 256  # the output check's cap: a bounded document ends well within it
CHECK_WAIT_S = 300  # the longest wait for a check request's next output
CONTROL = "unconstrained, json_schema's lengths"
METHOD = """\
One engine, dummy bf16 weights, greedy, ignore_eos, the prefix cache off (both modes send the
same prompts). At each concurrency the same random prompts run twice through `moeserve bench`'s
driver: unconstrained, then each with a JSON schema (8 schemas in turn: nested objects, arrays,
enums, bounded numbers, strings with patterns, an optional field, each ending in an open
string or array). Both modes are warmed up first (every schema compiled, a round of each mode
untimed), so grammar compilation and Triton's compiles are not timed; the compiled grammars
are cached, as in serving. A grammar that ends finishes its request early, so the headline is
the same for both modes: all output tokens completed ÷ the run's wall time (the tokens per
request and finish reasons are shown beside it). The vocabulary is a synthetic byte-level one
of the model's full size (151,936 tokens for Qwen3-30B-A3B), since xgrammar's mask work per
step grows with it; the masks are filled on the host while the device runs the step before,
and applied in the sampler. The baseline is the unconstrained run; the ratio is constrained
÷ unconstrained output tok/s (issue 38 asks >= 0.90 at concurrency 64). A grammar that ends a
request early also changes the schedule: its successor is admitted alone and prefilled in a
step of its own, between the decode steps of the others, where the unconstrained requests all
end together and their successors prefill together. The control row, unconstrained with each
request capped at the tokens its constrained run produced, has that schedule without the
grammars; the constrained run ÷ the control is the grammars' own cost."""


def add_arguments(p: Any) -> None:
    harness.add_output_arguments(p)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--vocab", choices=("synthetic", "preset"), default="synthetic",
                   help="for a preset model: a synthetic vocabulary of its full size (default) "
                        "or the preset's 257-token byte stand-in")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto",
                   help="cpu: a smoke run with no ceilings (the timings mean nothing)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64])
    p.add_argument("--prompts-per-concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--max-total-tokens", type=int, default=None, help="the engine's KV cap")
    p.add_argument("--enable-mixed-chunk", action="store_true",
                   help="the engine's --enable-mixed-chunk: a request admitted while others "
                        "decode is prefilled in a step that also carries their decodes")


def grammar_specs() -> list[Any]:
    from moeserve.runtime.grammar import GrammarSpec

    from benchmarks.schemas import SCHEMAS

    return [GrammarSpec.json_schema(s) for s in SCHEMAS]


def engine_flags(args: Any) -> dict[str, Any]:
    flags: dict[str, Any] = dict(
        load_format="dummy", dtype=args.dtype, context_length=args.context_length,
        max_running_requests=max(args.concurrency), disable_radix_cache=True)
    if args.device == "cpu":
        flags["device"] = "cpu"
    if args.max_total_tokens:
        flags["max_total_tokens"] = args.max_total_tokens
    if args.enable_mixed_chunk:
        flags["enable_mixed_chunk"] = True
    return flags


def check_outputs(engine: Any, args: Any) -> dict[str, Any]:
    """One request per schema, its open fields bounded (schemas.closed) so that it can end:
    every output must read as the start of a JSON object, and each that its grammar ended must
    parse (and validate, with jsonschema)."""
    from moeserve.bench import random_prompts
    from moeserve.runtime.grammar import GrammarSpec
    from moeserve.runtime.sampling import SamplingParams

    from benchmarks.schemas import SCHEMAS, closed

    schemas = [closed(s) for s in SCHEMAS]
    specs = [GrammarSpec.json_schema(s) for s in schemas]
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    errors = (ValueError,) + ((jsonschema.ValidationError,) if jsonschema else ())
    most = max(1, min(CHECK_TOKENS, args.context_length - args.input_len))
    params = SamplingParams(max_new_tokens=most, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(len(specs), args.input_len, engine.spec.vocab_size, seed=12345)
    waiting = [engine.submit(ids, params, grammar=g)[1] for ids, g in zip(prompts, specs)]
    found: dict[str, Any] = {"requests": len(specs), "json_start": 0, "ended": 0, "valid": 0,
                             "validated_with": "jsonschema" if jsonschema else "json.loads",
                             "invalid": [], "errors": [], "samples": []}
    for q, schema in zip(waiting, schemas):
        ids, finish = [], None
        while finish is None:
            try:
                out = q.get(timeout=CHECK_WAIT_S)
            except queue.Empty:
                found["errors"].append(f"no output within {CHECK_WAIT_S} s")
                break
            if out.error:
                found["errors"].append(out.error)
                break
            ids += out.token_ids
            finish = out.finish.reason if out.finish is not None else None
        text = engine.tokenizer.decode(ids)
        found["samples"].append({"finish": finish, "tokens": len(ids), "text": text[:120]})
        found["json_start"] += text.startswith("{")
        if finish == "stop":
            found["ended"] += 1
            try:
                doc = json.loads(text, strict=False)
                if jsonschema is not None:
                    jsonschema.validate(doc, schema)
                found["valid"] += 1
            except errors as exc:
                found["invalid"].append(f"{text[:200]!r}: {str(exc)[:200]}")
    if found["errors"]:
        found["problem"] = (f"{len(found['errors'])} of the output check's requests failed: "
                            f"{found['errors'][0]}")
    elif found["json_start"] != len(specs) or found["invalid"]:
        found["problem"] = (f"{found['json_start']} of {len(specs)} constrained outputs start "
                            f"as a JSON object, {len(found['invalid'])} complete ones do not "
                            "validate: the grammars are not applied as asked")
    return found


def measure(args: Any) -> dict[str, Any]:
    from moeserve.bench import random_prompts, run_bench
    from moeserve.runtime.engine import Engine

    from benchmarks.vocab import write_checkpoint

    specs = grammar_specs()
    res: dict[str, Any] = {"rows": [], "problems": []}
    with tempfile.TemporaryDirectory(prefix="moeserve_structured_") as tmp:
        model = args.model
        if model.startswith("preset:") and args.vocab == "synthetic":
            model = str(write_checkpoint(Path(tmp) / "checkpoint", args.model))
        t0 = time.perf_counter()
        with Engine(model, **engine_flags(args)) as engine:
            res["startup_s"] = time.perf_counter() - t0
            res["vocab_size"] = engine.spec.vocab_size
            res["tokenizer_tokens"] = engine.tokenizer.hf.get_vocab_size(with_added_tokens=True)
            res["check"] = check_outputs(engine, args)
            print(f"check: {res['check']}", flush=True)
            if res["check"].get("problem"):
                res["problems"].append(res["check"]["problem"])
            top = max(args.concurrency)
            warm = random_prompts(max(2 * len(specs), top), args.input_len,
                                  engine.spec.vocab_size, seed=1)
            run_bench(engine, warm, args.output_len, top, progress=False)
            run_bench(engine, warm, args.output_len, top, progress=False,
                      grammars=[specs[i % len(specs)] for i in range(len(warm))])
            for c in args.concurrency:
                prompts = random_prompts(c * args.prompts_per_concurrency, args.input_len,
                                         engine.spec.vocab_size, seed=c)
                grammars = [specs[i % len(specs)] for i in range(len(prompts))]
                lens: Any = args.output_len
                for mode, g in (("unconstrained", None), ("json_schema", grammars),
                                (CONTROL, None)):
                    s = run_bench(engine, prompts, lens, c, progress=False, grammars=g)
                    res["rows"].append({"concurrency": c, "mode": mode, **s})
                    if mode == "json_schema":  # the control's caps
                        lens = [max(1, n) for n in s["request_output_tokens"]]
                    if s["completed"] != len(prompts):
                        res["problems"].append(
                            f"{mode} at concurrency {c}: {s['completed']} of {len(prompts)} "
                            f"requests completed; errors {s['errors']}")
                    print(f"concurrency {c} {mode}: {s['output_tokens_per_s']:.0f} output "
                          f"tok/s, finish {s['finish_reasons']}", flush=True)
    return res


def render(args: Any, info: RunInfo, ceil: Optional[Ceilings], res: dict[str, Any]) -> str:
    chk = res["check"]
    vocab = (f"a synthetic byte-level vocabulary of {res['tokenizer_tokens']} tokens"
             if args.model.startswith("preset:") and args.vocab == "synthetic"
             else f"the tokenizer of {args.model} ({res['tokenizer_tokens']} tokens)")
    body = [f"Model {args.model} (dummy {args.dtype}), {vocab}; prompts of {args.input_len} "
            f"random tokens, at most {args.output_len} output tokens, "
            f"{args.prompts_per_concurrency} x concurrency requests per run; "
            + ("--enable-mixed-chunk (a prefill step carries the running requests' decodes)"
               if args.enable_mixed_chunk
               else "mixed chunks off (a prefill step runs alone)")
            + f"; engine startup {res['startup_s']:.0f} s.", "",
            f"Output check (untimed: one request per schema with its open fields bounded, up "
            f"to {CHECK_TOKENS} tokens): {chk['json_start']} of {chk['requests']} read as a "
            f"JSON object; {chk['ended']} ended by their grammar, "
            f"{chk['valid']} of them parse and validate ({chk['validated_with']})"
            + (f"; not: {chk['invalid'][0]}" if chk["invalid"] else "") + ".", ""]
    rows, ratios = [], {}
    free = {r["concurrency"]: r for r in res["rows"] if r["mode"] == "unconstrained"}
    for r in res["rows"]:
        base = free[r["concurrency"]]["output_tokens_per_s"]
        ratio = r["output_tokens_per_s"] / base if base else None
        if r["mode"] == "json_schema":
            ratios[r["concurrency"]] = ratio
        finishes = ", ".join(f"{k} {v}" for k, v in sorted(r["finish_reasons"].items(),
                                                           key=lambda kv: str(kv[0])))
        rows.append([r["concurrency"], r["mode"], r["completed"],
                     f"{r['output_tokens'] / max(1, r['completed']):.1f}", finishes,
                     f"{r['output_tokens_per_s']:.0f}",
                     f"{ratio:.3f}" if ratio is not None else "-",
                     f"{r['ttft_ms_p50'] or 0:.1f}", f"{r['itl_ms_p50'] or 0:.2f}",
                     f"{r['itl_ms_p90'] or 0:.2f}", f"{r['itl_ms_p99'] or 0:.2f}"])
    body += table(["concurrency", "mode", "requests", "output tokens / request", "finish",
                   "output tok/s", "x unconstrained", "TTFT p50 ms", "ITL p50 ms",
                   "ITL p90 ms", "ITL p99 ms"], rows)
    body += ["", "Constrained ÷ unconstrained output tok/s: " + ", ".join(
        f"{v:.3f} at concurrency {c}" for c, v in ratios.items() if v is not None) + "."]
    own = {r["concurrency"]: r["output_tokens_per_s"] for r in res["rows"]
           if r["mode"] == "json_schema"}
    controls = [(r["concurrency"], own[r["concurrency"]] / r["output_tokens_per_s"])
                for r in res["rows"] if r["mode"] == CONTROL and r["output_tokens_per_s"]]
    if controls:
        body += ["", "Constrained ÷ the control (the same lengths unconstrained), the grammars' "
                 "own cost: " + ", ".join(f"{v:.3f} at concurrency {c}"
                                         for c, v in controls) + "."]
    body += [f"**Invalid run: {p}.**" for p in res["problems"]]
    return harness.section(TITLE, METHOD, info, ceil, body)


def run(args: Any, argv: list[str]) -> int:
    if args.device != "cpu":
        harness.require_gpu()
    info = RunInfo.collect("structured", argv)
    try:
        info.versions["xgrammar"] = importlib.metadata.version("xgrammar")
    except importlib.metadata.PackageNotFoundError:  # importable without its metadata
        info.versions["xgrammar"] = "?"
    ceil = harness.measure_ceilings() if args.device != "cpu" else None
    if ceil is not None:
        print(ceil.line(), flush=True)
    res = measure(args)
    text = render(args, info, ceil, res)
    # a run with failed requests, or outputs that do not follow their grammars, goes to --out
    # only, never into RESULTS.md
    harness.save(Path(args.out), "structured",
                 {"args": vars(args), "info": info, "ceilings": ceil, **res}, text,
                 None if res["problems"] else args.results)
    for problem in res["problems"]:
        print(f"structured: {problem}", file=sys.stderr)
    return 1 if res["problems"] else 0
