"""CUDA graphs for decode: one graph per bucket of the plan's decode batch sizes.

    graphs = DecodeGraphRunner.create(plan, model, state, bufs, kv_pool, req_pool)  # or None
    bucket = graphs.bucket_for(step.tokens_per_dp_rank, all_decode)               # or None
    logits_BV = graphs.replay(batch, bucket)

The static inputs and the logits are the plan's `graph.decode.*` records, which the binder
(runtime/buffers.py) allocates once (DecodeGraphBuffers) where the plan records them: where
decode graphs run. Bucket bs uses their first bs rows. A replay costs the host little: the
rows' tokens, positions and request rows go to the device in one copy from pinned memory
(`staging`), each graph spreads them into its inputs itself, and only the new tokens' KV slots
(already on the device) are copied beside it. Graphs are captured largest bucket
first into one shared memory pool (a smaller graph's temporaries fit in what the larger one
freed). A decode batch of B requests replays the smallest bucket >= B: rows [B, bucket) are
dummy requests (request row 0, KV slot 0, length 1), so they write only the dummy slot and
read only it; their logits are never read. Padded rows are computed as ordinary rows (the
router gives them real experts): the graph is shared by every B of its bucket, so nothing in
it may depend on B.

The choice between replay and eager is a pure function of what every rank of the engine sees
the same: the gathered token counts of the step (StepContext.tokens_per_dp_rank) and whether
every rank runs a decode or idle forward. So all ranks replay the same bucket, or all run
eagerly, and their collectives match. A rank with no requests replays the bucket with only
dummy rows. Batches above the largest bucket, prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from moeserve.kernels import ops as K
from moeserve.batch.forward_batch import ForwardBatch, ForwardMode, resolve_futures
from moeserve.batch.kv_cache import DUMMY_REQ_ROW, DUMMY_SLOT, KVCachePool, ReqToTokenPool

if TYPE_CHECKING:
    from moeserve.parallel.groups import ParallelState
    from moeserve.batch.step import StepContext
    from moeserve.plan.capacity import CapacityPlan
    from moeserve.runtime.scheduler import ScheduledBatch

log = logging.getLogger(__name__)


def choose_bucket(buckets: Sequence[int], tokens_per_dp_rank: Sequence[int], all_decode: bool,
                  tokens_per_request: int = 1) -> Optional[int]:
    """The bucket (requests per DP rank) every rank replays, or None for an eager step.
    `buckets` sorted ascending; the same inputs on every rank give the same answer."""
    if not buckets or not all_decode:
        return None
    need = -(-max(tokens_per_dp_rank, default=0) // tokens_per_request)
    if need == 0 or need > buckets[-1]:
        return None
    return buckets[bisect.bisect_left(buckets, need)]


def graph_blockers(model: torch.nn.Module, device: torch.device) -> list[str]:
    """Why this model cannot be captured (empty: it can). Depends on classes and config only,
    so every rank finds the same reasons."""
    from moeserve.layers.attention import AttentionBackend
    from moeserve.moe.dispatch.base import Dispatcher

    reasons = []
    if device.type != "cuda":
        reasons.append(f"the model runs on {device.type}, not a GPU")
    for module in model.modules():
        backend = getattr(module, "backend", None)
        if isinstance(backend, AttentionBackend) and not backend.graph_capturable:
            reasons.append(f"attention backend {type(backend).__name__} reads host lengths "
                           "(use --attention-backend triton)")
            break
    for module in model.modules():
        dispatcher = getattr(module, "dispatcher", None)
        if isinstance(dispatcher, Dispatcher) and not dispatcher.graph_safe:
            reasons.append(f"the {dispatcher.name} MoE dispatcher synchronises with the host")
            break
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, torch.nn.Module) and not getattr(experts, "graph_safe", True):
            reasons.append(f"expert runner {type(experts).__name__} synchronises with the host")
            break
    return reasons


@dataclass
class DecodeGraphBuffers:
    """Inputs and output shared by every decode graph (rows [0, bucket) of each): the plan's
    graph.decode.<field> records, from the binder. Made, every row is a dummy request."""

    input_ids: torch.Tensor  # [T_graph] int64
    positions: torch.Tensor  # [T_graph] int64
    out_cache_loc: torch.Tensor  # [T_graph] int64
    req_pool_indices: torch.Tensor  # [bs_max] int64
    seq_lens: torch.Tensor  # [bs_max] int32
    prefix_lens: torch.Tensor  # [bs_max] int32: seq_lens - 1
    extend_lens: torch.Tensor  # [bs_max] int32: ones
    logits: torch.Tensor  # [T_graph, V] float32
    staging: torch.Tensor  # [bs_max, 3] int64: each row's token, position, request row
    next_tokens: torch.Tensor  # the runner's sampled tokens of the step before (placeholders)
    # staging's rows on the host (pinned on a GPU: host memory, not the device's that the
    # plan divides), filled by stage(); and the event after the last copy from it
    host: torch.Tensor = field(init=False)
    copied: Optional[torch.cuda.Event] = field(init=False)

    def __post_init__(self) -> None:
        gpu = self.staging.device.type == "cuda"
        self.host = torch.empty(self.staging.shape, dtype=torch.int64, pin_memory=gpu)
        self.copied = torch.cuda.Event() if gpu else None
        self.extend_lens.fill_(1)
        self.pad(0, self.seq_lens.shape[0])
        self.stage([], [], [], self.seq_lens.shape[0])

    def stage(self, tokens: Sequence[int], positions: Sequence[int], rows: Sequence[int],
              bs: int) -> None:
        """Rows [0, n) from the lists, rows [n, bs) dummy requests, to `staging` in one copy.
        The host rows are rewritten only once the previous copy has read them."""
        n = len(tokens)
        if self.copied is not None:
            self.copied.synchronize()
        h = self.host.numpy()
        h[:n, 0], h[:n, 1], h[:n, 2] = tokens, positions, rows
        h[n:bs] = (0, 0, DUMMY_REQ_ROW)
        self.staging[:bs].copy_(self.host[:bs], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def unpack(self, bs: int) -> None:
        """The staged rows into the model's inputs (captured at the head of each graph)."""
        ops = K.elementwise(self.staging.device)
        if ops is not None:
            ops.unpack_decode_inputs(self.staging, self.next_tokens, self.input_ids[:bs], self.positions[:bs],
                  self.prefix_lens[:bs], self.seq_lens[:bs], self.req_pool_indices[:bs])
            return
        s = self.staging[:bs]
        self.input_ids[:bs].copy_(resolve_futures(s[:, 0], self.next_tokens))
        self.positions[:bs].copy_(s[:, 1])
        self.prefix_lens[:bs].copy_(s[:, 1])
        self.seq_lens[:bs].copy_(s[:, 1] + 1)
        self.req_pool_indices[:bs].copy_(s[:, 2])

    def pad(self, start: int, end: int) -> None:
        """Rows [start, end) become dummy requests."""
        if end <= start:
            return
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.out_cache_loc[start:end].fill_(DUMMY_SLOT)
        self.req_pool_indices[start:end].fill_(DUMMY_REQ_ROW)
        self.seq_lens[start:end].fill_(1)
        self.prefix_lens[start:end].zero_()

    def batch(self, bs: int, req_to_token: torch.Tensor, kv_pool: KVCachePool) -> ForwardBatch:
        """The decode ForwardBatch of bucket bs over these buffers (every row gets logits)."""
        return ForwardBatch(ForwardMode.DECODE, self.input_ids[:bs], self.positions[:bs],
                            self.out_cache_loc[:bs], self.req_pool_indices[:bs],
                            self.seq_lens[:bs], self.prefix_lens[:bs], self.extend_lens[:bs],
                            req_to_token, kv_pool, (1,) * bs, (0,) * bs, (1,) * bs,
                            return_all_logits=True)


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, buckets: Sequence[int], bufs: DecodeGraphBuffers,
                 kv_pool: KVCachePool, req_pool: ReqToTokenPool,
                 step_for: Callable[[int], "StepContext"]) -> None:
        self.model, self.bufs = model, bufs
        self.buckets = sorted(buckets)
        self.kv_pool, self.req_pool = kv_pool, req_pool
        self.step_for = step_for
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None
        self.replays = 0

    @classmethod
    def create(cls, plan: "CapacityPlan", model: torch.nn.Module, state: "ParallelState",
               bufs: Optional[DecodeGraphBuffers], kv_pool: KVCachePool,
               req_pool: ReqToTokenPool) -> Optional["DecodeGraphRunner"]:
        """Capture every bucket into `bufs`, or return None without them (the plan records
        decode graphs only where they run: graphs on, a GPU, a capturable attention backend;
        decode then runs eagerly). Every rank calls this, in the same order, after the model's
        buffers are bound (a capture keeps their addresses)."""
        from moeserve.batch.step import step_from_counts

        assert plan.budget is not None and plan.layout is not None
        if bufs is None:
            return None
        if plan.budget.tokens_per_decode_request != 1:
            raise ValueError("decode graphs capture one token per request; drop "
                             "--speculative-num-draft-tokens or add --disable-cuda-graph")
        blockers = graph_blockers(model, state.device)
        if blockers:
            raise RuntimeError("the plan records decode graphs, but this model cannot be "
                               f"captured: {'; '.join(blockers)} (--disable-cuda-graph)")
        layout = plan.layout

        def step_for(bs: int) -> "StepContext":
            return step_from_counts([bs] * layout.tp, layout, state.rank, plan)

        runner = cls(model, plan.budget.decode_batch_sizes, bufs, kv_pool, req_pool, step_for)
        runner.capture()
        return runner

    @torch.inference_mode()
    def capture(self) -> None:
        table = self.req_pool.table
        for bs in reversed(self.buckets):
            step = self.step_for(bs)
            warm = self.bufs.batch(bs, table, self.kv_pool)
            self.bufs.unpack(bs)
            self.model(warm.input_ids, warm.positions, warm, step)  # compile, fill caches
            # a new batch object: per-step metadata of the layers is allocated in the graph
            fb = self.bufs.batch(bs, table, self.kv_pool)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.bufs.unpack(bs)
                self.model(fb.input_ids, fb.positions, fb, step,
                           logits_out=self.bufs.logits[:bs])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        log.info("captured decode graphs for batch sizes %s", self.buckets)

    def bucket_for(self, tokens_per_dp_rank: Sequence[int], all_decode: bool) -> Optional[int]:
        return choose_bucket(self.buckets, tokens_per_dp_rank, all_decode)

    def replay(self, batch: Optional["ScheduledBatch"], bs: int) -> torch.Tensor:
        """Logits [B, V] of the batch's B requests (a view of the shared buffer: read it
        before the next replay)."""
        n = 0 if batch is None else len(batch.reqs)
        assert n <= bs and bs in self.graphs, (n, bs)
        b = self.bufs
        if n:
            assert batch is not None and batch.mode is ForwardMode.DECODE
            b.out_cache_loc[:n].copy_(batch.out_cache_loc, non_blocking=True)
            b.stage([t[0] for t in batch.new_tokens], batch.prefix_lens,
                    batch.rows, bs)
        else:
            b.stage([], [], [], bs)
        if n < bs:
            b.out_cache_loc[n:bs].fill_(DUMMY_SLOT)
        self.graphs[bs].replay()
        self.replays += 1
        return b.logits[:n]
