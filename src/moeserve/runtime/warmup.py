"""The startup warm-up: each eager variant of the plan's warm-up list (plan/warmup.py) run once
on this rank, before the graphs are captured and before the rank reports ready, so that no
request waits for a compile. The graph captures run the CAPTURE variants themselves;
`check_captured` holds them to the list.

Every rank runs the same variants in the same order with the same per-rank token counts, so
their collectives pair up. The dummy forwards touch only the dummy request row and the dummy KV
slot (DUMMY_REQ_ROW, DUMMY_SLOT); the sampler's generator is left as it was. On a CPU the list
is not run (WarmupPlan.skipped): nothing there compiles.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from moeserve.batch.forward_batch import ForwardBatch, ForwardMode
from moeserve.batch.kv_cache import DUMMY_REQ_ROW, DUMMY_SLOT
from moeserve.batch.step import step_from_counts
from moeserve.layers.attention import PagedAttention
from moeserve.layers.mla import MLAttention
from moeserve.moe.experts.base import Experts
from moeserve.plan.warmup import CAPTURE, EAGER, Variant, WarmupPlan, sdpa_lengths
from moeserve.runtime.sampler import SamplingBatch
from moeserve.runtime.sampling import MAX_TOP_LOGPROBS, SamplingParams

log = logging.getLogger(__name__)

SAMPLING_PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "sampled": SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.1,
                                frequency_penalty=0.5, presence_penalty=0.5),
    "logprobs": SamplingParams(temperature=0.0, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS),
}


@dataclass
class WarmupReport:
    ran: Counter = field(default_factory=Counter)  # variants run, by path
    seconds: float = 0.0
    skipped: Optional[str] = None

    def line(self) -> str:
        if self.skipped:
            return f"warm-up not run: {self.skipped}"
        parts = ", ".join(f"{p} {n}" for p, n in self.ran.items())
        return f"warm-up ran {sum(self.ran.values())} variants ({parts}) in {self.seconds:.1f} s"


@torch.inference_mode()
def run_warmup(runner: Any, wplan: WarmupPlan, force: bool = False) -> WarmupReport:
    """Run every EAGER variant of `wplan` on this rank (`runner`: its ModelRunner); `force`
    runs them where the plan skips them (a CPU: tests)."""
    if wplan.skipped and not force:
        return WarmupReport(skipped=wplan.skipped)
    t0 = time.perf_counter()
    report = WarmupReport()
    generator = runner.sampler.generator.get_state()
    for v in wplan.variants:
        if v.via != EAGER or v.path == "attention.sdpa":
            continue
        RUN[v.path](runner, v)
        report.ran[v.path] += 1
    sdpa = wplan.sizes("attention.sdpa")
    if sdpa:
        report.ran["attention.sdpa"] += len(_sdpa(runner, sdpa))
    runner.sampler.generator.set_state(generator)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    report.seconds = time.perf_counter() - t0
    return report


def check_captured(wplan: WarmupPlan, decode: Sequence[int], prefill: Sequence[int]) -> None:
    """The graph runners captured exactly the list's CAPTURE sizes (nothing left out, nothing
    else); runs on every device."""
    for path, got in (("decode", decode), ("prefill", prefill)):
        want = wplan.sizes(path, CAPTURE)
        if sorted(got) != sorted(want):
            raise RuntimeError(f"the {path} graphs were captured for {sorted(got)}, but the "
                               f"warm-up list of the plan has {sorted(want)}")


# --- the dummy forwards ---------------------------------------------------------------------

def dummy_batch(runner: Any, n: int, decode: bool = False) -> ForwardBatch:
    """A forward of n dummy tokens: n decode requests, or prefills of at most a request row's
    width each, all on the dummy row, every K/V to the dummy slot."""
    table, pool = runner.req_pool.table, runner.kv_pool
    if n == 0:
        return ForwardBatch.idle(table, pool)
    width = table.shape[1]
    table[DUMMY_REQ_ROW, :min(n, width)] = DUMMY_SLOT
    lens = [1] * n if decode else [min(width, n - s) for s in range(0, n, width)]
    loc = torch.full((n,), DUMMY_SLOT, dtype=torch.int64, device=runner.device)
    return ForwardBatch.from_requests(ForwardMode.DECODE if decode else ForwardMode.EXTEND,
                                      [[0] * k for k in lens], [0] * len(lens),
                                      [DUMMY_REQ_ROW] * len(lens), loc, table, pool)


def dummy_forward(runner: Any, tokens_per_dp: Sequence[int],
                  decode_per_dp: Optional[Sequence[bool]] = None) -> None:
    """One forward on every rank: DP rank d runs tokens_per_dp[d] dummy tokens (decodes
    where decode_per_dp[d])."""
    lay, state = runner.plan.layout, runner.state
    counts = [tokens_per_dp[lay.dp_rank(r)] for r in range(lay.tp)]
    mine = lay.dp_rank(state.rank)
    decode = bool(decode_per_dp and decode_per_dp[mine])
    fb = dummy_batch(runner, tokens_per_dp[mine], decode)
    step = step_from_counts(counts, lay, state.rank, runner.plan)
    runner.model(fb.input_ids, fb.positions, fb, step)


def warm_up_prefill(runner: Any, sizes: Sequence[int]) -> list[int]:
    """Eager dummy prefills of each size on every DP rank; returns the sizes run."""
    for n in sizes:
        dummy_forward(runner, [n] * runner.plan.layout.dp)
    return list(sizes)


def _extend(runner: Any, v: Variant) -> None:
    warm_up_prefill(runner, [v.size])


def _decode(runner: Any, v: Variant) -> None:
    dp = runner.plan.layout.dp
    dummy_forward(runner, [v.size] * dp, [True] * dp)


def _dispatch(runner: Any, v: Variant) -> None:
    dp = runner.plan.layout.dp
    if "idle" in v.key:
        dummy_forward(runner, [v.size] + [0] * (dp - 1))
    elif "decode" in v.key:
        dummy_forward(runner, [v.size] + [1] * (dp - 1), [False] + [True] * (dp - 1))
    else:  # rows that do not split evenly over attn_tp
        dummy_forward(runner, [v.size] * dp)


def _moe(runner: Any, v: Variant) -> None:
    """Each distinct expert runner of the model at v.size rows, on random rows and routing."""
    seen = set()
    dev = runner.device
    for mod in runner.model.modules():
        if not isinstance(mod, Experts):
            continue
        key = (mod.num_local, mod.hidden, mod.i_local)
        if key in seen:
            continue
        seen.add(key)
        n, k = v.size, runner.spec.top_k
        x = torch.randn(n, mod.hidden, device=dev, dtype=mod.dtype)  # the rows, not fp8 weights
        ids = torch.rand(n, mod.num_experts, device=dev).topk(k, dim=1).indices
        mod(x, ids.to(torch.int32), torch.rand(n, k, device=dev))


def _sdpa(runner: Any, want: list[int]) -> list[int]:
    """The attention backend's SDPA builds, which must be the plan's lengths."""
    layer = next((m for m in runner.model.modules()
                  if isinstance(m, (PagedAttention, MLAttention))), None)
    if layer is None:
        return []
    b = runner.plan.budget
    got = layer.backend.warm_up(layer, min(b.extend, b.context_length), runner.kv_pool.dtype,
                                runner.device)
    if got != want or sdpa_lengths(runner.plan) != want:
        raise RuntimeError(f"the attention backend built SDPA for lengths {got}, but the "
                           f"warm-up list of the plan has {want}")
    return got


def _sampling(runner: Any, v: Variant) -> None:
    params = [SAMPLING_PARAMS[v.key]] * v.size
    vocab = runner.spec.vocab_size
    penalties = params[0].has_penalties
    sb = SamplingBatch.build(params, [[1, 2]] * v.size, [[3, 4]] * v.size if penalties else None,
                             vocab, runner.device)
    logits = torch.randn(v.size, vocab, device=runner.device, dtype=torch.float32)
    runner.sampler(logits, sb)


RUN = {"extend": _extend, "prefill": _extend, "decode": _decode, "dispatch": _dispatch,
       "moe": _moe, "sampling": _sampling}
