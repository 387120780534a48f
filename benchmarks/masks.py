"""The host cost of the grammars' masks, without a model (issue 38), median and tail.

Batch walk: `rows` matchers of the structured benchmark's schemas (schemas.py, in turn) walked
by a token picked at random from each row's mask (as random weights pick); a row's document
ends at its grammar's end or after `--output-len` tokens (the structured benchmark's cap), and
the next one starts at once. The rows' first documents are cut short at staggered lengths, so
that every step holds rows at every point of a document (its start, keys, enums, numbers,
patterns, open strings), as the engine's batch does once requests arrive at different times.
Per step: the runner's fill (grammar.fill_bitmask: the batch on xgrammar's threads) and the
scheduler's accept (accept_token and is_terminated per row); wall and process CPU time, so a
busy machine shows in the wall alone. Grammars as xgrammar compiles them and in the engine's
form (grammar.fast_form: bounded strings unrolled), whose masks must agree.

State walk (the engine's form): `--docs` documents of each schema from their start, one row at
a time, each fill timed alone and named by where the document stands (mask_states.py): the
tail per state and per schema, a matcher's creation and first fill, and the slowest steps.

    PYTHONPATH=src python -m benchmarks.masks [--tiktoken FILE] [--rows 64] [--steps 200]

The vocabulary is benchmarks/vocab.py's synthetic one of `--vocab-size`, or a tiktoken BPE
file's tokens (a real vocabulary, e.g. Qwen's qwen.tiktoken, which a PyPI package may ship)
padded to that size, with one EOS after them.
"""

from __future__ import annotations

import argparse
import base64
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from benchmarks.harness import table
from benchmarks.mask_states import allowed, pct, state_report, walk_states

HELP = "the host cost of the grammars' masks per step (median and tail), without a model"


def add_arguments(p: Any) -> None:
    p.add_argument("--tiktoken", type=Path, default=None,
                   help="a tiktoken BPE file (base64 token, id per line) instead of the "
                        "synthetic vocabulary")
    p.add_argument("--vocab-size", type=int, default=151936)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--output-len", type=int, default=64,
                   help="tokens of a document at most (the structured benchmark's cap)")
    p.add_argument("--docs", type=int, default=20,
                   help="documents per schema of the state walk (0: no state walk)")
    p.add_argument("--worst", type=int, default=10, help="slowest steps of the state walk shown")
    p.add_argument("--seed", type=int, default=0)


def vocabulary(path: Optional[Path], vocab_size: int) -> list[bytes]:
    """Every token's bytes, the last one EOS."""
    if path is None:
        from benchmarks.vocab import EOS, bytes_to_unicode, synthetic_tokens

        byte = {c: b for b, c in bytes_to_unicode().items()}
        return [bytes(byte[c] for c in t) for t in synthetic_tokens(vocab_size)] + [EOS.encode()]
    ranks = dict(line.split() for line in path.read_bytes().splitlines() if line)
    tokens = [b""] * len(ranks)
    for token, rank in ranks.items():
        tokens[int(rank)] = base64.b64decode(token)
    if len(tokens) >= vocab_size:
        raise SystemExit(f"{path} has {len(tokens)} tokens; --vocab-size must exceed that")
    return tokens + [b"<|endoftext|>"]


def walk(make: Callable[[int], Any], rows: int, vocab: int, steps: int, warmup: int,
         seed: int, output_len: int = 64
         ) -> tuple[dict[str, list[float]], list[torch.Tensor]]:
    """Per step: fill wall and CPU seconds, accept wall seconds; and the masks. Row j's first
    document is cut after 1 + j * output_len // rows tokens, every later one after
    output_len."""
    from moeserve.runtime.grammar import fill_bitmask

    rng = random.Random(seed)
    matchers = [make(j) for j in range(rows)]
    left = [1 + j * output_len // rows for j in range(rows)]
    times: dict[str, list[float]] = {"fill": [], "fill_cpu": [], "accept": []}
    masks = []
    for step in range(warmup + steps):
        wall, cpu = time.perf_counter(), time.process_time()
        mask_SW = fill_bitmask(matchers, vocab)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        tokens = [rng.choice(allowed(mask_SW[j], vocab)) for j in range(rows)]
        start = time.perf_counter()
        for m, t in zip(matchers, tokens):
            if not m.accept_token(t):
                raise AssertionError(f"token {t} was in the mask but not accepted")
            m.is_terminated()
        accept = time.perf_counter() - start
        left = [n - 1 for n in left]
        for j, m in enumerate(matchers):
            if m.is_terminated() or left[j] == 0:
                matchers[j], left[j] = make(j), output_len
        masks.append(mask_SW)
        if step >= warmup:
            for k, v in zip(times, (wall, cpu, accept)):
                times[k].append(v)
    return times, masks


def _ms(v: float, digits: int = 2) -> str:
    return f"{v * 1e3:.{digits}f}"


def run(args: Any, argv: Sequence[str] = ()) -> int:
    import xgrammar as xgr

    from moeserve.runtime.grammar import GrammarBackend, GrammarSpec

    from benchmarks.schemas import SCHEMAS

    tokens = vocabulary(args.tiktoken, args.vocab_size)
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=args.vocab_size,
                             stop_token_ids=[len(tokens) - 1])
    backend = GrammarBackend(info)
    specs = [GrammarSpec.json_schema(s) for s in SCHEMAS]
    as_compiled = [backend.compiler.compile_grammar(s.grammar()) for s in specs]
    forms = {"as xgrammar compiles": lambda j: xgr.GrammarMatcher(as_compiled[j % len(specs)]),
             "engine (grammar.fast_form)": lambda j: backend.matcher(specs[j % len(specs)])}
    rows, masks = [], []
    for name, make in forms.items():
        t, m = walk(make, args.rows, args.vocab_size, args.steps, args.warmup, args.seed,
                    args.output_len)
        masks.append(m)
        fill, acc = t["fill"], t["accept"]
        cpu = sum(t["fill_cpu"]) / len(fill)
        rows.append([name, _ms(pct(fill, 50)), _ms(sum(fill) / len(fill)), _ms(pct(fill, 90)),
                     _ms(pct(fill, 99)), _ms(max(fill)), _ms(cpu),
                     f"{cpu / args.rows * 1e6:.0f}", _ms(pct(acc, 50)), _ms(pct(acc, 90)),
                     _ms(max(acc))])
    V = args.vocab_size
    same = all(torch.equal(_bits(a, V), _bits(b, V)) for a, b in zip(*masks))
    source = args.tiktoken or "synthetic (benchmarks/vocab.py)"
    print(f"vocabulary: {source}, {len(tokens)} tokens of {V} ids; {args.rows} rows, "
          f"documents of at most {args.output_len} tokens, {args.steps} steps after "
          f"{args.warmup}; masks of both forms equal: {same}")
    print("\n".join(table(["grammar", "fill ms/step (median)", "mean", "p90", "p99", "max",
                           "CPU ms/step", "CPU us/row", "accept ms/step (median)", "p90",
                           "max"], rows)))
    if args.docs > 0:
        steps, made = walk_states(lambda i: backend.matcher(specs[i]), len(specs), tokens,
                                  V, args.docs, args.output_len, args.seed)
        print(f"\nstate walk (engine form, one row at a time): {args.docs} documents per "
              f"schema, {len(steps)} fills")
        print("\n".join(state_report(steps, made, args.worst)))
    return 0 if same else 1


def _bits(mask_SW: torch.Tensor, vocab: int) -> torch.Tensor:
    """The vocabulary's bits (those past it in the last word are left as the fill leaves them)."""
    bits = (mask_SW.to(torch.int64)[:, :, None] >> torch.arange(32)) & 1
    return bits.flatten(1)[:, :vocab]


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m benchmarks.masks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    sys.exit(run(p.parse_args()))
