"""Static buffer records: every buffer the engine allocates, with the formula that sized it.

A plan records the buffers of what its ranks run and no others (the expert runner's workspace
only for the triton runner, the attention partials only for the triton backends, graph inputs
only where graphs are captured), so that one binder (runtime/buffers.py) allocates every
record, each once, with the shape and dtype recorded here (`BufferRecord.empty`), never from a
forward that ran.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from moeserve.kernels.attention import tiles as AT
from moeserve.kernels.comm.layout import window_bytes
from moeserve.kernels.fp8.tiles import MAX_SPLIT_TILES, split_partials_bound
from moeserve.config.quant import FP8_DTYPE
from moeserve.config.spec import ModelSpec
from moeserve.kernels.moe.configs import (ALIGN_CHUNK, BLOCK_MS, ROUTE_BLOCK, align_scratch_len,
                                          gemv_rows, max_blocks, padded_rows, route_blocks,
                                          rows_writing_pairs)
from moeserve.parallel.layout import ParallelLayout
from moeserve.plan.budget import TokenBudget, layer_scatters, moe_tokens_per_rank
from moeserve.plan.memory import DTYPE_BYTES, kv_elems_per_token_per_layer, kv_heads_per_rank

ELEM_BYTES = {**DTYPE_BYTES, "int32": 4, "int64": 8, "uint8": 1, FP8_DTYPE: 1}
TOPK_ID_BYTES = 4  # top-k ids travel as int32
TOPK_WEIGHT_BYTES = 4  # top-k weights travel as float32
FP8_SCALE_BYTES = 4  # an fp8 row's group scales travel as float32


@dataclass(frozen=True)
class BufferRecord:
    name: str
    shape: tuple[int, ...]
    dtype: str
    formula: str
    knobs: tuple[str, ...]
    # allocated in symmetric memory on a GPU (parallel/symmetric.py), so that the peers of its
    # group can store into it; plain memory on a CPU
    symmetric: bool = False

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * ELEM_BYTES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "bytes": self.bytes, "formula": self.formula, "knobs": list(self.knobs),
                "symmetric": self.symmetric}

    def empty(self, device: Any = "cpu") -> Any:
        """Allocate this buffer (the binder's only way of making one)."""
        import torch

        from moeserve.parallel.symmetric import symmetric_empty

        dtype, device = getattr(torch, self.dtype), torch.device(device)
        if self.symmetric and device.type == "cuda":
            return symmetric_empty(self.shape, dtype, device)
        return torch.empty(self.shape, dtype=dtype, device=device)


def token_payload_bytes(hidden: int, top_k: int, elem_bytes: int,
                        scale_group: Optional[int] = None) -> int:
    """One token row as the dispatchers move it (moe/dispatch/base.py packs it): hidden states
    of `elem_bytes` each, then (fp8 rows, quantized once before the exchange) one float32
    scale per `scale_group` columns, then K int32 ids, then K float32 weights."""
    scales = 0 if scale_group is None else -(-hidden // scale_group) * FP8_SCALE_BYTES
    return hidden * elem_bytes + scales + top_k * (TOPK_ID_BYTES + TOPK_WEIGHT_BYTES)


BUDGET_KNOBS = ("--chunked-prefill-size", "--max-prefill-tokens", "--max-running-requests",
                "--speculative-num-draft-tokens")
GRAPH_KNOBS = ("--cuda-graph-max-bs", "--cuda-graph-bs", "--max-running-requests")


def a2a_records(spec: ModelSpec, layout: ParallelLayout, dtype: str, cap: int,
                transport: str = "all_to_all", scale_group: Optional[int] = None
                ) -> list[BufferRecord]:
    """The all-to-all workspace: per peer `cap` token slots (cap is per rank, never times ep).

    all_to_all (NCCL): send and receive halves; the combine reuses them (its rows are smaller).
    nvlink: the receive window that peers store tokens into and the window that they store
    their results back into, both symmetric, and this rank's slot tables (local)."""
    b = DTYPE_BYTES[dtype]
    payload = token_payload_bytes(spec.hidden_size, spec.top_k, 1 if scale_group else b,
                                  scale_group)
    knobs = ("--moe-a2a-max-tokens-per-rank", *BUDGET_KNOBS)
    formula = f"ep x cap x (H*{b} + K*8)"
    quantized: list[BufferRecord] = []
    if scale_group:  # fp8 rows: a byte per value, a float32 scale per group
        formula = f"ep x cap x (H + ceil(H/{scale_group})*4 + K*8)"
        knobs = ("--quantization", *knobs)
        # this rank's rows, quantized once before the exchange, and their scales
        quantized = [
            BufferRecord("a2a.quant", (cap, spec.hidden_size), FP8_DTYPE,
                         "cap x H [this rank's rows in fp8, before they travel]", knobs),
            BufferRecord("a2a.quant_scale", (cap, -(-spec.hidden_size // scale_group)),
                         "float32", f"cap x ceil(H/{scale_group}) [their scales]", knobs)]
    if transport == "nvlink":
        ep = layout.ep
        return quantized + [
            BufferRecord("a2a.recv", (ep, cap, payload), "uint8",
                         f"{formula} [tokens the peers store; symmetric]", knobs, True),
            BufferRecord("a2a.combine", (ep, cap, spec.hidden_size * b), "uint8",
                         f"ep x cap x H*{b} [results the peers store back; symmetric]", knobs,
                         True),
            BufferRecord("a2a.slots", (cap, ep), "int32",
                         "cap x ep [each row's slot on each peer]", knobs),
            BufferRecord("a2a.sources", (ep, cap), "int32",
                         "ep x cap [the row each slot carries]", knobs),
            BufferRecord("a2a.route_counts", (ep, route_blocks(cap)), "int32",
                         f"ep x ceil(cap/{ROUTE_BLOCK}) [each block's rows for each peer]",
                         knobs)]
    row = a2a_row_bytes(spec.hidden_size, spec.top_k, b, scale_group)
    if row != payload:  # fp8 tokens out, results back in the model's dtype: the larger row
        formula = f"ep x cap x max(H + ceil(H/{scale_group})*4 + K*8, H*{b})"
    return quantized + [BufferRecord(f"a2a.{half}", (layout.ep, cap, row), "uint8",
                                     f"{formula} [{half} half; combine reuses it]", knobs)
                        for half in ("send", "recv")]


def a2a_row_bytes(hidden: int, top_k: int, elem_bytes: int,
                  scale_group: Optional[int] = None) -> int:
    """A row of the all-to-all send and receive halves, which carry the token payload out
    (fp8 with its scales when scale_group is set) and the results back (H in the model's
    dtype, `elem_bytes` each): the larger of the two."""
    payload = token_payload_bytes(hidden, top_k, 1 if scale_group else elem_bytes,
                                  scale_group)
    return max(payload, hidden * elem_bytes)


def moe_runner_rows(layout: ParallelLayout, budget: TokenBudget, cap: int) -> tuple[int, str]:
    """Rows that reach one rank's expert runner in the worst forward, with the formula."""
    if layout.a2a:
        return layout.ep * cap, "ep x cap"
    if layout.dp > 1:
        return layout.dp * budget.max_tokens, "dp x T_max (gathered DP rows)"
    return budget.max_tokens, "T_max"


def router_records(spec: ModelSpec, layout: ParallelLayout,
                   budget: TokenBudget) -> list[BufferRecord]:
    """The router's top-k of one MoE layer's rows; every MoE layer writes the same buffers
    (they run one after another, and dispatch consumes them within the layer)."""
    m_max, k = moe_tokens_per_rank(budget.max_tokens, layout), spec.top_k
    return [BufferRecord("moe.router.topk_ids", (m_max, k), "int32", "M_max x K", BUDGET_KNOBS),
            BufferRecord("moe.router.topk_weights", (m_max, k), "float32", "M_max x K",
                         BUDGET_KNOBS)]


def runner_records(spec: ModelSpec, layout: ParallelLayout, dtype: str, rows: int,
                   rows_formula: str, device_name: Optional[str] = None,
                   quant_block: Optional[tuple[int, int]] = None) -> list[BufferRecord]:
    """The fused Triton runner's workspace (moe/experts/triton_fused.py, kernels/moe/
    align_torch.Workspace) for `rows` rows at most. It holds every (row, k) pair, its own or
    not, and its grouped rows are padded to blocks of BLOCK_M per local expert. device_name:
    the GPU the runner will run on (None: unknown); its tuned tile tables say which steps
    write every pair's row to moe.runner.down (configs.rows_writing_pairs).
    quant_block: fp8 weights with these scale blocks (fused_moe_fp8.py): the intermediate is
    fp8 beside one float32 scale per row per bk columns, and where rows reach the runner
    unquantized (no all-to-all, which carries them quantized) their quantized copy too."""
    h, k = spec.hidden_size, spec.top_k
    i_local = spec.moe_intermediate_size // layout.moe_tp
    e_local = spec.num_experts // layout.ep
    all_pairs = rows * k
    grouped = padded_rows(all_pairs, e_local)
    blocks = max(max_blocks(all_pairs, m, e_local) for m in BLOCK_MS)
    af = f"{rows_formula} x K"
    down_rows = rows_writing_pairs(rows, e_local, h, i_local, dtype, device_name,
                                   quant_block=quant_block)
    df = af if down_rows == rows else (
        f"{down_rows} x K ({device_name}'s tile tables: larger steps sum the top-k in down)")
    gf = f"max over BLOCK_M of min(P, ceil(P/BLOCK_M) + E/ep) x BLOCK_M, P = {af}"
    knobs = BUDGET_KNOBS
    act_dtype = dtype if quant_block is None else FP8_DTYPE
    records = [
        BufferRecord("moe.runner.sorted_pairs", (grouped,), "int32", gf, knobs),
        *(BufferRecord(f"moe.runner.{name}", (blocks,), "int32",
                       f"max over BLOCK_M of min(P, ceil(P/BLOCK_M) + E/ep), P = {af}", knobs)
          for name in ("block_expert", "block_rows")),
        BufferRecord("moe.runner.act", (grouped, i_local), act_dtype, f"({gf}) x I/moe_tp",
                     knobs),
        BufferRecord("moe.runner.down", (down_rows * k, h), dtype, f"{df} x H", knobs),
        BufferRecord("moe.runner.align", (align_scratch_len(all_pairs, e_local),), "int32",
                     f"(1 + ceil(P/{ALIGN_CHUNK})) x pow2(E/ep, >= 16), P = {af}", knobs),
    ]
    if quant_block is not None:
        bk = quant_block[1]
        fp8_knobs = ("--quantization", *knobs)
        # (the grouped path views its front group-major, [groups, rows]: the same bytes)
        records.append(BufferRecord("moe.runner.act_scale", (grouped, -(-i_local // bk)),
                                    "float32", f"({gf}) x ceil(I/moe_tp/{bk})", fp8_knobs))
        # the decode gate_up's float32 product (the CUDA-core down quantizes it a group at a
        # time; the MMA down takes it quantized into moe.runner.act and act_scale)
        gemv = gemv_rows(rows, k, e_local, h, i_local, dtype, device_name,
                         quant_block=quant_block)
        if gemv:
            records.append(BufferRecord(
                "moe.runner.act_f32", (gemv * k, i_local), "float32",
                f"{gemv} x K x I/moe_tp (the most rows {device_name or 'the defaults'} "
                "gives the GEMV path)", fp8_knobs))
        if not layout.a2a:
            records += [
                BufferRecord("moe.runner.input", (rows, h), FP8_DTYPE, f"{rows_formula} x H",
                             fp8_knobs),
                BufferRecord("moe.runner.input_scale", (rows, -(-h // bk)), "float32",
                             f"{rows_formula} x ceil(H/{bk})", fp8_knobs)]
    return records


def gather_records(spec: ModelSpec, layout: ParallelLayout, budget: TokenBudget,
                   dtype: str) -> list[BufferRecord]:
    """The receive buffers of the padded uneven all-gathers (parallel/collectives.py): every
    rank's block padded to the largest, so each holds ranks x the most rows one rank sends.

    dp_gather.rows: the gather across the tp world of the rows of every DP rank (each rank
    sends its ceil(T/attn_tp) scattered rows, or its T rows when attn_tp is 1): by the gather
    dispatcher, as token payload rows, and by dense MLPs split over the world, as hidden
    states; bytes, so that either is a view of it.
    attn_tp_gather.hidden: a scattered layer's rows back to the DP rank's T rows."""
    h, b = spec.hidden_size, DTYPE_BYTES[dtype]
    chunk = math.ceil(budget.max_tokens / layout.attn_tp)
    recs = []
    # a dense MLP split over the world gathers when the ranks hold distinct rows (DP attention)
    dense_world = (bool(spec.dense_layers) and layout.dp > 1 and layout.dense_tp == layout.tp
                   and layout.tp > 1)
    if layout.dp_gather or dense_world:
        payload = token_payload_bytes(h, spec.top_k, b) if layout.dp_gather else h * b
        what = f"payload (H*{b} + K*8)" if layout.dp_gather else f"H*{b}"
        recs.append(BufferRecord(
            "dp_gather.rows", (layout.tp * chunk, payload), "uint8",
            f"tp x ceil(T_max/attn_tp) x {what} (padded uneven all-gather of every rank's rows)",
            ("--dp-size", *BUDGET_KNOBS)))
    if layer_scatters(layout, moe=True) or (spec.dense_layers
                                            and layer_scatters(layout, moe=False)):
        recs.append(BufferRecord("attn_tp_gather.hidden", (layout.attn_tp * chunk, h), dtype,
                                 "attn_tp x ceil(T_max/attn_tp) x H",
                                 ("--tp-size", "--dp-size", *BUDGET_KNOBS)))
    return recs


def comm_axes(spec: ModelSpec, layout: ParallelLayout) -> list[str]:
    """The axes whose collectives a step runs: attn_tp (attention's all-reduce, or its
    reduce-scatter and the all-gather after the block) and the world (the gather dispatcher's
    all-gather and reduce-scatter or all-reduce, and those of dense MLPs split over it)."""
    axes = ["attn_tp"] if layout.attn_tp > 1 else []
    dense_world = bool(spec.dense_layers) and layout.dense_tp == layout.tp
    if layout.tp > 1 and (not layout.a2a or dense_world):
        axes.append("world")
    return axes


def comm_records(spec: ModelSpec, layout: ParallelLayout, max_bytes: int) -> list[BufferRecord]:
    """The windows of the one-shot collectives (parallel/symm_comm.py), one per axis that
    exchanges anything: a collective whose full tensor (an all-reduce's input, an all-gather's
    output, a reduce-scatter's input, all ranks' rows, unpadded) fits runs in it, a larger one
    on NCCL. None where max_bytes is 0 (across nodes, on a CPU, or turned off). A window is
    two regions of two halves of P slots of max_bytes (kernels/comm/layout.window_bytes: the
    pushing collectives alternate halves, the all-reduce stores its whole tensor into each
    rank, and the all-reduce + RMSNorm of 16-bit rows has a region of its own)."""
    if not max_bytes:
        return []
    sizes = {"attn_tp": layout.attn_tp, "world": layout.tp}
    return [BufferRecord(f"comm.symm.{axis}", (window_bytes(max_bytes, sizes[axis]),), "uint8",
                         f"4 x {axis} ({sizes[axis]}) x --symm-comm-max-bytes (the largest "
                         f"one-shot collective over {axis}, all ranks' rows) [symmetric]",
                         ("--symm-comm-max-bytes",), True)
            for axis in comm_axes(spec, layout)]


def decode_graph_records(spec: ModelSpec, budget: TokenBudget) -> list[BufferRecord]:
    """The decode graphs' inputs and logits (runtime/cuda_graph.py: DecodeGraphBuffers); bucket
    bs uses the first bs rows of each."""
    if not budget.decode_batch_sizes:
        return []
    bs = max(budget.decode_batch_sizes)
    t = budget.decode_graph
    return [
        BufferRecord("graph.decode.input_ids", (t,), "int64", "max bucket x tokens/request",
                     GRAPH_KNOBS),
        BufferRecord("graph.decode.positions", (t,), "int64", "max bucket x tokens/request",
                     GRAPH_KNOBS),
        BufferRecord("graph.decode.out_cache_loc", (t,), "int64", "max bucket x tokens/request",
                     GRAPH_KNOBS),
        BufferRecord("graph.decode.req_pool_indices", (bs,), "int64", "max bucket", GRAPH_KNOBS),
        *(BufferRecord(f"graph.decode.{name}", (bs,), "int32", "max bucket", GRAPH_KNOBS)
          for name in ("seq_lens", "prefix_lens", "extend_lens")),
        BufferRecord("graph.decode.staging", (bs, 3), "int64",
                     "max bucket x (token, position, request row)", GRAPH_KNOBS),
        BufferRecord("graph.decode.logits", (t, spec.vocab_size), "float32",
                     "max bucket x tokens/request x vocab", GRAPH_KNOBS),
    ]


def attention_records(spec: ModelSpec, layout: ParallelLayout,
                      budget: TokenBudget) -> list[BufferRecord]:
    """The decode attention's partial results (the triton backends, layers/attention_triton.py
    and mla_triton.py): a row per (request, split of its keys), the most the split rule takes
    (the shipped tiles' partial_slots), for the combine; shared by every layer of a step. None
    when the rule splits no batch the budget allows."""
    tiles = AT.ATTENTION_TILES
    heads = spec.num_heads // layout.attn_tp
    if spec.mla is None:
        groups, width, whole = kv_heads_per_rank(spec, layout), spec.head_dim, tiles.gqa_whole_from
        per, unit = "KV heads/attn_tp", "head_dim"
    else:
        groups = -(-heads // tiles.mla_decode[0])
        width, whole = spec.mla.kv_lora_rank, tiles.mla_whole_from
        per, unit = f"ceil(heads/attn_tp / {tiles.mla_decode[0]})", "kv_lora_rank"
    # a decode graph's bucket may pad a batch past max running
    batch = max([budget.max_running_requests, *budget.decode_batch_sizes])
    slots = tiles.partial_slots(groups, whole, batch)
    if not slots:
        return []
    rule = (f"S = max batch x splits over batches <= max(running, decode graphs) on "
            f"{AT.PLANNED_SMS} SMs, {per} programs a request")
    knobs = ("--tp-size", "--dp-size", "--max-running-requests")
    return [BufferRecord("attn.decode.part_o", (slots, heads, width), "float32",
                         f"S x heads/attn_tp x {unit}; {rule}", knobs),
            BufferRecord("attn.decode.part_lse", (slots, heads), "float32",
                         f"S x heads/attn_tp; {rule}", knobs)]


def fp8_gemm_records() -> list[BufferRecord]:
    """The fp8 GEMMs' split-K workspace (kernels/fp8/tiles.SplitWorkspace): the most partials
    a decode-sized launch stores on PLANNED_SMS SMs, and the tiles' counters; shared by every
    projection of a step and by the triton runner's MMA decode down (its parts' sums)."""
    rule = (f"2 x the programs a decode tile wants x its BLOCK_M x BLOCK_N, the most on "
            f"{AT.PLANNED_SMS} SMs (K is split only while tiles x parts fall short of them)")
    return [BufferRecord("fp8.gemm.partials", (split_partials_bound(AT.PLANNED_SMS),),
                         "float32", rule, ("--quantization",)),
            BufferRecord("fp8.gemm.counters", (MAX_SPLIT_TILES,), "int32",
                         "the tiles a split launch may have", ("--quantization",))]


PREFILL_GRAPH_KNOBS = ("--piecewise-cuda-graph-max-tokens", "--chunked-prefill-size",
                       "--max-prefill-tokens")


def prefill_graph_records(spec: ModelSpec, layout: ParallelLayout, budget: TokenBudget,
                          dtype: str) -> list[BufferRecord]:
    """The inputs of the prefill graphs and the two tensors that cross each cut at an
    attention (runtime/prefill_graph.py). Latent attention (MLA) hands over [q_nope | q_pe]
    per head and gets v_head_dim values per head back."""
    if not budget.prefill_token_sizes:
        return []
    t = max(budget.prefill_token_sizes)
    heads = spec.num_heads // layout.attn_tp
    if spec.mla is None:
        q = o = (t, heads, spec.head_dim)
        per_head = q_dims = o_dims = "max prefill graph tokens x heads/attn_tp x head_dim"
    else:
        q, o = (t, heads, spec.mla.qk_head_dim), (t, heads, spec.mla.v_head_dim)
        per_head = "max prefill graph tokens x heads/attn_tp x "
        q_dims, o_dims = per_head + "qk_head_dim", per_head + "v_head_dim"
    return [
        BufferRecord("graph.prefill.inputs", (3, t), "int64",
                     "(token, position, KV slot) x max prefill graph tokens",
                     PREFILL_GRAPH_KNOBS),
        BufferRecord("graph.prefill.q", q, dtype, q_dims + " (each attention's query)",
                     PREFILL_GRAPH_KNOBS),
        BufferRecord("graph.prefill.attn_out", o, dtype, o_dims + " (each attention's output)",
                     PREFILL_GRAPH_KNOBS),
    ]


def kv_records(spec: ModelSpec, layout: ParallelLayout, budget: TokenBudget, dtype: str,
               kv_tokens: int) -> list[BufferRecord]:
    width = kv_elems_per_token_per_layer(spec, layout)
    kv = BufferRecord("kv_cache", (spec.num_layers, kv_tokens, width), dtype,
                      "layers x kv_capacity_tokens x " + ("(kv_lora + rope)" if spec.mla else
                                                          "2 x kv_heads/attn_tp x head_dim"),
                      ("--mem-fraction-static", "--max-total-tokens", "--gpu-memory-gb"))
    return [kv]


def next_token_record(budget: TokenBudget) -> BufferRecord:
    # the sampled tokens of the step in flight, which the next step's inputs point into
    return BufferRecord("next_token_ids", (budget.max_running_requests,), "int64",
                        "max running per DP rank (the tokens of the step in flight)",
                        ("--max-running-requests",))


def req_to_token_record(budget: TokenBudget) -> BufferRecord:
    # one spare row for the dummy request that padded graph rows point at
    return BufferRecord("req_to_token", (budget.max_running_requests + 1, budget.context_length),
                        "int32", "(max running per DP rank + 1) x context length",
                        ("--max-running-requests", "--context-length"))
