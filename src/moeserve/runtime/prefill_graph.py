"""CUDA graphs for the forwards that decode graphs do not take (prefills, mixed batches, decode
batches above the largest decode bucket), cut at each attention: "piecewise" graphs, one set
per token count of the plan's prefill sizes.

    graphs = PrefillGraphRunner.create(plan, model, state, bufs, kv_pool, req_pool,
                                       next_tokens)                                # or None
    size = graphs.size_for(step.tokens_per_dp_rank)                                # or None
    logits_RV = graphs.replay(fb, size)

Why: an eager prefill is bound by its host. For one request of 256 tokens (Qwen3-30B-A3B
shape) the host takes as long to launch its ~2800 kernels and ops as the device takes to run
them (`python -m benchmarks e2e --prefill-tokens 256` times one prefill). A replay launches a graph per piece and one attention
kernel between pieces.

A forward of T tokens is captured as L + 1 pieces (L layers): piece 0 runs from the embedding
to layer 0's attention, piece i from layer i-1's attention output to layer i's attention, and
piece L to the last layer's output (model.hidden_states). Everything in the pieces (norms,
projections, rope and KV store, the MoE layer and its collectives) depends on the token count
alone. The attention between them depends on the requests' lengths: it runs eagerly, reading
each layer's query from the static `graph.prefill.q` (the piece before copies it there) and
writing `graph.prefill.attn_out` (the piece after reads it); the binder (runtime/buffers.py)
allocates them and the inputs (PrefillGraphBuffers) where the plan records them. So one capture per token count
serves any mix of requests, cached prefixes and decode rows, in any forward mode. The final
norm and LM head run eagerly on the rows that get logits.

Rows [n, T) of a replay are padding: token 0, position 0, K/V written to DUMMY_SLOT. No
attention writes their output rows, which hold zeros from the start or what an earlier replay
left there (finite values), and their logits are never read. The tokens' placeholders of the
overlap schedule are resolved inside piece 0, from `next_tokens`.

The size of a step (the smallest captured size >= the largest DP rank's token count, taken
only when no decode graph takes the step) is a pure function of what every rank of the engine
sees the same, so all ranks replay the same pieces and their collectives match. A rank with no
requests replays them with padding only and runs no attention.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from moeserve.runtime.cuda_graph import graph_blockers
from moeserve.batch.forward_batch import ForwardBatch, ForwardMode, resolve_futures
from moeserve.batch.kv_cache import DUMMY_REQ_ROW, DUMMY_SLOT, KVCachePool, ReqToTokenPool

if TYPE_CHECKING:
    from moeserve.layers.attention import PagedAttention
    from moeserve.layers.mla import MLAttention

    AttentionLayer = PagedAttention | MLAttention  # what a forward is cut at
    from moeserve.parallel.groups import ParallelState
    from moeserve.batch.step import StepContext
    from moeserve.plan.capacity import CapacityPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PrefillGraphBuffers:
    """The plan's graph.prefill.* records (the binder's); a size t uses the first t rows."""

    inputs: torch.Tensor  # [3, T_max] int64: token (or placeholder), position, KV slot
    q: torch.Tensor  # [T_max, N, D]: each attention's query, across the cut before it
    attn_out: torch.Tensor  # [T_max, N, D']: its output, across the cut after it (zeroed)


def choose_size(sizes: Sequence[int], tokens_per_dp_rank: Sequence[int]) -> Optional[int]:
    """The captured token count every rank replays, or None for an eager forward. `sizes`
    sorted ascending; the same inputs on every rank give the same answer."""
    need = max(tokens_per_dp_rank, default=0)
    if not sizes or need == 0 or need > sizes[-1]:
        return None
    return sizes[bisect.bisect_left(sizes, need)]


class _Pieces:
    """The capture of one token count: ends a graph and begins the next at each attention."""

    def __init__(self, runner: "PrefillGraphRunner", size: int) -> None:
        self.runner, self.size = runner, size
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.layers: list["AttentionLayer"] = []
        self.hidden: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None
        self._open: Optional[torch.cuda.CUDAGraph] = None

    def begin(self) -> None:
        self._open = torch.cuda.CUDAGraph()
        self._open.capture_begin(pool=self.runner.pool, capture_error_mode="thread_local")

    def end(self) -> None:
        assert self._open is not None
        self._open.capture_end()
        self.graphs.append(self._open)
        self._open = None

    def skip(self, q_TND: torch.Tensor, layer: "AttentionLayer", fb: ForwardBatch
             ) -> torch.Tensor:
        """The attention hook of the eager warm-up: what `cut` launches, no cut."""
        self.runner.q[:self.size].copy_(q_TND)
        return self.runner.attn_out[:self.size]

    def cut(self, q_TND: torch.Tensor, layer: "AttentionLayer", fb: ForwardBatch
            ) -> torch.Tensor:
        """The attention hook while capturing: the query to its static buffer (the last op of
        this piece), a new piece, and the static output buffer as the attention's output."""
        out = self.skip(q_TND, layer, fb)
        self.end()
        self.layers.append(layer)
        self.begin()
        return out


class PrefillGraphRunner:
    def __init__(self, model: torch.nn.Module, sizes: Sequence[int], bufs: PrefillGraphBuffers,
                 next_tokens: torch.Tensor, kv_pool: KVCachePool, req_pool: ReqToTokenPool,
                 step_for: Callable[[int], "StepContext"]) -> None:
        self.model, self.sizes = model, sorted(sizes)
        self.inputs = bufs.inputs  # [3, T_max] int64: token (or placeholder), position, slot
        self.q, self.attn_out = bufs.q, bufs.attn_out  # [T_max, N, D], what crosses each cut
        self.next_tokens = next_tokens
        self.kv_pool, self.req_pool = kv_pool, req_pool
        self.step_for = step_for
        self.pieces: dict[int, _Pieces] = {}
        self.pool: Any = None
        self.pool_bytes = 0  # what the allocator reserved while capturing (measured)
        self.replays = 0

    @classmethod
    def create(cls, plan: "CapacityPlan", model: torch.nn.Module, state: "ParallelState",
               bufs: Optional[PrefillGraphBuffers], kv_pool: KVCachePool,
               req_pool: ReqToTokenPool, next_tokens: torch.Tensor
               ) -> Optional["PrefillGraphRunner"]:
        """Capture every size into `bufs`, or return None without them (the plan records
        prefill graphs only where they run; those forwards then run eagerly). Every rank
        calls this, in the same order, after the model's buffers are bound."""
        from moeserve.batch.step import step_from_counts

        assert plan.budget is not None and plan.layout is not None
        if bufs is None:
            return None
        blockers = graph_blockers(model, state.device)
        if blockers:
            raise RuntimeError("the plan records prefill graphs, but this model cannot be "
                               f"captured: {'; '.join(blockers)} "
                               "(--disable-piecewise-cuda-graph)")
        layout = plan.layout

        def step_for(t: int) -> "StepContext":
            return step_from_counts([t] * layout.tp, layout, state.rank, plan)

        runner = cls(model, plan.budget.prefill_token_sizes, bufs, next_tokens, kv_pool,
                     req_pool, step_for)
        runner.capture()
        return runner

    def _capture_batch(self, t: int) -> ForwardBatch:
        """t padding rows over the static inputs (token 0, position 0, K/V to DUMMY_SLOT) as
        one dummy request, for the warm-up and the capture. Neither runs an attention (t may
        be longer than a request can be), so its lengths are never read."""
        self.inputs[0:2, :t].zero_()
        self.inputs[2, :t].fill_(DUMMY_SLOT)
        one = dict(dtype=torch.int64, device=self.inputs.device)
        return ForwardBatch(ForwardMode.EXTEND, self.inputs[0, :t], self.inputs[1, :t],
                            self.inputs[2, :t], torch.tensor([DUMMY_REQ_ROW], **one),
                            torch.tensor([t], **one), torch.tensor([0], **one),
                            torch.tensor([t], **one), self.req_pool.table, self.kv_pool,
                            (t,), (0,), (t,))

    def _hidden(self, fb: ForwardBatch, t: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        ids = resolve_futures(self.inputs[0, :t], self.next_tokens)
        return self.model.hidden_states(ids, self.inputs[1, :t], fb, self.step_for(t))

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved()
        self.pool = torch.cuda.graph_pool_handle()
        layers: Optional[list["AttentionLayer"]] = None
        stream = torch.cuda.Stream()
        for t in reversed(self.sizes):  # largest first: the smaller fit in what it freed
            fb = self._capture_batch(t)
            pieces = _Pieces(self, t)
            # eagerly once (compile, fill caches), the attention skipped as in the capture
            fb.attention_hook = pieces.skip
            self._hidden(fb, t)
            torch.cuda.synchronize()
            fb.attention_hook = pieces.cut
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                pieces.begin()
                pieces.hidden = self._hidden(fb, t)
                pieces.end()
            torch.cuda.current_stream().wait_stream(stream)
            if layers is None:
                layers = pieces.layers
            if not layers or pieces.layers != layers:
                raise RuntimeError(f"the prefill graph of {t} tokens cut at "
                                   f"{len(pieces.layers)} attentions, not at one per layer; "
                                   "pass --disable-piecewise-cuda-graph")
            self.pieces[t] = pieces
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_reserved() - reserved
        log.info("captured prefill graphs (%d pieces each) for token counts %s in %.1f s; "
                 "their memory pool (outside the plan's static budget, like every forward's "
                 "activations) holds %.0f MiB", len(layers or []) + 1, self.sizes,
                 time.perf_counter() - t0, self.pool_bytes / 2 ** 20)

    def size_for(self, tokens_per_dp_rank: Sequence[int]) -> Optional[int]:
        return choose_size(self.sizes, tokens_per_dp_rank)

    def replay(self, fb: ForwardBatch, size: int) -> torch.Tensor:
        """Logits of fb's rows that get them: the pieces of `size` tokens with this rank's
        attention between them, then the final norm and LM head."""
        n = fb.num_tokens
        assert n <= size and size in self.pieces, (n, size)
        if n:
            self.inputs[0, :n].copy_(fb.input_ids)
            self.inputs[1, :n].copy_(fb.positions)
            self.inputs[2, :n].copy_(fb.out_cache_loc)
        if n < size:  # padding rows write only the dummy slot
            self.inputs[2, n:size].fill_(DUMMY_SLOT)
        pieces = self.pieces[size]
        q, out = self.q[:n], self.attn_out[:n]  # the real rows (a decode batch has n rows)
        for graph, layer in zip(pieces.graphs, pieces.layers):
            graph.replay()
            if n:
                layer.backend.forward(q, layer, fb, out=out)
        pieces.graphs[-1].replay()
        self.replays += 1
        assert pieces.hidden is not None
        x, r = pieces.hidden
        return self.model.logits(x[:n], None if r is None else r[:n], fb)
