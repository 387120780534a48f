"""The "triton" attention backend: paged GQA attention on the GPU (kernels in
attention_kernels.py, imported on first use so that CPU-only installs never import Triton).

Why own Triton kernels rather than SDPA or FlexAttention: the keys of a request are scattered
over the pool's slots. SDPA needs them contiguous, i.e. a gather copy of every request's K/V
per layer and step (the decode step would move the KV bytes three times instead of once, and
the padded [B, S_max] copy needs the max length on the host: a sync, no graph). FlexAttention
reads paged K/V only through a block mask rebuilt from the lengths every step, and compiles
per shape. The kernels here read each K/V row once, straight through req_to_token, take every
length from device tensors, and launch a grid fixed by the batch size: decode is
graph-capturable as it is.

One exception: long prompts without a cached prefix. Their keys are only their new tokens,
so the gather is small against the quadratic work, and SDPA's flash kernel is faster there
than the extend kernel (SDPA_MIN_EXTEND). The prefill graphs run attention eagerly, so this
choice is made per step, on the host's lengths.

Per-step metadata (query offsets of an extend, the split buffers of a decode) is computed once
per ForwardBatch and shared by the layers (the backend is one object for the whole model).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch
import torch.nn.functional as F

from moeserve.layers.attention import AttentionBackend, register_attention_backend
from moeserve.runtime.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from moeserve.layers.attention import PagedAttention

NO_WINDOW = 1 << 30
LOG2E = 1.4426950408889634
MAX_SPLITS = 64
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


def decode_tiles(batch_size: int) -> tuple[int, int, int]:
    return next(t for bound, t in DECODE_TILES if batch_size <= bound)
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
# against the T^2 work), and SDPA's flash kernel outruns the extend kernel on long prompts
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


def extend_tiles(max_extend: int) -> tuple[int, int, int, int]:
    return next(t for bound, t in EXTEND_TILES if max_extend <= bound)


def decode_num_splits(batch_size: int, kv_heads: int, num_sms: int) -> int:
    """Splits of each request's keys: enough programs to fill the GPU twice over, from the
    batch size alone (a CUDA graph fixes it per bucket; lengths stay on the device)."""
    want = -(-2 * num_sms // max(1, batch_size * kv_heads))
    return max(1, min(MAX_SPLITS, want))


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(1, n) - 1).bit_length())


def _sdpa_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether fresh prompts may go through SDPA: a GPU, half precision, and a head dim that
    its flash-class kernels take (multiples of 8 up to 256; others would fall to its math
    path, whose [T, T] scores a long prompt cannot afford)."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and head_dim % 8 == 0 and head_dim <= 256)


class _StepMeta:
    """What every layer of one forward shares."""

    def __init__(self, fb: ForwardBatch, q: torch.Tensor, num_kv_heads: int, num_sms: int):
        self.fb = fb
        dev = q.device
        if fb.mode is ForwardMode.DECODE:
            bs, n, d = fb.batch_size, q.shape[1], q.shape[2]
            self.splits = decode_num_splits(bs, num_kv_heads, num_sms)
            self.part_o = torch.empty(bs, n, self.splits, d, dtype=torch.float32, device=dev)
            self.part_lse = torch.empty(bs, n, self.splits, dtype=torch.float32, device=dev)
        else:
            lens = fb.extend_seq_lens_cpu
            starts = [0]
            for e in lens[:-1]:
                starts.append(starts[-1] + e)
            self.q_starts = torch.tensor(starts, dtype=torch.int64).to(dev, non_blocking=True)
            self.max_extend = max(lens, default=0)
            # (first row, tokens) of each request when the step goes through SDPA, else None
            self.sdpa: Optional[list[tuple[int, int]]] = None
            if (_sdpa_takes(dev, q.dtype, q.shape[-1])
                    and SDPA_MIN_EXTEND <= self.max_extend <= SDPA_MAX_EXTEND
                    and not any(fb.extend_prefix_lens_cpu)):
                self.sdpa = [(s, n) for s, n in zip(starts, lens) if n]


@register_attention_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    graph_capturable: ClassVar[bool] = True

    def __init__(self) -> None:
        self._meta: Optional[_StepMeta] = None
        self._num_sms: dict[torch.device, int] = {}

    def warm_up(self, layer: "PagedAttention", max_extend: int, dtype: torch.dtype,
                device: torch.device) -> list[int]:
        """SDPA once at every padded length a fresh prompt of up to max_extend tokens can take
        (cuDNN builds each length's plan on its first call)."""
        if (not _sdpa_takes(device, dtype, layer.head_dim) or layer.sliding_window
                or max_extend < SDPA_MIN_EXTEND):
            return []
        top = sdpa_length(min(max_extend, SDPA_MAX_EXTEND))
        lengths = list(range(sdpa_length(SDPA_MIN_EXTEND), top + 1, SDPA_BUCKET))
        for t in lengths:
            q = torch.zeros(t, layer.num_heads, layer.head_dim, dtype=dtype, device=device)
            kv = torch.zeros(t, layer.num_kv_heads, layer.head_dim, dtype=dtype, device=device)
            _sdpa(q, kv, kv, layer.scaling)
        return lengths

    def _step_meta(self, q: torch.Tensor, layer: "PagedAttention", fb: ForwardBatch
                   ) -> _StepMeta:
        if self._meta is None or self._meta.fb is not fb:
            dev = q.device
            if dev not in self._num_sms:  # (a CPU device: Triton's interpreter, in tests)
                self._num_sms[dev] = (torch.cuda.get_device_properties(dev).multi_processor_count
                                      if dev.type == "cuda" else 8)
            self._meta = _StepMeta(fb, q, layer.num_kv_heads, self._num_sms[dev])
        return self._meta

    def forward(self, q_TND: torch.Tensor, layer: "PagedAttention", fb: ForwardBatch,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`out` [T, N, D]: where to write (a prefill graph's static buffer); rows of no
        request are left as they are."""
        from moeserve.layers import attention_kernels as K
        from moeserve.layers.pdl import pdl_args

        out_TND = torch.empty_like(q_TND) if out is None else out
        t, n, d = q_TND.shape
        if fb.mode is ForwardMode.IDLE or t == 0:
            return out_TND
        if q_TND.stride(-1) != 1:
            q_TND = q_TND.contiguous()
        if n % layer.num_kv_heads:
            raise ValueError(f"{n} query heads do not group over {layer.num_kv_heads} KV heads")
        meta = self._step_meta(q_TND, layer, fb)
        k_cache = fb.kv_pool.k_cache(layer.layer_id)
        v_cache = fb.kv_pool.v_cache(layer.layer_id)
        table = fb.req_to_token
        group = n // layer.num_kv_heads
        block_d = _pow2(d)
        window = layer.sliding_window or NO_WINDOW
        scale = layer.scaling * LOG2E
        ieee = k_cache.dtype == torch.float32
        if fb.mode is ForwardMode.DECODE:
            bs = fb.batch_size
            assert t == bs, f"a decode batch has one token per request: {t} tokens, {bs} rows"
            po, pl = meta.part_o, meta.part_lse
            block_n, warps, stages = decode_tiles(bs)
            pdl = pdl_args(q_TND.device)
            K.decode_partial_kernel[(bs, layer.num_kv_heads, meta.splits)](
                q_TND, k_cache, v_cache, table, fb.req_pool_indices, fb.seq_lens, po, pl,
                q_TND.stride(0), q_TND.stride(1), k_cache.stride(0), k_cache.stride(1),
                v_cache.stride(0), v_cache.stride(1), table.stride(0),
                po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
                scale, window, meta.splits,
                GROUP=group, BLOCK_G=_pow2(group), HEAD_DIM=d, BLOCK_D=block_d,
                BLOCK_N=block_n, IEEE=ieee, num_warps=warps, num_stages=stages, **pdl)
            K.decode_combine_kernel[(bs, n)](
                po, pl, out_TND, po.stride(0), po.stride(1), po.stride(2), pl.stride(0),
                pl.stride(1), out_TND.stride(0), out_TND.stride(1), meta.splits,
                HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=_pow2(MAX_SPLITS, 2), num_warps=4,
                **pdl)
            return out_TND
        if meta.max_extend == 0:
            return out_TND
        if meta.sdpa is not None and window >= NO_WINDOW:
            sdpa_fresh(q_TND, k_cache, v_cache, out_TND, fb.out_cache_loc, meta.sdpa,
                       layer.scaling)
            return out_TND
        launch_extend(q_TND, k_cache, v_cache, out_TND, table, fb.req_pool_indices,
                      fb.extend_prefix_lens, fb.extend_seq_lens, meta.q_starts,
                      meta.max_extend, group, scale, window)
        return out_TND


def describe() -> dict[str, Any]:
    """Tile constants, for benchmark reports."""
    return {"decode_tiles": DECODE_TILES, "max_splits": MAX_SPLITS,
            "extend_tiles": EXTEND_TILES, "extend_split": EXTEND_SPLIT}


def sdpa_fresh(q_TND: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out_TND: torch.Tensor, out_cache_loc: torch.Tensor,
               requests: list[tuple[int, int]], scaling: float) -> None:
    """Causal attention of requests without a cached prefix through torch's SDPA: request
    (s, n) has query rows [s, s + n) and, as keys, exactly those tokens, in the slots
    out_cache_loc[s:s + n] (already written). Each runs at its length padded to SDPA_BUCKET
    (zero queries, copies of the last key)."""
    for s, n in requests:
        t = sdpa_length(n)
        loc = out_cache_loc[s:s + n]
        q = q_TND[s:s + n]
        if t > n:
            loc = torch.cat((loc, loc[-1:].expand(t - n)))
            q = torch.cat((q, q.new_zeros(t - n, *q.shape[1:])))
        o = _sdpa(q, k_cache.index_select(0, loc), v_cache.index_select(0, loc), scaling)
        out_TND[s:s + n].copy_(o[:n])


def _sdpa(q_TND: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
          scaling: float) -> torch.Tensor:
    """Causal GQA attention of one request's [T, heads, D] tensors -> [T, N, D] (a view)."""
    o = F.scaled_dot_product_attention(q_TND.transpose(0, 1)[None], k_TKD.transpose(0, 1)[None],
                                       v_TKD.transpose(0, 1)[None], is_causal=True,
                                       scale=scaling, enable_gqa=True)
    return o[0].transpose(0, 1)


def launch_extend(q_TND: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out_TND: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                  prefix_lens: torch.Tensor, extend_lens: torch.Tensor, q_starts: torch.Tensor,
                  max_extend: int, group: int, scale_log2: float, window: int,
                  tiles: Optional[tuple[int, int, int, int]] = None,
                  split: Optional[bool] = None) -> None:
    """The extend kernel over a batch's new tokens (query rows of request b from q_starts[b];
    its keys through table row rows[b]); `tiles` and `split` default to the shipped ones
    (benchmarks/bench_extend_attention.py measures the alternatives)."""
    from moeserve.layers import attention_kernels as K

    block_m, block_n, warps, stages = tiles or extend_tiles(max_extend)
    d = q_TND.shape[2]
    block_d = _pow2(d)
    if split is None:
        split = EXTEND_SPLIT
    split = split and window >= NO_WINDOW and block_d == d
    grid = (rows.shape[0], q_TND.shape[1], math.ceil(max_extend / block_m))
    K.extend_kernel[grid](
        q_TND, k_cache, v_cache, out_TND, table, rows, prefix_lens, extend_lens, q_starts,
        q_TND.stride(0), q_TND.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), table.stride(0),
        out_TND.stride(0), out_TND.stride(1), scale_log2, window,
        GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=k_cache.dtype == torch.float32, SPLIT=split, num_warps=warps, num_stages=stages)
