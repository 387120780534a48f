"""The warm-up list: every kernel variant a forward within the plan can select, as data.

Before a rank reports ready, runtime/warmup.py runs each variant once (on a GPU), so that no
request waits for a compile; `moeserve plan` shows how many there are (`--json`: the list).
A variant names a path, a size and how it runs ("graph capture": the capture of that bucket
runs it eagerly first; "eager": a dummy forward or a direct call at startup):

  decode          each decode batch bucket of the plan (the decode attention's tiles, splits
                  and early placement, the unpack kernel, every layer at that batch)
  prefill         each prefill token bucket of the plan (rope head blocks, the skinny GEMMs'
                  rows, every layer but attention, which the capture leaves out)
  extend          eager prefills the buckets do not stand for: the plan's startup forward
                  (a full extend, the eager path above the buckets), one request per tile
                  entry of the extend attention, and without prefill graphs the counts
                  whose kernels differ (1..17: skinny GEMM rows; powers of two: rope blocks)
  moe             one row count per expert tile config a step of 1..the runner's rows takes
                  (prefill and decode configs alike; kernels/moe/configs.warm_up_sizes)
  attention.sdpa  each padded length a fresh long prompt takes through SDPA (cuDNN builds a
                  plan per length)
  sampling        the sampler at the largest decode batch: greedy, sampled, penalties,
                  logprobs
  dispatch        the dispatcher's other paths: some DP ranks idle or decoding while one
                  prefills, and an uneven split of the rows across attention-TP ranks

What counts as the same variant: two sizes are one variant when every kernel they launch
takes the same constexprs and the same specialisation of its integer arguments (Triton
compiles per value of each constexpr and per class of each unmarked integer argument: == 1,
divisible by 16, other). The integer arguments that follow a step's size are marked
`do_not_specialize` (align, the MoE GEMMs, the router, MLA's prep), are a grid dimension, or
are strides that a fixed width keeps a multiple of 16; the skinny GEMM's row count is the
exception, so rows 1..17 are variants of their own. So the key of a size is the constexpr
choice of each table: the MoE tile config, the attention tile entry, the rope head blocks.
Pure derivation: no torch device is touched.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from moeserve.kernels.attention.tiles import ATTENTION_TILES
from moeserve.kernels.moe.configs import warm_up_sizes
from moeserve.kernels.skinny.tiles import WARM_ROWS
from moeserve.plan.capacity import CapacityPlan, local_gpu_name
from moeserve.plan.capture import default_decode_batch_sizes

CAPTURE, EAGER = "graph capture", "eager"
PATHS = ("decode", "prefill", "extend", "moe", "attention.sdpa", "sampling", "dispatch")
SAMPLING_MODES = ("greedy", "sampled", "penalties", "logprobs")
ROPE_BLOCKS_MAX_TOKENS = 1024  # from here the rope runs one head block a token at any count
HALF_DTYPES = ("bfloat16", "float16")
DISPATCH_TOKENS = 16  # the busy DP rank's prefill in the dispatch variants


@dataclass(frozen=True)
class Variant:
    path: str  # one of PATHS
    size: int  # tokens (prefill, extend, dispatch: of the busiest DP rank), requests
    # (decode, sampling), rows (moe) or padded length (attention.sdpa), per DP rank
    via: str  # CAPTURE or EAGER
    key: str  # what it compiles, in words

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "via": self.via, "key": self.key}


@dataclass(frozen=True)
class WarmupPlan:
    variants: tuple[Variant, ...]
    skipped: Optional[str] = None  # why the startup runs none of them (None: it runs them)

    def sizes(self, path: str, via: Optional[str] = None) -> list[int]:
        return [v.size for v in self.variants if v.path == path and via in (None, v.via)]

    def of(self, path: str) -> list[Variant]:
        return [v for v in self.variants if v.path == path]

    def summary(self) -> str:
        counts = Counter(v.path for v in self.variants)
        parts = [f"{p} {counts[p]}" + (" (graph capture)" if all(
            v.via == CAPTURE for v in self.of(p)) else "") for p in PATHS if counts[p]]
        return f"{len(self.variants)} variants: {', '.join(parts) or 'none'}"

    def to_json(self) -> dict[str, Any]:
        return {"count": len(self.variants), "skipped": self.skipped,
                "variants": [v.to_json() for v in self.variants]}


def warmup_plan(plan: CapacityPlan, device_name: Optional[str] = None,
                capability: Optional[tuple[int, int]] = None) -> WarmupPlan:
    """The variants of a plan (empty for a plan with errors). `device_name` and `capability`
    choose the MoE tile tables (kernels/moe/configs.py), as the rank's device does; None: the
    default tables."""
    b, lay, be, spec = plan.budget, plan.layout, plan.backends, plan.spec
    if b is None or lay is None or be is None:
        return WarmupPlan((), "the plan has errors")
    graphs = be.graph_blocker is None
    out: list[Variant] = []

    # decode: the buckets, or without decode graphs the default bucket rule over the batches
    # the scheduler can form
    decode_captured = graphs and bool(b.decode_batch_sizes)
    decode = b.decode_batch_sizes if decode_captured else (
        b.decode_batch_sizes or tuple(default_decode_batch_sizes(b.max_running_requests)))
    via = CAPTURE if decode_captured else EAGER
    out += [Variant("decode", n, via, _decode_key(n)) for n in decode]

    # prefill buckets, and the eager prefills they leave out
    prefill_captured = graphs and bool(b.prefill_token_sizes)
    longest = min(b.extend, b.context_length)  # one request's most new tokens in one forward
    if prefill_captured:
        out += [Variant("prefill", n, CAPTURE, f"{n} tokens, attention aside")
                for n in b.prefill_token_sizes]
        eager: dict[int, str] = {}
    else:
        eager = {n: f"{n} rows: skinny GEMM tiles" for n in WARM_ROWS}
        n = 32
        while n <= min(b.extend, ROPE_BLOCKS_MAX_TOKENS):
            eager[n] = f"{n} tokens: rope head blocks"
            n *= 2
        eager = {n: k for n, k in eager.items() if n <= b.extend}
    for n, key in _extend_tile_sizes(spec, longest).items():
        eager.setdefault(n, key)  # a size that runs already compiles that entry too
    if b.warmup >= 1 and not (prefill_captured and b.warmup in b.prefill_token_sizes):
        eager.setdefault(b.warmup, f"{b.warmup} tokens: the startup forward (a full extend)")
    out += [Variant("extend", n, EAGER, eager[n]) for n in sorted(eager)]

    if be.experts == "triton" and spec.num_experts and plan.moe_runner_rows:
        out += _moe_variants(plan, device_name, capability)
    if be.attention == "triton" and be.device == "cuda":
        out += [Variant("attention.sdpa", t, EAGER, f"SDPA at {t} keys")
                for t in sdpa_lengths(plan)]
    top = max(decode, default=b.max_running_requests)
    out += [Variant("sampling", top, EAGER, mode) for mode in SAMPLING_MODES]
    out += _dispatch_variants(plan)
    skipped = None if be.device == "cuda" else (
        f"the engine runs on {be.device}: its kernels are torch's, nothing compiles")
    return WarmupPlan(tuple(out), skipped)


def local_warmup_plan(plan: CapacityPlan) -> WarmupPlan:
    """The list a rank on this machine's first GPU would run (`moeserve plan`)."""
    name = local_gpu_name(plan.config)
    capability = None
    if name is not None:
        import torch

        capability = torch.cuda.get_device_capability(torch.cuda.current_device())
    return warmup_plan(plan, name, capability)


def _decode_key(bs: int) -> str:
    tiles = ATTENTION_TILES.decode_tiles(bs)
    early = " early" if bs <= ATTENTION_TILES.early_place_max_batch else ""
    return f"batch {bs}: decode tiles {tiles}{early}"


def _extend_tile_sizes(spec: Any, longest: int) -> dict[int, str]:
    """One request length per tile entry of the extend attention that a request of
    1..longest new tokens takes (the shortest of each entry: below SDPA's range). Latent
    attention's extend tiles follow the heads alone: one length."""
    if spec.mla is not None:
        return {1: "latent extend tiles"} if longest >= 1 else {}
    sizes: dict[int, str] = {}
    low = 1
    for bound, tiles in ATTENTION_TILES.extend:
        if low <= longest:
            sizes[low] = f"extend tiles {tiles}"
        low = bound + 1
    return sizes


def sdpa_lengths(plan: CapacityPlan) -> list[int]:
    """The padded lengths a fresh prompt takes through SDPA on a GPU (layers/attention_triton
    and layers/mla_triton: half precision, a head dim SDPA's flash kernels take)."""
    b, spec = plan.budget, plan.spec
    if b is None or plan.dtype not in HALF_DTYPES:
        return []
    dim = (max(spec.mla.qk_head_dim, spec.mla.v_head_dim) if spec.mla is not None
           else spec.head_dim)
    if dim % 8 or dim > 256:
        return []
    low = (ATTENTION_TILES.mla_sdpa_min_extend if spec.mla is not None
           else ATTENTION_TILES.sdpa_min_extend)
    return ATTENTION_TILES.sdpa_warm_lengths(low, min(b.extend, b.context_length))


def expert_shape(plan: CapacityPlan) -> tuple[int, int, int]:
    """(local experts, hidden, local intermediate) of one rank's expert runner."""
    assert plan.layout is not None
    spec, lay = plan.spec, plan.layout
    return spec.num_experts // lay.ep, spec.hidden_size, spec.moe_intermediate_size // lay.moe_tp


def _moe_variants(plan: CapacityPlan, device_name: Optional[str],
                  capability: Optional[tuple[int, int]]) -> list[Variant]:
    e, h, i = expert_shape(plan)
    sizes = warm_up_sizes(plan.moe_runner_rows, plan.spec.top_k, e, h, i, plan.dtype,
                          device_name or "", capability,
                          quant_block=plan.expert_block)
    return [Variant("moe", n, EAGER, f"tile config of {n} rows") for n in sizes]


def _dispatch_variants(plan: CapacityPlan) -> list[Variant]:
    """The dispatcher's paths that the forwards above, where every rank has the same rows,
    do not take."""
    lay, b = plan.layout, plan.budget
    assert lay is not None and b is not None
    longest = min(b.extend, b.context_length)
    out = []
    if lay.dp > 1:
        n = min(DISPATCH_TOKENS, longest)
        out.append(Variant("dispatch", n, EAGER, "DP rank 0 prefills, the others idle"))
        out.append(Variant("dispatch", n, EAGER, "DP rank 0 prefills, the others decode"))
    if lay.scatter_across_attn_tp and lay.attn_tp + 1 <= longest:
        out.append(Variant("dispatch", lay.attn_tp + 1, EAGER,
                           "rows split unevenly across attention-TP ranks"))
    return out
