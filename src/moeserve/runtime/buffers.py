"""The binder: every static buffer of a rank, allocated from its capacity plan record, once.

    bufs = bind_buffers(plan, device)     # before the model runs a forward
    model.bind_buffers(bufs.model)        # router, gathers, all-to-all, experts, attention
    bufs.kv_pool, bufs.req_pool, bufs.next_tokens, bufs.decode_graph, bufs.prefill_graph

(`bind_model_buffers` allocates the model's part alone, for layers tested without a KV cache.)

This is the one place that reads the plan's records and allocates them (docs/DESIGN.md, "Every
buffer from the plan"); everything else receives a typed handle. The plan records the buffers of
what this rank runs and no others (the expert workspace for the triton runner, the attention
partials for the triton backends, graph inputs where graphs are captured), so every record is
allocated here and `allocated` holds each one's tensor under its name, for the accounting that
the tests compare with the plan. A record the binder does not know is an error: a buffer
without an owner.

Not from records: the KV pool's free lists and the request table's free rows (host state), and
the decode graphs' pinned host copy of their staging rows (host memory; the plan divides the
device's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from moeserve.batch.buffers import (A2AWorkspace, AttentionPartials, CommWindows,
                                    GatherBuffers, ModelBuffers, PeerExchangeBuffers,
                                    RouterBuffers)
from moeserve.batch.kv_cache import (KVCachePool, MLAKVCachePool, PagedKVPool,
                                     ReqToTokenPool)
from moeserve.kernels.fp8.tiles import SplitWorkspace
from moeserve.kernels.moe.align_torch import BASE_FIELDS, Workspace
from moeserve.plan.capacity import CapacityPlan
from moeserve.plan.memory import kv_heads_per_rank
from moeserve.runtime.cuda_graph import DecodeGraphBuffers
from moeserve.runtime.prefill_graph import PrefillGraphBuffers


@dataclass(frozen=True, kw_only=True)
class StaticBuffers:
    model: ModelBuffers
    kv_pool: PagedKVPool
    req_pool: ReqToTokenPool
    next_tokens: torch.Tensor  # [max running] int64: the sampled tokens of the step in flight
    decode_graph: Optional[DecodeGraphBuffers]
    prefill_graph: Optional[PrefillGraphBuffers]
    allocated: Mapping[str, torch.Tensor]  # record name -> its tensor (accounting only)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.allocated.values())


class _Allocator:
    """Each record of the plan allocated at most once, and remembered by name."""

    def __init__(self, plan: CapacityPlan, device: torch.device) -> None:
        self.plan, self.device = plan, device
        self.allocated: dict[str, torch.Tensor] = {}

    def has(self, name: str) -> bool:
        return self.plan.has_buffer(name)

    def take(self, name: str) -> torch.Tensor:
        assert name not in self.allocated, f"{name} allocated twice"
        t = self.plan.buffer(name).empty(self.device)
        self.allocated[name] = t
        return t

    def adopt(self, name: str, t: torch.Tensor) -> None:
        """A tensor a pool made itself to the record's size (checked here)."""
        rec = self.plan.buffer(name)
        assert name not in self.allocated, f"{name} allocated twice"
        if t.numel() * t.element_size() != rec.bytes or t.dtype != getattr(torch, rec.dtype):
            raise AssertionError(f"{name}: {tuple(t.shape)} {t.dtype} is not the record's "
                                 f"{rec.shape} {rec.dtype}")
        self.allocated[name] = t

    def group(self, prefix: str, fields: tuple[str, ...]) -> Optional[dict[str, torch.Tensor]]:
        """The records prefix + field, all or none of them."""
        have = [self.has(prefix + f) for f in fields]
        if not any(have):
            return None
        if not all(have):
            raise ValueError(f"the plan has only some of the {prefix}* records: "
                             f"{[prefix + f for f, h in zip(fields, have) if h]}")
        return {f: self.take(prefix + f) for f in fields}


def bind_buffers(plan: CapacityPlan, device: torch.device | str) -> StaticBuffers:
    """Every buffer of the plan on `device`, each record once."""
    if plan.budget is None or plan.layout is None:
        raise ValueError("the capacity plan has errors: "
                         + "; ".join(str(e) for e in plan.errors))
    a = _Allocator(plan, torch.device(device))
    model = _model_buffers(a)
    kv = _kv_pool(a)
    req = ReqToTokenPool(*plan.buffer("req_to_token").shape, device=a.device)
    a.adopt("req_to_token", req.table)
    next_tokens = a.take("next_token_ids").zero_()
    decode = a.group("graph.decode.", ("input_ids", "positions", "out_cache_loc",
                                       "req_pool_indices", "seq_lens", "prefix_lens",
                                       "extend_lens", "logits", "staging"))
    prefill = a.group("graph.prefill.", ("inputs", "q", "attn_out"))
    if prefill is not None:
        prefill["attn_out"].zero_()  # the padding rows no attention writes read finite values
    unknown = [r.name for r in plan.buffers if r.name not in a.allocated]
    if unknown:
        raise ValueError(f"the plan records {unknown}, which nothing allocates")
    return StaticBuffers(
        model=model, kv_pool=kv, req_pool=req, next_tokens=next_tokens,
        decode_graph=None if decode is None else DecodeGraphBuffers(**decode,
                                                                    next_tokens=next_tokens),
        prefill_graph=None if prefill is None else PrefillGraphBuffers(**prefill),
        allocated=dict(a.allocated))


def bind_model_buffers(plan: CapacityPlan, device: torch.device | str) -> ModelBuffers:
    """The records of the model's layers alone (MoECausalLM.bind_buffers, or a layer's own
    bind): no KV cache, request table or graph inputs."""
    return _model_buffers(_Allocator(plan, torch.device(device)))


def _model_buffers(a: _Allocator) -> ModelBuffers:
    router = a.group("moe.router.", ("topk_ids", "topk_weights"))
    a2a: A2AWorkspace | PeerExchangeBuffers | None = None
    quant = a.group("a2a.", ("quant", "quant_scale")) or {}  # fp8 rows
    if a.has("a2a.combine"):  # the nvlink transport
        a2a = PeerExchangeBuffers(**a.group("a2a.", ("recv", "combine", "slots", "sources",
                                                     "route_counts")), **quant)
    elif a.has("a2a.send"):
        a2a = A2AWorkspace(**a.group("a2a.", ("send", "recv")), **quant)
    experts = a.group("moe.runner.", BASE_FIELDS)
    if experts is not None:  # fp8 weights: act's scales, and the quantized input rows
        for fields in (("act_scale",), ("input", "input_scale"), ("act_f32",)):
            experts.update(a.group("moe.runner.", fields) or {})
    partials = a.group("attn.decode.", ("part_o", "part_lse"))
    fp8 = a.group("fp8.gemm.", ("partials", "counters"))
    if fp8 is not None:
        fp8["counters"].zero_()  # the split launches count from zero and leave them so
    comm = CommWindows(**{axis: a.take(f"comm.symm.{axis}") for axis in ("attn_tp", "world")
                          if a.has(f"comm.symm.{axis}")})
    return ModelBuffers(
        router=None if router is None else RouterBuffers(topk_ids_MK=router["topk_ids"],
                                                         topk_weights_MK=router["topk_weights"]),
        gather=GatherBuffers(
            attn_tp=a.take("attn_tp_gather.hidden") if a.has("attn_tp_gather.hidden") else None,
            world=a.take("dp_gather.rows") if a.has("dp_gather.rows") else None),
        comm=comm,
        a2a=a2a,
        experts=None if experts is None else Workspace(**experts),
        attention=None if partials is None else AttentionPartials(**partials),
        fp8_gemm=None if fp8 is None else SplitWorkspace(**fp8))


def _kv_pool(a: _Allocator) -> PagedKVPool:
    """The pool of the "kv_cache" record: latent rows [layers, tokens, kv_lora + rope] for MLA
    models, else [layers, tokens, 2 x kv_heads x head_dim]."""
    plan = a.plan
    rec = plan.buffer("kv_cache")
    layers, tokens, width = rec.shape
    dtype, page = getattr(torch, rec.dtype), plan.config.page_size
    mla = plan.spec.mla
    if mla is not None:
        assert width == mla.kv_cache_dim, (rec, mla)
        pool: PagedKVPool = MLAKVCachePool(layers, tokens, mla.kv_lora_rank,
                                           mla.qk_rope_head_dim, dtype, a.device, page)
        a.adopt("kv_cache", pool.kv_LSW)
        return pool
    kv_heads = kv_heads_per_rank(plan.spec, plan.layout)
    assert width == 2 * kv_heads * plan.spec.head_dim, (rec, kv_heads)
    pool = KVCachePool(layers, tokens, kv_heads, plan.spec.head_dim, dtype, a.device, page)
    a.adopt("kv_cache", pool.kv_LSKD)
    return pool
