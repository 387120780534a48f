"""`moeserve bench`: offline throughput of an Engine, with TTFT and ITL percentiles."""

from __future__ import annotations

import collections
import queue
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from tqdm.auto import tqdm

from moeserve.runtime.grammar import GrammarSpec
from moeserve.runtime.request import TokenOutput
from moeserve.runtime.sampling import SamplingParams


@dataclass
class RequestTiming:
    prompt_tokens: int
    output_tokens: int = 0
    ttft: Optional[float] = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: Optional[str] = None
    finish_reason: Optional[str] = None


def random_prompts(num: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(num)]


class _Recorder:
    """One request's timings, taken as the engine hands each output over (on its output
    thread: Engine.submit's on_output); `ended` gets the request's index when it ends."""

    def __init__(self, index: int, prompt_tokens: int, ended: "queue.SimpleQueue[int]"):
        self.index, self.ended = index, ended
        self.timing = RequestTiming(prompt_tokens)
        self.start = self.last = time.perf_counter()

    def __call__(self, out: TokenOutput) -> None:
        now = time.perf_counter()
        t, n = self.timing, len(out.token_ids)
        if out.error is not None:
            t.error = out.error
        else:
            if n:
                if t.ttft is None:
                    t.ttft = now - self.start
                else:
                    # a chunk of n tokens after `now - last`: n gaps of equal share
                    t.itl += [(now - self.last) / n] * n
                t.output_tokens += n
                self.last = now
            if out.finish is not None:
                t.finish_reason = out.finish.reason
        if out.finish is not None or out.error is not None:
            t.latency = now - self.start
            self.ended.put(self.index)

    def failed(self, exc: Exception) -> None:
        """submit raised: the request ends with that error."""
        self.timing.error = f"{type(exc).__name__}: {exc}"
        self.ended.put(self.index)


def run_bench(engine: Any, prompts: Sequence[Sequence[int]], output_len: int | Sequence[int],
              max_concurrency: int, progress: bool = True,
              grammars: Optional[Sequence[Optional[GrammarSpec]]] = None,
              **penalties: float) -> dict[str, Any]:
    """Greedy, ignore_eos; `output_len`: the most output tokens of every request, or of each
    (one per prompt); `grammars`: one output constraint (or None) per prompt, whose end ends
    its request; `penalties`: repetition/frequency/presence_penalty for every request
    (SamplingParams' names).

    Each request's outputs are timed by a callback on the engine's output thread as it hands
    them over (Engine.submit's on_output), and this thread only submits the next request when
    one ends: no thread waits on each request, since waking one of a thousand threads for
    every token would make the bench's own process the bound at high concurrency."""
    if grammars is not None and len(grammars) != len(prompts):
        raise ValueError(f"{len(grammars)} grammars for {len(prompts)} prompts: give one "
                         "(or None) per prompt")
    lens = [output_len] * len(prompts) if isinstance(output_len, int) else list(output_len)
    if len(lens) != len(prompts):
        raise ValueError(f"{len(lens)} output lengths for {len(prompts)} prompts: give one "
                         "for all or one per prompt")
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **penalties)
              for n in sorted(set(lens))]
    by_len = {p.max_new_tokens: p for p in params}
    recorders: list[_Recorder] = []
    ended: "queue.SimpleQueue[int]" = queue.SimpleQueue()
    bar = tqdm(total=len(prompts), desc="bench", unit="req", disable=not progress)

    def submit_next() -> None:
        i = len(recorders)
        if i == len(prompts):
            return
        rec = _Recorder(i, len(prompts[i]), ended)
        recorders.append(rec)
        try:
            engine.submit(list(prompts[i]), by_len[lens[i]], stream=True,
                          grammar=None if grammars is None else grammars[i], on_output=rec)
        except Exception as exc:  # the engine stopped, or refused the prompt
            rec.failed(exc)

    start = time.perf_counter()
    for _ in range(max(1, min(max_concurrency, len(prompts)))):
        submit_next()
    for _ in range(len(prompts)):
        ended.get()
        bar.update(1)
        submit_next()
    duration = time.perf_counter() - start
    bar.close()
    return summarize([r.timing for r in recorders], duration, max_concurrency)


def _pct(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k] * 1000.0


def summarize(timings: list[RequestTiming], duration: float, concurrency: int) -> dict[str, Any]:
    ok = [t for t in timings if t.error is None]
    ttft = [t.ttft for t in ok if t.ttft is not None]
    itl = [x for t in ok for x in t.itl]
    lat = [t.latency for t in ok]
    n_in = sum(t.prompt_tokens for t in ok)
    n_out = sum(t.output_tokens for t in ok)
    return {
        "num_prompts": len(timings), "completed": len(ok),
        "errors": [t.error for t in timings if t.error is not None][:5],
        "max_concurrency": concurrency, "duration_s": duration,
        "finish_reasons": dict(collections.Counter(t.finish_reason for t in ok)),
        "input_tokens": n_in, "output_tokens": n_out,
        # in the order of the prompts (0 for a failed request)
        "request_output_tokens": [t.output_tokens if t.error is None else 0 for t in timings],
        "input_tokens_per_s": n_in / duration if duration else 0.0,
        "output_tokens_per_s": n_out / duration if duration else 0.0,
        "request_throughput": len(ok) / duration if duration else 0.0,
        **{f"ttft_ms_p{q}": _pct(ttft, q) for q in (50, 90, 99)},
        **{f"itl_ms_p{q}": _pct(itl, q) for q in (50, 90, 99)},
        "mean_ttft_ms": statistics.fmean(ttft) * 1000 if ttft else None,
        "mean_itl_ms": statistics.fmean(itl) * 1000 if itl else None,
        "mean_e2e_ms": statistics.fmean(lat) * 1000 if lat else None,
    }


def format_summary(s: dict[str, Any]) -> str:
    def ms(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = [
        f"requests: {s['completed']}/{s['num_prompts']} completed at max concurrency "
        f"{s['max_concurrency']} in {s['duration_s']:.2f} s",
        f"input tokens: {s['input_tokens']} ({s['input_tokens_per_s']:.1f} tok/s)",
        f"output tokens: {s['output_tokens']} ({s['output_tokens_per_s']:.1f} tok/s)",
        f"TTFT ms: p50 {ms(s['ttft_ms_p50'])}  p90 {ms(s['ttft_ms_p90'])}  "
        f"p99 {ms(s['ttft_ms_p99'])}",
        f"ITL ms:  p50 {ms(s['itl_ms_p50'])}  p90 {ms(s['itl_ms_p90'])}  "
        f"p99 {ms(s['itl_ms_p99'])}",
    ]
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    return "\n".join(lines)
