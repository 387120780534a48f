"""The triton attention backends' choices: the kernels' tiles, the decode splits, and which
extends go through torch's SDPA. Pure Python (no Triton), so that the plan can read them on
any install.

`AttentionTiles` is immutable; a backend holds one (the shipped `ATTENTION_TILES` unless it is
given another), so tests and benchmarks try other choices with `dataclasses.replace` on a
backend of their own, never by changing this module. The figures behind each entry (an H200,
Qwen3-30B-A3B's and DeepSeek-V2-Lite's heads, bf16; the GQA decode tiles past 32 requests an
H100) are in benchmarks/RESULTS.md, sections "Decode attention", "Extend attention" and
"Latent attention (MLA)", or beside the entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DecodeTiles = tuple[int, int, int]  # (BLOCK_N, num_warps, num_stages)
ExtendTiles = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
MLATiles = tuple[int, int, int, int, int]  # (BLOCK_H, BLOCK_T, BLOCK_N, warps, stages)


@dataclass(frozen=True)
class AttentionTiles:
    # -- GQA decode -----------------------------------------------------------------------
    # (largest batch, tiles) of the decode partial kernel, the first entry whose bound holds
    # the batch winning (a decode graph is captured per batch bucket, so the tiles follow
    # the batch, not the lengths): 3 stages hide the key loads of few long requests; BLOCK_N
    # 128 up to 32 requests, whose programs each read a whole long request (H100, 32 x 8192
    # keys: 207 us against 232 with 64-key blocks; 3 stages took 185, but stage 192 KiB of
    # K and V tiles at head dim 128, more shared memory than some GPUs give a program);
    # past 32, 64-key blocks with 3 stages, two programs an SM (H100, against (128, 4, 2):
    # 64 x 512 keys 28.2 against 32.0 us, 64 x 4096 186 against 202, 256 x 2048 level).
    decode: tuple[tuple[int, DecodeTiles], ...] = ((8, (64, 4, 3)), (32, (128, 4, 2)),
                                                   (1 << 62, (64, 4, 3)))
    # splits of a request's keys at most: only batches of 1-2 reach past 32, and the combine
    # skips the splits that saw no keys, so short contexts lose nothing by the bound
    max_splits: int = 64
    split_fill: int = 2  # decode programs per SM that the splits aim at
    # one split (the decode kernel writes the output, no combine) once a batch's programs,
    # one per (request, KV head or head block), reach this share of the SMs: the batch then
    # nearly fills the GPU alone, and splits would add the combine for little parallelism
    gqa_whole_from: float = 0.9
    mla_whole_from: float = 0.7
    # decode batches of at most this many requests let the next kernel be placed before
    # the attention's kernels wait (layers/pdl.pdl_gate's EARLY), so the output projection
    # loads its first weight tiles while the attention runs; from batch 2 the attention
    # keeps the SMs busy and the early placement gains nothing
    early_place_max_batch: int = 1

    # -- GQA extend -----------------------------------------------------------------------
    # (largest max_extend, tiles) of the extend kernel, the first entry whose bound holds the
    # step's longest extend winning: short prompts want the smaller query blocks (more
    # programs), long ones BLOCK_M 128 with 4 stages (fewer passes over their keys)
    extend: tuple[tuple[int, ExtendTiles], ...] = ((1024, (64, 64, 4, 2)),
                                                   (1 << 62, (128, 64, 4, 4)))
    # key blocks before the diagonal skip the masks (without a window): most blocks of a
    # long prompt need none
    extend_split: bool = True
    # a step whose requests all start fresh and whose longest extend has at least this many
    # tokens (bf16/fp16, no window) runs torch's SDPA on each request: its keys are exactly
    # its new tokens (a gather small against the T^2 work), and cuDNN's flash kernel outruns
    # the extend kernel there. Its temporaries are activations of the step, outside the
    # static budget.
    sdpa_min_extend: int = 2048
    # cuDNN builds a plan per sequence length (~45 ms the first time), so a request's length
    # is padded up to a multiple of this and the startup builds every such length (warm_up);
    # padded queries come last, where the causal mask hides them from real queries
    sdpa_bucket: int = 256
    # and only up to this many tokens, which bounds the plans the startup builds
    # ((max - min) / bucket + 1 = 57); longer extends take the extend kernel
    sdpa_max_extend: int = 16384

    # -- latent attention (MLA, layers/mla_triton.py) ---------------------------------------
    # decode: one token a request, 16 heads a program (a tl.dot takes 16 rows at least;
    # heads past N are masked rows): the best at most batches (1-64) and contexts
    # (512-16384); longer key blocks gain only on few requests of very long contexts
    mla_decode: MLATiles = (16, 1, 32, 4, 2)
    # (BLOCK_N, warps, stages) of a decode in one split: fewer programs, each reading a whole
    # request, want wider key blocks; split batches keep mla_decode's
    mla_whole_decode: DecodeTiles = (64, 4, 2)
    mla_extend_rows: int = 32  # rows of an extend program: up to 16 heads, the rest tokens
    mla_extend: DecodeTiles = (32, 4, 2)  # (BLOCK_N, warps, stages) of the extend kernel
    mla_combine_block_d: int = 128  # latent dims per program of the split combine
    # a request of at least this many new tokens (and at most sdpa_max_extend keys) runs in
    # the expanded form through SDPA (mla_triton.mla_sdpa): 2 (P + R + V) FLOPs per (query,
    # key) pair and head at cuDNN's rate beat the absorbed kernel's 2 (2C + R) from here on
    mla_sdpa_min_extend: int = 768
    # steps of at most this many tokens apply kv_b_proj's halves by the GEMVs of
    # kernels/mla/kernels.py (one PDL chain), more by torch.bmm (cuBLAS), as fast or faster
    # from 4 tokens
    mla_head_gemv_max_tokens: int = 2

    # -- lookups ----------------------------------------------------------------------------
    def decode_tiles(self, batch_size: int) -> DecodeTiles:
        return next(t for bound, t in self.decode if batch_size <= bound)

    def extend_tiles(self, max_extend: int) -> ExtendTiles:
        return next(t for bound, t in self.extend if max_extend <= bound)

    def mla_extend_tiles(self, heads: int) -> MLATiles:
        """(BLOCK_H, BLOCK_T, BLOCK_N, num_warps, num_stages) of the extend kernel for `heads`
        local heads."""
        block_h = min(16, 1 << (max(1, heads) - 1).bit_length())
        return (block_h, self.mla_extend_rows // block_h) + self.mla_extend

    def sdpa_length(self, n: int) -> int:
        return -(-n // self.sdpa_bucket) * self.sdpa_bucket

    def sdpa_warm_lengths(self, min_extend: int, max_extend: int) -> list[int]:
        """Every padded length an extend of min_extend..max_extend tokens takes through SDPA
        (up to sdpa_max_extend): what a backend's startup warm-up runs once each."""
        if max_extend < min_extend:
            return []
        top = self.sdpa_length(min(max_extend, self.sdpa_max_extend))
        return list(range(self.sdpa_length(min_extend), top + 1, self.sdpa_bucket))

    def decode_num_splits(self, batch_size: int, kv_heads: int, num_sms: int,
                          whole_from: Optional[float] = None) -> int:
        """Splits of each request's keys: enough programs to fill the GPU split_fill times
        over, from the batch size alone (a CUDA graph fixes it per bucket; lengths stay on the
        device). With whole_from (kernels that write the output themselves from one split):
        one split once batch_size x kv_heads programs reach whole_from x num_sms."""
        if whole_from is not None and batch_size * kv_heads >= whole_from * num_sms:
            return 1
        want = -(-self.split_fill * num_sms // max(1, batch_size * kv_heads))
        return max(1, min(self.max_splits, want))

    def partial_slots(self, kv_heads: int, whole_from: float, max_batch: int) -> int:
        """The most batch_size x splits that decode_num_splits takes over batches of
        1..max_batch that it splits, on PLANNED_SMS SMs; 0 when it splits none."""
        top = min(max_batch, -(-int(whole_from * PLANNED_SMS) // max(1, kv_heads)))
        most = 0
        for bs in range(1, top + 1):
            splits = self.decode_num_splits(bs, kv_heads, PLANNED_SMS, whole_from)
            if splits > 1:
                most = max(most, bs * splits)
        return most


ATTENTION_TILES = AttentionTiles()  # the shipped choices

# The decode partials (one row per request and split, for the combine) come from the plan
# (plan/buffers.attention_records), which is made from the config alone, before any device
# is known: it holds the most request x split slots the rule above takes on a device of up
# to PLANNED_SMS SMs (the H100 and H200 have 132, the B200 148). On a device with more, a
# step's splits are clamped to the slots (clamp_splits): a little less parallel, never a
# buffer sized from the device.
PLANNED_SMS = 160


def clamp_splits(splits: int, batch_size: int, slots: int) -> int:
    """splits, or fewer so that batch_size x splits fits in the plan's slots (1: the kernel
    writes the output itself and needs none)."""
    if splits == 1 or batch_size * splits <= slots:
        return splits
    return max(1, slots // batch_size)
