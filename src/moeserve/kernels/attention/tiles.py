"""The triton attention backend's choices, by measurement: the kernels' tiles, the decode
splits, and which extends go through torch's SDPA (pure Python: attention_triton.py reads these
at call time, so tools and tests may set them).

Measured on an H200, 2026-11-22, Qwen3-30B-A3B's heads (32 query, 4 KV, head dim 128), bf16;
the tables and the step timings are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

from typing import Optional

MAX_SPLITS = 64  # splits of a decode request's keys at most
# (largest batch, (BLOCK_N, num_warps, num_stages)) of the decode partial kernel: the first
# entry whose bound holds the batch wins (a decode graph is captured per batch bucket, so
# the config may follow the batch, not the lengths). H200, 2026-11-22: the kernel alone by
# benchmarks/bench_decode_attention.py (1 x 32768 tokens: 80.3 us at the former (64, 4, 2),
# 36.8 at (64, 4, 3); 32 x 8192: 215.6, 138.4 at (128, 4, 2)) and the decode step by
# benchmarks/decode_timeline.py (ms, graph replays, (64, 4, 2) -> (64, 4, 3): context 512
# batch 1 2.576 -> 2.603, batch 8 8.205 -> 8.185; context 8192 batch 1 3.493 -> 2.982, batch 8
# 11.393 -> 10.014; (128, 4, 2): context 8192 batch 32 25.756 -> 21.621, context 512 batch 64
# 19.325 -> 19.084, but batch 1 2.576 -> 2.770). MAX_SPLITS 64 (only batches of 1-2 reach
# past 32): since the combine skips the splits that saw no keys, context 512 batch 1 2.577 ->
# 2.590 ms, context 32768 batch 1 3.993 -> 3.606 (before that skip, 64 splits cost 0.08 ms at
# context 512).
DECODE_TILES: tuple[tuple[int, tuple[int, int, int]], ...] = (
    (8, (64, 4, 3)),
    (1 << 62, (128, 4, 2)),
)
# Decode batches of at most this many requests run the decode attention's two kernels with
# layers/pdl.pdl_gate's EARLY (each lets the next kernel be placed before it waits), so that the
# output projection's programs are placed, and load their first weight tiles, while the
# attention still runs. H200, 2026-11-23, decode_timeline.py (Qwen3-30B-A3B shape, context
# 512, graph replays back to back, ms, two rounds): batch 1 2.574 / 2.574 -> 2.512 / 2.511;
# batch 2 3.649 / 3.652 -> 3.672 / 3.682; batch 8 and 64 level. The rope kernel too, or the
# norms too, lost that gain (2.611, 2.550 at batch 1); so did the projection's whole weight
# slice before its gate (a [2, 4096] tile: 2.547). As shipped (batch 1 only), two more
# rounds: 2.563 / 2.565 -> 2.501 / 2.501.
EARLY_PLACE_MAX_BATCH = 1
# (largest max_extend, (BLOCK_M, BLOCK_N, num_warps, num_stages)) of the extend kernel: the
# first entry whose bound holds the step's longest extend wins; and whether the key blocks
# before the diagonal skip the masks (without a window). Measured on an H200, 2026-11-22
# (benchmarks/bench_extend_attention.py, Qwen3-30B-A3B heads, bf16): 1024-token prompt best
# at (64, 64, 4, 2) 0.077 ms; 4096: (128, 64, 4, 4) 0.490 against 0.527 ms at (64, 64, 4, 2);
# 8192: 1.578 against 1.663; 2048 after 2048: 0.355 against 0.365. The split alone: 4096
# 0.660 -> 0.527 ms, 8192 2.101 -> 1.663.
EXTEND_TILES: tuple[tuple[int, tuple[int, int, int, int]], ...] = (
    (1024, (64, 64, 4, 2)),
    (1 << 62, (128, 64, 4, 4)),
)
EXTEND_SPLIT = True
# A step whose requests all start fresh (no cached prefix) and whose longest extend has at
# least this many tokens (bf16/fp16, no window) runs torch's SDPA on each request instead:
# its keys are exactly its new tokens, gathered from their slots (2 T K D elements, small
# against the T^2 work), and SDPA (cuDNN's flash kernel) outruns the extend kernel on long prompts
# (H200, bench_extend_attention.py: 4096 tokens 0.295 against 0.506 ms, 8192 0.922 against
# 1.576; at 1024 0.062 against 0.083 before the gather and the output copy). Its
# temporaries (the gathered K/V, SDPA's output) are activations of the step, like the
# projections' outputs, outside the static budget.
SDPA_MIN_EXTEND = 2048
# torch's cuDNN attention builds a plan per sequence length, ~45 ms the first time a length is
# seen (H200, bench_extend_attention.py --first-calls), so a request's length is padded up to a
# multiple of this many tokens, and the startup builds every such length (warm_up). Padded
# queries come last: under the causal mask no real query sees a padded key.
SDPA_BUCKET = 256
# ... and only up to this many tokens (the startup builds (SDPA_MAX_EXTEND - SDPA_MIN_EXTEND)
# / SDPA_BUCKET + 1 = 57 plans at most): longer extends take the extend kernel
SDPA_MAX_EXTEND = 16384


def sdpa_length(n: int) -> int:
    return -(-n // SDPA_BUCKET) * SDPA_BUCKET


def sdpa_warm_lengths(min_extend: int, max_extend: int) -> list[int]:
    """Every padded length an extend of min_extend..max_extend tokens takes through SDPA (up
    to SDPA_MAX_EXTEND): what a backend's startup warm-up runs once each."""
    if max_extend < min_extend:
        return []
    top = sdpa_length(min(max_extend, SDPA_MAX_EXTEND))
    return list(range(sdpa_length(min_extend), top + 1, SDPA_BUCKET))


def extend_tiles(max_extend: int) -> tuple[int, int, int, int]:
    return next(t for bound, t in EXTEND_TILES if max_extend <= bound)


SPLIT_FILL = 2  # decode programs per SM that the splits aim at


# One split (no combine: the decode kernel writes the output itself) once the batch's
# programs, one per (request, KV head or head block), reach this share of the SMs. H200,
# decode graphs at context 512, session 16 and 17 (RESULTS.md):
# - GQA (Qwen3-30B-A3B, 4 KV heads): batch 64 17.48 -> 17.10 ms (one split, not two), 128
#   19.47 -> 18.76, 256 22.71 -> 21.36; batch 32 (128 programs) 15.24 -> 15.15 ms; batch 24
#   (96 programs) level, 14.01 -> 14.06.
# - latent attention (DeepSeek-V2-Lite, one head block): batch 96 10.71 -> 10.55 ms, 128
#   11.18 -> 10.78, 160 12.20 -> 11.60, 256 13.62 -> 11.79; batch 64 9.97 -> 10.26 (worse).
GQA_WHOLE_FROM = 0.9
MLA_WHOLE_FROM = 0.7


def decode_num_splits(batch_size: int, kv_heads: int, num_sms: int,
                      whole_from: Optional[float] = None) -> int:
    """Splits of each request's keys: enough programs to fill the GPU SPLIT_FILL times over,
    from the batch size alone (a CUDA graph fixes it per bucket; lengths stay on the device).
    With whole_from (kernels that write the output themselves from one split): one split
    once batch_size x kv_heads programs reach whole_from x num_sms."""
    if whole_from is not None and batch_size * kv_heads >= whole_from * num_sms:
        return 1
    want = -(-SPLIT_FILL * num_sms // max(1, batch_size * kv_heads))
    return max(1, min(MAX_SPLITS, want))


# The decode partials (one row per request and split, for the combine) come from the plan
# (plan/buffers.attention_records), which is made from the config alone, before any device
# is known: it holds the most request x split slots the rule above takes on a device of up
# to PLANNED_SMS SMs (the H100 and H200 have 132, the B200 148). On a device with more, a
# step's splits are clamped to the slots (clamp_splits): a little less parallel, never a
# buffer sized from the device.
PLANNED_SMS = 160


def partial_slots(kv_heads: int, whole_from: float, max_batch: int) -> int:
    """The most batch_size x splits that decode_num_splits takes over batches of 1..max_batch
    that it splits, on PLANNED_SMS SMs; 0 when it splits none."""
    top = min(max_batch, -(-int(whole_from * PLANNED_SMS) // max(1, kv_heads)))
    most = 0
    for bs in range(1, top + 1):
        splits = decode_num_splits(bs, kv_heads, PLANNED_SMS, whole_from)
        if splits > 1:
            most = max(most, bs * splits)
    return most


def clamp_splits(splits: int, batch_size: int, slots: int) -> int:
    """splits, or fewer so that batch_size x splits fits in the plan's slots (1: the kernel
    writes the output itself and needs none)."""
    if splits == 1 or batch_size * splits <= slots:
        return splits
    return max(1, slots // batch_size)


def decode_tiles(batch_size: int) -> tuple[int, int, int]:
    return next(t for bound, t in DECODE_TILES if batch_size <= bound)


# Latent attention (MLA, mla_triton.py). A program's rows are BLOCK_T tokens x BLOCK_H heads
# (a tl.dot takes 16 rows at least). Decode: (BLOCK_H, BLOCK_T, BLOCK_N, num_warps,
# num_stages), one token a request, 16 heads a program (heads past N are masked rows). H200,
# 2026-11-22, DeepSeek-V2-Lite dims (benchmarks/bench_mla.py --decode-tiles, 7 others at
# batch 1 / 8 / 64 x context 512 / 4096 / 16384): best at 6 of the 9; (64, 4, 2) gains up to
# 10% at batch <= 8 with 16384 cached tokens and loses 10-15% at 512.
MLA_DECODE_TILES = (16, 1, 32, 4, 2)
# (BLOCK_N, num_warps, num_stages) of a latent decode in one split (MLA_WHOLE_FROM): fewer
# programs, each reading a whole request. H200, session 17, one layer's attention
# (bench_mla.py --decode-tiles, µs), (32, 4, 2) -> (64, 4, 2): batch 128 / 256 at context 512
# 59.8 -> 49.4 / 71.0 -> 64.3, at 2048 187.0 -> 139.0 / 224.0 -> 181.6; batch 64 (5 splits)
# 46.0 -> 47.0 and 84.5 -> 89.7, so split batches keep MLA_DECODE_TILES.
MLA_WHOLE_DECODE_TILES = (64, 4, 2)
MLA_EXTEND_ROWS = 32  # rows of an extend program: up to 16 heads, the rest tokens
MLA_EXTEND_TILES = (32, 4, 2)  # (BLOCK_N, num_warps, num_stages) of the extend kernel
MLA_COMBINE_BLOCK_D = 128  # latent dims per program of the split combine
# A request of at least this many new tokens (and at most SDPA_MAX_EXTEND keys) runs latent
# attention in the expanded form through SDPA (mla_triton.mla_sdpa): 2 (P + R + V)
# FLOPs per (query, key) pair and head at cuDNN's rate, against the absorbed kernel's
# 2 (2C + R). Fresh prompts' lengths are padded to SDPA_BUCKET and built at startup as for
# GQA; after a cached prefix the mask is aligned to the last key (no per-length plan). H200,
# 2026-11-22, DeepSeek-V2-Lite with dummy weights, one prompt through the prefill graphs
# (benchmarks/prefill_host.py, device ms): 1024 tokens 15.18 against 17.57 on the kernel,
# 4096 tokens 45.58 against 79.55. One layer's attention alone (bench_mla.py, eager, bound by
# its host below 1024 tokens): 4096 tokens 0.372 against 1.734 ms; 512 tokens 0.223 against
# 0.128 ms. Session 10, the same prefill by threshold, alternating runs: 768 tokens 12.11 /
# 12.59 through SDPA against 13.88 / 13.92 / 14.12 / 14.29 on the kernel; at 512 one run gave
# 9.82 against 10.14-10.69 and another 15.60 (the replay bound by its host), at 384 10.14
# against 9.20 / 9.65: so from 768.
MLA_SDPA_MIN_EXTEND = 768
# Steps of at most this many tokens apply kv_b_proj's two halves (W_UK to the queries, W_UV
# to the attention's output) by the GEMVs of mla_kernels.py, more by torch.bmm (cuBLAS). H200,
# DeepSeek-V2-Lite decode graphs, context 512 (bench_mla.py --parts e2e
# --mla-head-gemv-max-tokens G, alternating runs), ms/step GEMVs against bmm: batch 1 2.268 /
# 2.290 against 2.331 / 2.353, batch 2 3.073 / 3.091 against 3.181 / 3.190; batch 4 4.583 /
# 4.689 against 4.569 / 4.606; batch 8 (session 10) 6.882 / 6.658 against 6.598 / 6.446.
MLA_HEAD_GEMV_MAX_TOKENS = 2


def mla_extend_tiles(heads: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_H, BLOCK_T, BLOCK_N, num_warps, num_stages) of the extend kernel for `heads`
    local heads."""
    block_h = min(16, 1 << (max(1, heads) - 1).bit_length())
    return (block_h, MLA_EXTEND_ROWS // block_h) + MLA_EXTEND_TILES
