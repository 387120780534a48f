"""Where a grammar's mask costs the most: documents walked one row at a time, each fill timed
alone and named by the point of the JSON document it is filled at (`json_state`), for
masks.py's state walk."""

from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from benchmarks.harness import table


@dataclass(frozen=True)
class Step:
    """One fill of the state walk: schema index, tokens of the document before it, its state,
    fill and accept seconds, and the document's last characters before it."""

    schema: int
    position: int
    state: str
    fill_s: float
    accept_s: float
    before: str


def allowed(row_W: torch.Tensor, vocab: int) -> list[int]:
    """The token ids a bitmask row allows."""
    bits = ((row_W.to(torch.int64)[:, None] >> torch.arange(32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank) of values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def json_state(text: str) -> str:
    """Where a JSON document written up to `text` stands: "start", inside a "key" or a value
    "string", in a "number/literal", at a "value start" (after a colon), at the "next key" of
    an object (after `{` or a comma), the "next item" of an array, "after key" (its colon
    next), "after value" (a comma or a bracket next)."""
    stack: list[str] = []
    in_string = escaped = is_key = False
    last = "start"
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string, last = False, "after key" if is_key else "after value"
            continue
        if ch == '"':
            in_string, is_key = True, last == "next key"
        elif ch in "{[":
            stack.append(ch)
            last = "next key" if ch == "{" else "next item"
        elif ch in "}]":
            if stack:
                stack.pop()
            last = "after value"
        elif ch == ":":
            last = "value start"
        elif ch == ",":
            last = "next key" if stack and stack[-1] == "{" else "next item"
        elif not ch.isspace():
            last = "number/literal"
    if in_string:
        return "key" if is_key else "string"
    return last


def walk_states(make: Callable[[int], Any], schemas: int, tokens: Sequence[bytes], vocab: int,
                docs: int, output_len: int, seed: int
                ) -> tuple[list[Step], dict[int, list[float]]]:
    """`docs` documents of each schema (make(i): a fresh matcher of schema i), each to its
    grammar's end or `output_len` tokens, a random allowed token a step. Returns the steps and,
    per schema, each matcher's creation seconds."""
    rng = random.Random(seed)
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    steps: list[Step] = []
    made: dict[int, list[float]] = collections.defaultdict(list)
    for i in range(schemas):
        for _ in range(docs):
            start = time.perf_counter()
            m = make(i)
            made[i].append(time.perf_counter() - start)
            text = b""
            for position in range(output_len):
                start = time.perf_counter()
                m.fill_next_token_bitmask(bitmask, 0)
                fill = time.perf_counter() - start
                token = rng.choice(allowed(bitmask[0], vocab))
                start = time.perf_counter()
                if not m.accept_token(token):
                    raise AssertionError(f"token {token} was in the mask but not accepted")
                ended = m.is_terminated()
                accept = time.perf_counter() - start
                shown = text.decode("utf-8", errors="replace")
                steps.append(Step(i, position, json_state(shown), fill, accept, shown[-32:]))
                text += tokens[token]
                if ended:
                    break
    return steps, made


def _us(v: float) -> str:
    return f"{v * 1e6:.0f}"


def state_report(steps: list[Step], made: dict[int, list[float]], worst: int) -> list[str]:
    """Tables of the fills per state and per schema (median, p90, p99, max), and the slowest
    steps."""
    def quantiles(fills: list[float]) -> list[str]:
        return [str(len(fills)), *(_us(pct(fills, q)) for q in (50, 90, 99)), _us(max(fills))]

    by_state: dict[str, list[Step]] = collections.defaultdict(list)
    by_schema: dict[int, list[Step]] = collections.defaultdict(list)
    for s in steps:
        by_state[s.state].append(s)
        by_schema[s.schema].append(s)
    rows = [[state, *quantiles([s.fill_s for s in group]),
             _us(pct([s.accept_s for s in group], 50)), _us(max(s.accept_s for s in group))]
            for state, group in sorted(by_state.items(), key=lambda kv: -len(kv[1]))]
    lines = table(["state", "fills", "fill us (median)", "p90", "p99", "max",
                   "accept us (median)", "max"], rows)
    rows = [[i, *quantiles([s.fill_s for s in group]),
             _us(sum(made[i]) / len(made[i])), _us(max(made[i])),
             _us(pct([s.fill_s for s in group if s.position == 0], 50))]
            for i, group in sorted(by_schema.items())]
    lines += [""] + table(["schema", "fills", "fill us (median)", "p90", "p99", "max",
                           "matcher creation us (mean)", "max", "first fill us (median)"], rows)
    lines += ["", f"slowest {worst} fills:"]
    for s in sorted(steps, key=lambda s: -s.fill_s)[:worst]:
        lines.append(f"  {_us(s.fill_s)} us: schema {s.schema}, token {s.position}, "
                     f"{s.state}, after {s.before!r}")
    return lines
