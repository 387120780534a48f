"""The model runner of one rank: builds the forward batch, runs the model, samples.

It executes what the scheduler decided; it decides nothing. Every static buffer (the KV pool,
the request table, the sampled tokens the next step's placeholders read (`next_tokens`), the
model's buffers and the graphs' inputs) comes from the binder (runtime/buffers.py), which
allocates the capacity plan's records before any forward. `launch` queues a step and its
sampling without waiting for the device; `collect` waits for its tokens (the overlap schedule
of runtime/worker.py runs the next launch in between); `run` is the two together. Decode
steps replay a CUDA graph of the plan's buckets when every rank of the step decodes (or idles)
and the batch fits a bucket (runtime/cuda_graph.py); the other steps that fit the plan's
prefill sizes (a decode only while decode graphs are on) replay the prefill graphs' pieces,
with their attention eager between them (runtime/prefill_graph.py); the rest run eagerly. On
a GPU, before the graphs are captured, the warm-up list of the plan runs (plan/warmup.py,
runtime/warmup.py), so that no request waits for a compile; the startup's phases are timed
(runtime/startup.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from moeserve.config import EngineConfig
from moeserve.config.spec import ModelSpec
from moeserve.kernels.launch.choice import install, select_kernels
from moeserve.parallel.groups import ParallelState
from moeserve.batch.step import StepContext
from moeserve.plan.capacity import CapacityPlan
from moeserve.runtime.buffers import bind_buffers
from moeserve.runtime.cuda_graph import DecodeGraphRunner
from moeserve.runtime.grammar import fill_bitmask
from moeserve.runtime.prefill_graph import PrefillGraphRunner
from moeserve.runtime.startup import StartupClock
from moeserve.runtime.warmup import check_captured, run_warmup
from moeserve.plan.warmup import warmup_plan
from moeserve.batch.forward_batch import ForwardBatch, resolve_futures
from moeserve.runtime.sampler import PromptLogprobs, Sampler, SamplingBatch, score_prompt
from moeserve.runtime.sampling import SamplingParams
from moeserve.runtime.scheduler import PromptLogprobRows, ScheduledBatch

log = logging.getLogger(__name__)


def device_tables(device: torch.device) -> tuple[Optional[str], Optional[tuple[int, int]]]:
    """The device's name and compute capability, which choose the MoE tile tables."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)

@dataclass
class StepResult:
    token_ids: list[int]  # one per request of the batch (-1 where it did not sample)
    logprobs: Optional[list[Optional[dict[str, Any]]]]
    # per request of the batch, its prompt tokens scored this step (None: no request asked)
    prompt_logprobs: Optional[list[list[dict[str, Any]]]] = None
    failed: dict[int, str] = field(default_factory=dict)  # batch row -> why it failed alone


@dataclass
class LaunchedStep:
    """A step whose sampled tokens are on their way to the host (`collect` reads them)."""

    batch: ScheduledBatch
    rows: list[int]  # the batch's rows that sampled, in the order of the tensors below
    token_ids: torch.Tensor  # [S] int64 on the host, filled once `done` has passed
    logprobs: Optional[torch.Tensor]
    top_logprobs: Optional[torch.Tensor]
    top_token_ids: Optional[torch.Tensor]
    done: Optional[torch.cuda.Event]  # None on a CPU: the copies are done already
    prompt: Optional[PromptLogprobs] = None  # on the host, filled once `done` has passed
    failed: dict[int, str] = field(default_factory=dict)  # batch row -> why it failed alone


def copy_to_host(tensors: list[Optional[torch.Tensor]], device: torch.device
                 ) -> tuple[list[Optional[torch.Tensor]], Optional[torch.cuda.Event]]:
    """Each tensor's copy to the host, queued without waiting, and on a GPU the event to wait
    for before reading them: recorded after the copies (an event recorded before them would
    let the host read the pinned tensors before the copies have landed)."""
    copies = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
    done = None
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
    return copies, done


class ModelRunner:
    def __init__(self, cfg: EngineConfig, spec: ModelSpec, plan: CapacityPlan,
                 state: ParallelState, *, progress: Optional[bool] = None,
                 report: Optional[Callable[[str, float, str], None]] = None) -> None:
        """report(phase, seconds, detail): called as each startup phase ends
        (runtime/startup.py)."""
        from moeserve.models.build import load_model

        self.cfg, self.spec, self.plan, self.state = cfg, spec, plan, state
        self.device = state.device
        self.kernels = select_kernels(self.device, pdl=not cfg.disable_pdl)
        install(self.kernels)
        log.info("kernels %s", self.kernels.describe())
        self.clock = StartupClock(report)
        with self.clock.phase("weights"):
            self.model = load_model(cfg, spec, state, plan, progress=progress)
        with self.clock.phase("plan buffers") as note:
            self.buffers = bind_buffers(plan, self.device)
            self.model.bind_buffers(self.buffers.model)
            note["detail"] = f"{len(plan.buffers)} records"
        self.kv_pool, self.req_pool = self.buffers.kv_pool, self.buffers.req_pool
        # the sampled tokens of the last step, which the next step's placeholders point into
        self.next_tokens = self.buffers.next_tokens
        self.sampler = Sampler(self.device, seed=cfg.random_seed)
        self.warmup_plan = warmup_plan(plan, *device_tables(self.device))
        with self.clock.phase("warm-up compile") as note:
            self.warmup = run_warmup(self, self.warmup_plan)
            note["detail"] = f"{self.warmup.line()}; the list: {self.warmup_plan.summary()}"
        blocker = plan.backends.graph_blocker if plan.backends is not None else None
        if blocker and self.device.type == "cuda" and (plan.budget.decode_batch_sizes
                                                       or plan.budget.prefill_token_sizes):
            log.warning("steps run without CUDA graphs: %s (--disable-cuda-graph and "
                        "--disable-piecewise-cuda-graph silence this)", blocker)
        with self.clock.phase("graph capture") as note:
            self.graphs: Optional[DecodeGraphRunner] = DecodeGraphRunner.create(
                plan, self.model, state, self.buffers.decode_graph, self.kv_pool,
                self.req_pool)
            self.prefill_graphs: Optional[PrefillGraphRunner] = PrefillGraphRunner.create(
                plan, self.model, state, self.buffers.prefill_graph, self.kv_pool,
                self.req_pool, self.next_tokens)
            decode = [] if self.graphs is None else self.graphs.buckets
            prefill = [] if self.prefill_graphs is None else self.prefill_graphs.sizes
            check_captured(self.warmup_plan, decode, prefill)
            note["detail"] = f"{len(decode)} decode and {len(prefill)} prefill sizes"

    def forward_batch(self, batch: Optional[ScheduledBatch]) -> ForwardBatch:
        if batch is None:
            return ForwardBatch.idle(self.req_pool.table, self.kv_pool)
        scored = batch.prompt_logprobs
        return ForwardBatch.from_requests(
            batch.mode, batch.new_tokens, batch.prefix_lens, batch.rows,
            batch.out_cache_loc, self.req_pool.table, self.kv_pool,
            extra_logit_rows=scored.rows if scored is not None else ())

    @torch.inference_mode()
    def forward(self, batch: Optional[ScheduledBatch], step: StepContext,
                all_decode: bool = False) -> torch.Tensor:
        """Logits of the batch's sampling rows: a decode graph replay when `all_decode`
        (every rank of the step decodes or idles, the same flag on every rank) and the step
        fits a bucket; else the prefill graphs' pieces if the step fits one of their sizes
        (a prefill anywhere, or a decode above the largest bucket: its eager launch would
        bind it to the host; without decode graphs a decode runs eagerly); else an eager
        forward."""
        bucket = (None if self.graphs is None
                  else self.graphs.bucket_for(step.tokens_per_dp_rank, all_decode))
        if bucket is not None:
            return self.graphs.replay(batch, bucket)
        fb = self.forward_batch(batch)
        size = (None if self.prefill_graphs is None or (all_decode and self.graphs is None)
                else self.prefill_graphs.size_for(step.tokens_per_dp_rank))
        if size is not None:
            return self.prefill_graphs.replay(fb, size)
        if batch is not None and batch.has_futures:
            fb.input_ids = resolve_futures(fb.input_ids, self.next_tokens)
        return self.model(fb.input_ids, fb.positions, fb, step)

    @torch.inference_mode()
    def run(self, batch: Optional[ScheduledBatch], step: StepContext,
            all_decode: bool = False) -> Optional[StepResult]:
        """One forward of this rank (an idle one when `batch` is None: the rank still joins
        every collective of the step), then sampling for the requests that finished their
        prefill or decode; waits for the tokens."""
        launched = self.launch(batch, step, all_decode)
        return None if launched is None else self.collect(launched)

    @torch.inference_mode()
    def launch(self, batch: Optional[ScheduledBatch], step: StepContext,
               all_decode: bool = False) -> Optional[LaunchedStep]:
        """`run` without the wait: the forward and the sampling are queued on the device, the
        sampled tokens land in `next_tokens` (for the next step's placeholders) and start
        their copy to the host. Nothing here waits for the device."""
        forwarded = self.launch_forward(batch, step, all_decode)
        return None if forwarded is None else self.launch_sampling(*forwarded)

    @torch.inference_mode()
    def launch_forward(self, batch: Optional[ScheduledBatch], step: StepContext,
                       all_decode: bool = False
                       ) -> Optional[tuple[ScheduledBatch, torch.Tensor]]:
        """The first half of `launch`: the forward, queued; (batch, its logits), or None for
        an idle rank. The worker may process the step before this one in between (the
        grammars of this batch need its tokens)."""
        logits_BV = self.forward(batch, step, all_decode)
        return None if batch is None else (batch, logits_BV)

    @torch.inference_mode()
    def launch_sampling(self, batch: ScheduledBatch, logits_BV: torch.Tensor) -> LaunchedStep:
        """The second half of `launch`: sampling queued after the forward; a request with a
        grammar has its matcher fill its row of the token bitmask here, on the host, while
        the device runs the forward."""
        prompt = None
        if batch.prompt_logprobs is not None:  # their logits follow those of the B requests
            B, scored = len(batch.reqs), batch.prompt_logprobs
            targets = torch.tensor(scored.targets).to(self.device, non_blocking=True)
            prompt = score_prompt(logits_BV[B:], targets, scored.top)
            logits_BV = logits_BV[:B]
            copies, _ = copy_to_host([prompt.logprobs_R, prompt.ranks_R,
                                      prompt.top_logprobs_RN, prompt.top_token_ids_RN],
                                     self.device)
            prompt = PromptLogprobs(*copies)
        rows = [i for i, s in enumerate(batch.samples) if s]
        if not rows:
            _, done = copy_to_host([], self.device)
            return LaunchedStep(batch, rows, torch.zeros(0, dtype=torch.int64), None, None,
                                None, done, prompt)
        reqs = [batch.reqs[i] for i in rows]
        # a request whose own sampling inputs fail (its grammar, its bans, its parameters) is
        # failed alone: its row samples with neutral inputs, and the token is dropped
        failed: dict[int, str] = {}
        try:
            banned = [r.stop.banned(r.num_output - 1) for r in reqs]
        except Exception:  # find the requests whose bans fail
            banned = [_own(r, lambda r=r: r.stop.banned(r.num_output - 1), failed, i,
                           frozenset()) for i, r in zip(rows, reqs)]
        bitmask = _bitmask(reqs, rows, logits_BV.shape[-1], self.device.type == "cuda", failed)
        vocab = logits_BV.shape[-1]
        # the step's own token is counted in num_output already; a decode row's placeholder is
        # its token of the step before, still on the device (one that the worker has
        # processed since is in output_ids already)
        steps = [r.num_output - 1 for r in reqs]
        pending = [-1 - batch.new_tokens[i][0]
                   if batch.new_tokens[i][0] < 0 and batch.reqs[i].unresolved > 1 else -1
                   for i in rows]

        def build(params: list[SamplingParams], ban: list) -> SamplingBatch:
            penalised = any(p.repetition_penalty != 1.0 for p in params)
            return SamplingBatch.build(
                params, [r.output_ids for r in reqs],
                [r.prompt_ids for r in reqs] if penalised else None, vocab, self.device,
                steps=steps, pending=pending, next_tokens=self.next_tokens,
                token_bitmask=bitmask, banned=ban)

        params = [NEUTRAL if i in failed else r.params for i, r in zip(rows, reqs)]
        try:
            sb = build(params, banned)
        except Exception:  # find the requests whose parameters fail, and leave them out
            for j, (i, r) in enumerate(zip(rows, reqs)):
                _own(r, lambda j=j: SamplingBatch.build(
                    [params[j]], [r.output_ids], [r.prompt_ids], vocab, "cpu",
                    banned=[banned[j]]), failed, i, None)
            sb = build([NEUTRAL if i in failed else p for i, p in zip(rows, params)],
                       [frozenset() if i in failed else b for i, b in zip(rows, banned)])
        if len(rows) < logits_BV.shape[0]:  # (a decode step: every row samples, no copy)
            logits_BV = logits_BV[torch.tensor(rows).to(logits_BV.device, non_blocking=True)]
        out = self.sampler(logits_BV, sb)
        self.next_tokens[:len(rows)].copy_(out.token_ids_B)

        copies, done = copy_to_host([out.token_ids_B, out.logprobs_B, out.top_logprobs_BN,
                                     out.top_token_ids_BN], self.device)
        return LaunchedStep(batch, rows, *copies, done, prompt, failed)

    def collect(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens and give them per request of its batch."""
        if launched.done is not None:
            launched.done.synchronize()
        batch, rows = launched.batch, launched.rows
        tokens = [-1] * len(batch.reqs)
        logprobs: Optional[list[Optional[dict[str, Any]]]] = None
        sampled = launched.token_ids.tolist()
        if launched.logprobs is not None:
            logprobs = [None] * len(batch.reqs)
            chosen = launched.logprobs.tolist()
            top_lp = (launched.top_logprobs.tolist() if launched.top_logprobs is not None
                      else None)
            top_id = (launched.top_token_ids.tolist() if launched.top_token_ids is not None
                      else None)
        for j, i in enumerate(rows):
            tokens[i] = sampled[j]
            params = batch.reqs[i].params
            if logprobs is not None and params.logprobs:
                n = params.top_logprobs
                logprobs[i] = {"token_id": sampled[j], "logprob": chosen[j],
                               "top": list(zip(top_id[j][:n], top_lp[j][:n])) if n else []}
        scored = batch.prompt_logprobs
        entries = (None if launched.prompt is None or scored is None
                   else _prompt_entries(batch, scored, launched.prompt))
        return StepResult(tokens, logprobs, entries, launched.failed)


NEUTRAL = SamplingParams()  # what a failed request's row samples with (its token is dropped)


def _own(req: Any, make: Any, failed: dict[int, str], row: int, fallback: Any) -> Any:
    """make(), or `fallback` with the request's row in `failed` when it raises (the
    traceback goes to the log under the request's id)."""
    try:
        return make()
    except Exception as exc:
        log.exception("request %s: its sampling inputs failed", req.rid)
        failed[row] = f"sampling failed: {type(exc).__name__}: {exc}"
        return fallback


def _bitmask(reqs: list[Any], rows: list[int], vocab: int, pin: bool,
             failed: dict[int, str]) -> Optional[torch.Tensor]:
    """The grammars' token bitmask of the sampling rows (grammar.fill_bitmask); a matcher
    that raises fails its request alone, whose row then allows every token."""
    matchers = [None if i in failed else r.matcher for i, r in zip(rows, reqs)]
    try:
        return fill_bitmask(matchers, vocab, pin=pin)
    except Exception:
        for i, r, m in zip(rows, reqs, matchers):
            if m is not None:
                _own(r, lambda m=m: fill_bitmask([m], vocab), failed, i, None)
        return fill_bitmask([None if i in failed else m for i, m in zip(rows, matchers)],
                            vocab, pin=pin)


def _prompt_entries(batch: ScheduledBatch, scored: PromptLogprobRows,
                    prompt: PromptLogprobs) -> list[list[dict[str, Any]]]:
    """The scored prompt tokens of each request of the batch, each with its own number of top
    tokens."""
    lps, ranks = prompt.logprobs_R.tolist(), prompt.ranks_R.tolist()
    top_lp = prompt.top_logprobs_RN.tolist() if prompt.top_logprobs_RN is not None else None
    top_id = prompt.top_token_ids_RN.tolist() if prompt.top_token_ids_RN is not None else None
    out: list[list[dict[str, Any]]] = []
    j = 0
    for req, count in zip(batch.reqs, scored.counts):
        n = req.params.prompt_logprobs or 0
        out.append([{"token_id": scored.targets[k], "logprob": lps[k], "rank": ranks[k],
                     "top": list(zip(top_id[k][:n], top_lp[k][:n])) if n else []}
                    for k in range(j, j + count)])
        j += count
    return out

