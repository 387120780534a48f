"""Static buffer records: every buffer the engine allocates, with the formula that sized it.

Allocation code takes shape and dtype from these records (`BufferRecord.empty`), never from
a forward that ran.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from moeserve.kernels.attention import tiles as AT
from moeserve.config.spec import ModelSpec
from moeserve.kernels.moe.configs import (ALIGN_CHUNK, BLOCK_MS, align_scratch_len, max_blocks,
                                          padded_rows, rows_writing_pairs)
from moeserve.parallel.layout import ParallelLayout
from moeserve.plan.budget import TokenBudget, moe_tokens_per_rank
from moeserve.plan.memory import DTYPE_BYTES, kv_elems_per_token_per_layer, kv_heads_per_rank

ELEM_BYTES = {**DTYPE_BYTES, "int32": 4, "int64": 8, "uint8": 1}
A2A_INDEX_BYTES = 4  # top-k ids travel as int32
A2A_WEIGHT_BYTES = 4  # top-k weights travel as float32


@dataclass(frozen=True)
class BufferRecord:
    name: str
    shape: tuple[int, ...]
    dtype: str
    formula: str
    knobs: tuple[str, ...]

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * ELEM_BYTES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "bytes": self.bytes, "formula": self.formula, "knobs": list(self.knobs)}

    def empty(self, device: Any = "cpu") -> Any:
        """Allocate this buffer: the only way plan-owned buffers are made."""
        import torch

        return torch.empty(self.shape, dtype=getattr(torch, self.dtype), device=device)


def a2a_dispatch_payload_bytes(spec: ModelSpec, dtype: str) -> int:
    """One token slot of the dispatch: hidden states, top-k ids (int32), top-k weights (fp32)."""
    return (spec.hidden_size * DTYPE_BYTES[dtype]
            + spec.top_k * (A2A_INDEX_BYTES + A2A_WEIGHT_BYTES))


def a2a_combine_payload_bytes(spec: ModelSpec, dtype: str) -> int:
    return spec.hidden_size * DTYPE_BYTES[dtype]


BUDGET_KNOBS = ("--chunked-prefill-size", "--max-prefill-tokens", "--max-running-requests",
                "--speculative-num-draft-tokens")
GRAPH_KNOBS = ("--cuda-graph-max-bs", "--cuda-graph-bs", "--max-running-requests")


def a2a_records(spec: ModelSpec, layout: ParallelLayout, dtype: str,
                cap: int) -> list[BufferRecord]:
    """The all-to-all workspace: per peer `cap` token slots (cap is per rank, never times ep).
    Send and receive halves; the combine reuses them (its payload is smaller)."""
    payload = a2a_dispatch_payload_bytes(spec, dtype)
    knobs = ("--moe-a2a-max-tokens-per-rank", *BUDGET_KNOBS)
    formula = "ep x cap x (H*{b} + K*8)".format(b=DTYPE_BYTES[dtype])
    return [BufferRecord(f"a2a.{half}", (layout.ep, cap, payload), "uint8",
                         f"{formula} [{half} half; combine reuses it]", knobs)
            for half in ("send", "recv")]


def moe_runner_rows(spec: ModelSpec, layout: ParallelLayout, budget: TokenBudget,
                    cap: int) -> tuple[int, str]:
    """Rows that reach one rank's expert runner in the worst forward, with the formula."""
    if layout.a2a:
        return layout.ep * cap, "ep x cap"
    if layout.dp > 1:
        return layout.dp * budget.max_tokens, "dp x T_max (gathered DP rows)"
    return budget.max_tokens, "T_max"


def moe_records(spec: ModelSpec, layout: ParallelLayout, budget: TokenBudget, dtype: str,
                cap: int, device_name: Optional[str] = None) -> list[BufferRecord]:
    """device_name: the GPU the runner will run on (None: unknown); its tuned tile tables say
    which steps write every pair's row to moe.runner.down (configs.rows_writing_pairs)."""
    h, k = spec.hidden_size, spec.top_k
    i_local = spec.moe_intermediate_size // layout.moe_tp
    k_local = min(k, spec.num_experts // layout.ep)
    m_max = moe_tokens_per_rank(budget.max_tokens, layout)
    rows, rows_formula = moe_runner_rows(spec, layout, budget, cap)
    pairs = rows * k_local
    pf = f"{rows_formula} x min(K, E/ep)"
    # the fused runner's workspaces (moe/experts/triton_fused.py) hold every (row, k) pair,
    # its own or not, and its grouped rows are padded to blocks of BLOCK_M per local expert
    e_local = spec.num_experts // layout.ep
    all_pairs = rows * k
    grouped = padded_rows(all_pairs, e_local)
    blocks = max(max_blocks(all_pairs, m, e_local) for m in BLOCK_MS)
    af = f"{rows_formula} x K"
    down_rows = rows_writing_pairs(rows, e_local, h, i_local, dtype, device_name)
    df = af if down_rows == rows else (
        f"{down_rows} x K ({device_name}'s tile tables: larger steps sum the top-k in down)")
    gf = f"max over BLOCK_M of min(P, ceil(P/BLOCK_M) + E/ep) x BLOCK_M, P = {af}"
    knobs = BUDGET_KNOBS
    recs = [
        BufferRecord("moe.router.topk_ids", (m_max, k), "int32", "M_max x K", knobs),
        BufferRecord("moe.router.topk_weights", (m_max, k), "float32", "M_max x K", knobs),
        BufferRecord("moe.runner.pair_token", (pairs,), "int32", pf, knobs),
        BufferRecord("moe.runner.gate_up", (pairs, 2 * i_local), dtype, f"{pf} x 2I/moe_tp", knobs),
        BufferRecord("moe.runner.sorted_pairs", (grouped,), "int32", gf, knobs),
        *(BufferRecord(f"moe.runner.{name}", (blocks,), "int32",
                       f"max over BLOCK_M of min(P, ceil(P/BLOCK_M) + E/ep), P = {af}", knobs)
          for name in ("block_expert", "block_rows")),
        BufferRecord("moe.runner.act", (grouped, i_local), dtype, f"({gf}) x I/moe_tp", knobs),
        BufferRecord("moe.runner.down", (down_rows * k, h), dtype, f"{df} x H", knobs),
        BufferRecord("moe.runner.align", (align_scratch_len(all_pairs, e_local),), "int32",
                     f"(1 + ceil(P/{ALIGN_CHUNK})) x pow2(E/ep, >= 16), P = {af}", knobs),
    ]
    if layout.dp_gather:
        # every rank sends its ceil(T/attn_tp) rows, padded to the largest: one collective
        rows = layout.tp * math.ceil(budget.max_tokens / layout.attn_tp)
        recs.append(BufferRecord("dp_gather.hidden", (rows, h), dtype,
                                 "tp x ceil(T_max/attn_tp) x H (padded uneven all-gather)",
                                 ("--dp-size", *knobs)))
    if layout.sp or layout.dense_scattered:
        recs.append(BufferRecord("attn_tp_gather.hidden",
                                 (layout.attn_tp * math.ceil(budget.max_tokens / layout.attn_tp),
                                  h), dtype, "attn_tp x ceil(T_max/attn_tp) x H",
                                 ("--tp-size", "--dp-size", *knobs)))
    return recs


def decode_graph_records(spec: ModelSpec, layout: ParallelLayout,
                         budget: TokenBudget) -> list[BufferRecord]:
    if not budget.decode_batch_sizes:
        return []
    bs = max(budget.decode_batch_sizes)
    t = budget.decode_graph
    recs = [
        BufferRecord("graph.decode.input_ids", (t,), "int64", "max bucket x tokens/request",
                     GRAPH_KNOBS),
        BufferRecord("graph.decode.positions", (t,), "int64", "max bucket x tokens/request",
                     GRAPH_KNOBS),
        BufferRecord("graph.decode.out_cache_loc", (t,), "int64", "max bucket x tokens/request",
                     GRAPH_KNOBS),
        BufferRecord("graph.decode.req_pool_indices", (bs,), "int64", "max bucket", GRAPH_KNOBS),
        BufferRecord("graph.decode.seq_lens", (bs,), "int32", "max bucket", GRAPH_KNOBS),
        BufferRecord("graph.decode.staging", (bs, 3), "int64",
                     "max bucket x (token, position, request row)", GRAPH_KNOBS),
        BufferRecord("graph.decode.logits", (t, spec.vocab_size), "float32",
                     "max bucket x tokens/request x vocab", GRAPH_KNOBS),
    ]
    if layout.dp > 1:
        recs.append(BufferRecord("graph.decode.dp_token_counts", (layout.dp,), "int32", "dp",
                                 ("--dp-size",)))
    return recs


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
