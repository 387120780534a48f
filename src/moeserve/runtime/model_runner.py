"""The model runner of one rank: builds the forward batch, runs the model, samples.

It executes what the scheduler decided; it decides nothing. Every static buffer (the KV pool,
the request table, the sampled tokens the next step's placeholders read (`next_tokens`), the
model's buffers and the graphs' inputs) comes from the binder (runtime/buffers.py), which
allocates the capacity plan's records before any forward. `launch` queues a step and its
sampling without waiting for the device; `collect` waits for its tokens (the overlap schedule
of runtime/worker.py runs the next launch in between); `run` is the two together. Decode
steps replay a CUDA graph of the plan's buckets when every rank of the step decodes (or idles)
and the batch fits a bucket (runtime/cuda_graph.py); the other steps that fit the plan's
prefill sizes replay the prefill graphs' pieces, with their attention eager between them
(runtime/prefill_graph.py); the rest run eagerly. On a GPU, before the graphs are captured,
the expert runners compile their kernels for every step size the plan admits and dummy
prefills compile the rest of the prefill path, so that no request waits for a compile.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from moeserve.config import EngineConfig
from moeserve.layers.attention import PagedAttention
from moeserve.layers.mla import MLAttention
from moeserve.moe.experts.base import Experts
from moeserve.config.spec import ModelSpec
from moeserve.kernels.launch.choice import install, select_kernels
from moeserve.parallel.groups import ParallelState
from moeserve.batch.step import StepContext
from moeserve.plan.capacity import CapacityPlan
from moeserve.runtime.buffers import bind_buffers
from moeserve.runtime.cuda_graph import DecodeGraphRunner
from moeserve.runtime.grammar import fill_bitmask
from moeserve.runtime.prefill_graph import PrefillGraphRunner
from moeserve.batch.forward_batch import ForwardBatch, ForwardMode, resolve_futures
from moeserve.batch.kv_cache import DUMMY_REQ_ROW, DUMMY_SLOT
from moeserve.runtime.sampler import Sampler, SamplingBatch
from moeserve.runtime.scheduler import ScheduledBatch

log = logging.getLogger(__name__)
PREFILL_WARM_UP_MAX = 1024  # past 2 x ROPE_PROGRAMS (kernels/elementwise/fused.py): one head block

@dataclass
class StepResult:
    token_ids: list[int]  # one per request of the batch (-1 where it did not sample)
    logprobs: Optional[list[Optional[dict[str, Any]]]]


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
                 state: ParallelState, *, progress: Optional[bool] = None) -> None:
        from moeserve.models.build import load_model

        self.cfg, self.spec, self.plan, self.state = cfg, spec, plan, state
        self.device = state.device
        self.kernels = select_kernels(self.device, pdl=not cfg.disable_pdl)
        install(self.kernels)
        log.info("kernels %s", self.kernels.describe())
        self.model = load_model(cfg, spec, state, plan, progress=progress)
        self.buffers = bind_buffers(plan, self.device)
        self.model.bind_buffers(self.buffers.model)
        self.kv_pool, self.req_pool = self.buffers.kv_pool, self.buffers.req_pool
        # the sampled tokens of the last step, which the next step's placeholders point into
        self.next_tokens = self.buffers.next_tokens
        self.sampler = Sampler(self.device, seed=cfg.random_seed)
        if self.device.type == "cuda":
            self.warm_up_experts()
            self.warm_up_prefill()
            self.warm_up_attention()
        blocker = plan.backends.graph_blocker if plan.backends is not None else None
        if blocker and self.device.type == "cuda" and (plan.budget.decode_batch_sizes
                                                       or plan.budget.prefill_token_sizes):
            log.warning("steps run without CUDA graphs: %s (--disable-cuda-graph and "
                        "--disable-piecewise-cuda-graph silence this)", blocker)
        self.graphs: Optional[DecodeGraphRunner] = DecodeGraphRunner.create(
            plan, self.model, state, self.buffers.decode_graph, self.kv_pool, self.req_pool)
        self.prefill_graphs: Optional[PrefillGraphRunner] = PrefillGraphRunner.create(
            plan, self.model, state, self.buffers.prefill_graph, self.kv_pool, self.req_pool,
            self.next_tokens)

    @torch.inference_mode()
    def warm_up_attention(self) -> list[int]:
        """The attention backend's per-shape builds for extends of up to the plan's extend
        budget (AttentionBackend.warm_up). Returns the lengths run."""
        layer = next((m for m in self.model.modules()
                      if isinstance(m, (PagedAttention, MLAttention))), None)
        if layer is None or self.plan.budget is None:
            return []
        t0 = time.perf_counter()
        lengths = layer.backend.warm_up(layer, self.plan.budget.extend, self.kv_pool.dtype,
                                        self.device)
        if lengths:
            log.info("attention warmed up for %d extend lengths (%d-%d) in %.1f s",
                     len(lengths), lengths[0], lengths[-1], time.perf_counter() - t0)
        return lengths

    @torch.inference_mode()
    def warm_up_experts(self) -> dict[tuple[int, int, int], list[int]]:
        """Each distinct expert runner (local experts, hidden, intermediate) runs once per
        tile config that a step of up to the plan's runner rows takes (Experts.warm_up).
        Returns the row counts run by runner shape."""
        plan = self.plan
        if plan.budget is None or plan.layout is None or not self.spec.num_experts:
            return {}
        rows = plan.moe_runner_rows
        t0 = time.perf_counter()
        runs: dict[tuple[int, int, int], list[int]] = {}
        for mod in self.model.modules():
            key = (mod.num_local, mod.hidden, mod.i_local) if isinstance(mod, Experts) else None
            if key is not None and key not in runs:
                runs[key] = mod.warm_up(rows, self.device)
        if any(runs.values()):
            log.info("expert kernels warmed up for row counts %s in %.1f s",
                     sorted({n for v in runs.values() for n in v}), time.perf_counter() - t0)
        return runs

    @torch.inference_mode()
    def warm_up_prefill(self, sizes: Optional[list[int]] = None) -> list[int]:
        """Eager prefills of one dummy request (row DUMMY_REQ_ROW, every K/V to DUMMY_SLOT,
        nothing else touched) of each size. By default, as far as the budget allows, every
        power of two up to PREFILL_WARM_UP_MAX tokens (the kernels that pick a shape by the
        token count pick it by powers of two: the rope's head blocks) and 127 (Triton
        specialises integer arguments on divisibility by 16). Every rank runs the same sizes
        in the same order, so their collectives pair up. Returns the sizes run."""
        from moeserve.batch.step import step_from_counts

        plan, table = self.plan, self.req_pool.table
        if plan.budget is None or plan.layout is None:
            return []
        limit = min(plan.budget.extend, table.shape[1])
        if sizes is None:
            top = min(limit, PREFILL_WARM_UP_MAX)
            sizes = sorted({1 << b for b in range(top.bit_length())} | {min(127, top)})
        for n in sizes:
            table[DUMMY_REQ_ROW, :n] = DUMMY_SLOT
            loc = torch.full((n,), DUMMY_SLOT, dtype=torch.int64, device=self.device)
            fb = ForwardBatch.from_requests(ForwardMode.EXTEND, [[0] * n], [0], [DUMMY_REQ_ROW],
                                            loc, table, self.kv_pool)
            step = step_from_counts([n] * plan.layout.tp, plan.layout, self.state.rank, plan)
            self.model(fb.input_ids, fb.positions, fb, step)
        return sizes

    def forward_batch(self, batch: Optional[ScheduledBatch]) -> ForwardBatch:
        if batch is None:
            return ForwardBatch.idle(self.req_pool.table, self.kv_pool)
        return ForwardBatch.from_requests(
            batch.mode, batch.new_tokens, batch.prefix_lens, [r.row for r in batch.reqs],
            batch.out_cache_loc, self.req_pool.table, self.kv_pool)

    @torch.inference_mode()
    def forward(self, batch: Optional[ScheduledBatch], step: StepContext,
                all_decode: bool = False) -> torch.Tensor:
        """Logits of the batch's sampling rows: a decode graph replay when `all_decode`
        (every rank of the step decodes or idles, the same flag on every rank) and the step
        fits a bucket; else, when some rank prefills, the prefill graphs' pieces if the step
        fits one of their sizes; else an eager forward."""
        bucket = (None if self.graphs is None
                  else self.graphs.bucket_for(step.tokens_per_dp_rank, all_decode))
        if bucket is not None:
            return self.graphs.replay(batch, bucket)
        fb = self.forward_batch(batch)
        size = (None if self.prefill_graphs is None or all_decode
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
        rows = [i for i, s in enumerate(batch.samples) if s]
        if not rows:
            return LaunchedStep(batch, rows, torch.zeros(0, dtype=torch.int64), None, None,
                                None, None)
        reqs = [batch.reqs[i] for i in rows]
        params = [r.params for r in reqs]
        sb = SamplingBatch.build(
            params, [r.output_ids for r in reqs],
            [r.prompt_ids for r in reqs] if any(p.repetition_penalty != 1.0 for p in params)
            else None, logits_BV.shape[-1], self.device,
            # the step's own token is counted in num_output already
            steps=[r.num_output - 1 for r in reqs],
            # a decode row's placeholder: its token of the step before, still on the device
            # (one that the worker has processed since is in output_ids already)
            pending=[-1 - batch.new_tokens[i][0]
                     if batch.new_tokens[i][0] < 0 and batch.reqs[i].unresolved > 1 else -1
                     for i in rows], next_tokens=self.next_tokens,
            token_bitmask=fill_bitmask([r.matcher for r in reqs], logits_BV.shape[-1],
                                       pin=self.device.type == "cuda"))
        if len(rows) < logits_BV.shape[0]:  # (a decode step: every row samples, no copy)
            logits_BV = logits_BV[torch.tensor(rows).to(logits_BV.device, non_blocking=True)]
        out = self.sampler(logits_BV, sb)
        self.next_tokens[:len(rows)].copy_(out.token_ids_B)

        copies, done = copy_to_host([out.token_ids_B, out.logprobs_B, out.top_logprobs_BN,
                                     out.top_token_ids_BN], self.device)
        return LaunchedStep(batch, rows, *copies, done)

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
        return StepResult(tokens, logprobs)

