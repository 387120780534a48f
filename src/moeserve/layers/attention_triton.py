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
so the gather is small against the quadratic work, and SDPA (cuDNN's flash kernel) is faster
there than the extend kernel. Each runs at its length padded to a bucket, and the startup
builds cuDNN's plan for every bucket (warm_up), so that no request pays for a build. The
prefill graphs run attention eagerly, so this choice is made per step, on the host's
lengths. The tiles and these thresholds are the backend's table (kernels/attention/tiles.py).

Per-step metadata (query offsets of an extend, the split buffers of a decode) is computed once
per ForwardBatch and shared by the layers (the backend is one object for the whole model).
The decode's partials are views of the plan's attn.decode.* buffers (plan/buffers.py), which
the binder gives the backend (bind_partials); its splits are clamped to fit them.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Callable, ClassVar, Optional

import torch
import torch.nn.functional as F

from moeserve.kernels.attention.tiles import ATTENTION_TILES, AttentionTiles, clamp_splits
from moeserve.layers.attention import ATTENTION_BACKENDS, AttentionBackend, query_starts
from moeserve.batch.buffers import AttentionPartials
from moeserve.batch.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from moeserve.layers.attention import PagedAttention

NO_WINDOW = 1 << 30
LOG2E = 1.4426950408889634
def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(1, n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """The device's SMs (8 for a CPU device: Triton's interpreter, in tests)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def _sdpa_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether fresh prompts may go through SDPA: a GPU, half precision, and a head dim that
    its flash-class kernels take (multiples of 8 up to 256; others would fall to its math
    path, whose [T, T] scores a long prompt cannot afford)."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and head_dim % 8 == 0 and head_dim <= 256)


Partials = tuple[torch.Tensor, torch.Tensor]  # the plan's attn.decode.part_o / part_lse


def decode_splits(tiles: AttentionTiles, batch_size: int, groups: int, device: torch.device,
                  whole_from: float, planned: Optional[Partials]) -> int:
    """A decode step's splits of each request's keys (tiles.decode_num_splits over `groups`
    programs a request), clamped to the plan's partial slots when given."""
    splits = tiles.decode_num_splits(batch_size, groups, num_sms(device), whole_from)
    return splits if planned is None else clamp_splits(splits, batch_size, planned[0].shape[0])


def partial_views(planned: Optional[Partials], bs: int, n: int, splits: int, width: int,
                  device: torch.device) -> Partials:
    """[bs, n, splits, width] and [bs, n, splits] fp32 partials: views of the plan's buffers
    (the binder gives them to the backend), or new tensors for a backend used on its own
    (tests, benchmarks)."""
    if planned is None:
        f32 = dict(dtype=torch.float32, device=device)
        return torch.empty(bs, n, splits, width, **f32), torch.empty(bs, n, splits, **f32)
    o, lse = planned
    assert bs * splits <= o.shape[0] and o.shape[1:] == (n, width), (bs, splits, o.shape)
    return (o.view(-1)[: bs * n * splits * width].view(bs, n, splits, width),
            lse.view(-1)[: bs * n * splits].view(bs, n, splits))


class PlannedPartials:
    """A triton backend: it holds its tile table (the shipped one unless given another), and
    its decode partials come from the plan's attn.decode.* buffers, which the binder gives it
    (bind_partials); without them it allocates its own."""

    _partials: Optional[Partials] = None

    def __init__(self, tiles: AttentionTiles = ATTENTION_TILES) -> None:
        self.tiles = tiles

    def bind_partials(self, partials: Optional[AttentionPartials]) -> None:
        """The plan's attn.decode.* buffers, which every decode step's splits then fit (None:
        the plan splits no batch it allows, and a split step allocates its own)."""
        self._partials = None if partials is None else (partials.part_o, partials.part_lse)


class _StepMeta:
    """What every layer of one forward shares."""

    def __init__(self, fb: ForwardBatch, q: torch.Tensor, num_kv_heads: int,
                 planned: Optional[Partials], tiles: AttentionTiles):
        self.fb = fb
        dev = q.device
        if fb.mode is ForwardMode.DECODE:
            bs, n, d = fb.batch_size, q.shape[1], q.shape[2]
            self.splits = decode_splits(tiles, bs, num_kv_heads, dev, tiles.gqa_whole_from,
                                        planned)
            # partials only where a combine reads them (one split: the output directly)
            self.part_o = self.part_lse = None
            if self.splits > 1:
                self.part_o, self.part_lse = partial_views(planned, bs, n, self.splits, d, dev)
        else:
            lens = fb.extend_seq_lens_cpu
            starts = query_starts(lens)
            self.q_starts = torch.tensor(starts, dtype=torch.int64).to(dev, non_blocking=True)
            self.max_extend = max(lens, default=0)
            # (first row, tokens) of each request when the step goes through SDPA, else None
            self.sdpa: Optional[list[tuple[int, int]]] = None
            if (_sdpa_takes(dev, q.dtype, q.shape[-1])
                    and tiles.sdpa_min_extend <= self.max_extend <= tiles.sdpa_max_extend
                    and not any(fb.extend_prefix_lens_cpu)):
                self.sdpa = [(s, n) for s, n in zip(starts, lens) if n]


@ATTENTION_BACKENDS.register("triton")
class TritonAttentionBackend(PlannedPartials, AttentionBackend):
    graph_capturable: ClassVar[bool] = True

    def __init__(self, tiles: AttentionTiles = ATTENTION_TILES) -> None:
        super().__init__(tiles)
        self._meta: Optional[_StepMeta] = None

    def warm_up(self, layer: "PagedAttention", max_extend: int, dtype: torch.dtype,
                device: torch.device) -> list[int]:
        """SDPA once at every padded length a fresh prompt of up to max_extend tokens can take
        (cuDNN builds each length's plan on its first call)."""
        if not _sdpa_takes(device, dtype, layer.head_dim) or layer.sliding_window:
            return []
        lengths = self.tiles.sdpa_warm_lengths(self.tiles.sdpa_min_extend, max_extend)
        for t in lengths:
            q = torch.zeros(t, layer.num_heads, layer.head_dim, dtype=dtype, device=device)
            kv = torch.zeros(t, layer.num_kv_heads, layer.head_dim, dtype=dtype, device=device)
            _sdpa(q, kv, kv, layer.scaling)
        return lengths

    def _step_meta(self, q: torch.Tensor, layer: "PagedAttention", fb: ForwardBatch
                   ) -> _StepMeta:
        if self._meta is None or self._meta.fb is not fb:
            self._meta = _StepMeta(fb, q, layer.num_kv_heads, self._partials, self.tiles)
        return self._meta

    def quantizes_output(self, q_TND: torch.Tensor, layer: "PagedAttention",
                         fb: ForwardBatch, group: int) -> bool:
        """Whether forward can also hand back its output quantized per `group` columns
        (`quant_out`): a decode step that splits its keys, so that the combine's programs
        each hold one head, a head being one group."""
        return (fb.mode is ForwardMode.DECODE and q_TND.shape[0] > 0
                and q_TND.shape[2] == group == _pow2(group)
                and self._step_meta(q_TND, layer, fb).splits > 1)

    def forward(self, q_TND: torch.Tensor, layer: "PagedAttention", fb: ForwardBatch,
                out: Optional[torch.Tensor] = None,
                quant_out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                ) -> torch.Tensor:
        """`out` [T, N, D]: where to write (a prefill graph's static buffer); rows of no
        request are left as they are. `quant_out` (where quantizes_output: fp8 [T, N D] and
        float32 [T, N]): the output's rows also quantized there, a head a group, as
        fp8.gemm.quantize_groups would quantize them."""
        from moeserve.kernels.attention import kernels as K
        from moeserve.kernels.launch.pdl import pdl_args

        out_TND = torch.empty_like(q_TND) if out is None else out
        t, n, d = q_TND.shape
        if fb.mode is ForwardMode.IDLE or t == 0:
            return out_TND
        if q_TND.stride(-1) != 1:
            q_TND = q_TND.contiguous()
        if n % layer.num_kv_heads:
            raise ValueError(f"{n} query heads do not group over {layer.num_kv_heads} KV heads")
        meta = self._step_meta(q_TND, layer, fb)
        tiles = self.tiles
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
            direct = meta.splits == 1  # no partials: the kernel writes the output itself
            assert quant_out is None or not direct, "quant_out where quantizes_output"
            po, pl = ((out_TND[:, :, None], out_TND[:, :, 0]) if direct  # untouched stand-ins
                      else (meta.part_o, meta.part_lse))
            block_n, warps, stages = tiles.decode_tiles(bs)
            pdl = {**pdl_args(q_TND.device), "EARLY": bs <= tiles.early_place_max_batch}
            K.decode_partial_kernel[(bs, layer.num_kv_heads, meta.splits)](
                q_TND, k_cache, v_cache, table, fb.req_pool_indices, fb.seq_lens, po, pl,
                out_TND, q_TND.stride(0), q_TND.stride(1), k_cache.stride(0),
                k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), table.stride(0),
                po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
                out_TND.stride(0), out_TND.stride(1), scale, window, meta.splits,
                GROUP=group, BLOCK_G=_pow2(group), HEAD_DIM=d, BLOCK_D=block_d,
                BLOCK_N=block_n, IEEE=ieee, DIRECT=direct, num_warps=warps,
                num_stages=stages, **pdl)
            if direct:
                return out_TND
            qo, qs = quant_out if quant_out is not None else (out_TND, pl)  # stand-ins
            assert quant_out is None or (block_d == d and qo.shape == (bs, n * d)
                                         and qs.shape == (bs, n) and qo.stride(1) == 1)
            K.decode_combine_kernel[(bs, n)](
                po, pl, out_TND, qo, qs, po.stride(0), po.stride(1), po.stride(2),
                pl.stride(0), pl.stride(1), out_TND.stride(0), out_TND.stride(1), qo.stride(0),
                qs.stride(0), meta.splits, HEAD_DIM=d, BLOCK_D=block_d,
                BLOCK_S=_pow2(tiles.max_splits, 2), QUANT=quant_out is not None,
                num_warps=4, **pdl)
            return out_TND
        if meta.max_extend == 0:
            return out_TND
        if meta.sdpa is not None and window >= NO_WINDOW:
            sdpa_fresh(q_TND, k_cache, v_cache, out_TND, fb.out_cache_loc, meta.sdpa,
                       layer.scaling, tiles.sdpa_length)
            return out_TND
        launch_extend(q_TND, k_cache, v_cache, out_TND, table, fb.req_pool_indices,
                      fb.extend_prefix_lens, fb.extend_seq_lens, meta.q_starts,
                      meta.max_extend, group, scale, window,
                      tiles.extend_tiles(meta.max_extend), tiles.extend_split)
        return out_TND


def sdpa_fresh(q_TND: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out_TND: torch.Tensor, out_cache_loc: torch.Tensor,
               requests: list[tuple[int, int]], scaling: float,
               padded: Callable[[int], int]) -> None:
    """Causal attention of requests without a cached prefix through torch's SDPA: request
    (s, n) has query rows [s, s + n) and, as keys, exactly those tokens, in the slots
    out_cache_loc[s:s + n] (already written). Each runs at its length padded to `padded(n)`
    (the tiles' sdpa_length: zero queries, copies of the last key)."""
    for s, n in requests:
        t = padded(n)
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
    its keys through table row rows[b]); `tiles` and `split` default to the shipped table's
    (benchmarks/attention.py measures the alternatives)."""
    from moeserve.kernels.attention import kernels as K

    block_m, block_n, warps, stages = tiles or ATTENTION_TILES.extend_tiles(max_extend)
    d = q_TND.shape[2]
    block_d = _pow2(d)
    if split is None:
        split = ATTENTION_TILES.extend_split
    split = split and window >= NO_WINDOW and block_d == d
    grid = (rows.shape[0], q_TND.shape[1], math.ceil(max_extend / block_m))
    K.extend_kernel[grid](
        q_TND, k_cache, v_cache, out_TND, table, rows, prefix_lens, extend_lens, q_starts,
        q_TND.stride(0), q_TND.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), table.stride(0),
        out_TND.stride(0), out_TND.stride(1), scale_log2, window,
        GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=k_cache.dtype == torch.float32, SPLIT=split, num_warps=warps, num_stages=stages)
