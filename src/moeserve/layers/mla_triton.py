"""The "triton" latent attention (MLA) backend: DeepSeek's attention on the GPU, absorbed
(kernels in mla_kernels.py; imported on first use, so CPU-only installs never import Triton).

Legend as in mla.py: T new tokens, N local heads, C kv_lora_rank, R rope dims, P nope dims,
V value dims; W = kv_b_proj's weight viewed [N, P + V, C], W_UK = W[:, :P], W_UV = W[:, P:].

    q_lat_NTC = q_nope_NTP @ W_UK            one batched GEMM over the heads (torch.bmm)
    o_lat     = attention over the cached [latent | k_pe] rows (the kernels)
    o_NTV     = o_lat_NTC @ W_UV^T           one batched GEMM over the heads

Up to the tiles' mla_head_gemv_max_tokens tokens the two batched GEMMs are GEMVs of
mla_kernels.py (q_absorb, o_unabsorb) that keep the decode step's PDL chain unbroken.

Why absorbed: the cache holds only the latent rows, so the torch backend's way (expand every
cached row through kv_b_proj for every head, each step) moves N (P + V) / (C + R) times the
cache's bytes and a [S, N, P + V] copy per request. Absorbed, each cached row is read once per
program and feeds all its heads; decode reads C + R values per cached token, the least any
exact method can. Extend computes (C + R + C) / (P + R + V) times the FLOPs of the expanded
form (DeepSeek-V2-Lite: 3.4x); it needs no [S, N, P + V] copy and serves a cached prefix as it
serves new tokens.

One exception: a request with many new tokens (the tiles' mla_sdpa_min_extend or more,
with or without a cached prefix, up to sdpa_max_extend keys) expands its cached rows (one GEMM,
[S, N, P + V]: small against the T S work) and runs the expanded form through torch's SDPA
(mla_sdpa); the kernel takes the step's other requests.

Decode reads every length from device tensors and launches a grid fixed by the batch size:
graph-capturable (runtime/cuda_graph.py). Extend sizes its grid from the step's longest
extend (host lengths), as the GQA backend does: the prefill graphs run it between their
pieces (runtime/prefill_graph.py), with `out=` their static output buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ClassVar, Optional

import torch
import torch.nn.functional as F

from moeserve.kernels.attention.tiles import ATTENTION_TILES, AttentionTiles
from moeserve.layers.attention import AttentionBackend, query_starts
from moeserve.layers.attention_triton import (LOG2E, Partials, PlannedPartials, _pow2, _sdpa,
                                              _sdpa_takes, decode_splits, partial_views)
from moeserve.layers.mla import MLA_BACKENDS
from moeserve.batch.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from moeserve.layers.mla import MLAttention


class _StepMeta:
    """What every layer of one forward shares: the split count of a decode; the query offsets
    of an extend, its requests that go through SDPA in the expanded form (mla_sdpa) and what
    the kernel keeps (their new tokens zeroed)."""

    def __init__(self, fb: ForwardBatch, device: torch.device, head_blocks: int,
                 planned: Optional[Partials], tiles: AttentionTiles):
        self.fb = fb
        if fb.mode is ForwardMode.DECODE:
            self.splits = decode_splits(tiles, fb.batch_size, head_blocks, device,
                                        tiles.mla_whole_from, planned)
            return
        lens = fb.extend_seq_lens_cpu
        starts = query_starts(lens)
        self.q_starts = torch.tensor(starts, dtype=torch.int64).to(device, non_blocking=True)
        self.max_extend = max(lens, default=0)
        # (batch index, first row, new tokens, cached prefix) of each request SDPA takes
        self.sdpa = [(i, s, n, p) for i, (s, n, p)
                     in enumerate(zip(starts, lens, fb.extend_prefix_lens_cpu))
                     if n >= tiles.mla_sdpa_min_extend and p + n <= tiles.sdpa_max_extend]
        self.sdpa_slots: Optional[list[torch.Tensor]] = None  # their key slots, on first use
        self.kernel_lens, self.kernel_max = fb.extend_seq_lens, self.max_extend
        if self.sdpa:
            taken = {i for i, *_ in self.sdpa}
            left = [0 if i in taken else n for i, n in enumerate(lens)]
            self.kernel_lens = torch.tensor(left, dtype=torch.int64).to(device,
                                                                       non_blocking=True)
            self.kernel_max = max(left)


@MLA_BACKENDS.register("triton")
class TritonMLABackend(PlannedPartials, AttentionBackend):
    graph_capturable: ClassVar[bool] = True

    def __init__(self, tiles: AttentionTiles = ATTENTION_TILES) -> None:
        super().__init__(tiles)
        self._meta: Optional[_StepMeta] = None

    def warm_up(self, layer: "MLAttention", max_extend: int, dtype: torch.dtype,
                device: torch.device) -> list[int]:
        """SDPA once at every padded length a fresh prompt of up to max_extend tokens can take
        (cuDNN builds each length's plan on its first call)."""
        dim = _sdpa_dim(layer)
        if not _sdpa_takes(device, dtype, dim):
            return []
        lengths = self.tiles.sdpa_warm_lengths(self.tiles.mla_sdpa_min_extend, max_extend)
        for t in lengths:
            x = torch.zeros(t, layer.heads_local, dim, dtype=dtype, device=device)
            _sdpa(x, x, x, layer.scaling)
        return lengths

    def _step_meta(self, fb: ForwardBatch, device: torch.device, head_blocks: int) -> _StepMeta:
        if self._meta is None or self._meta.fb is not fb:
            self._meta = _StepMeta(fb, device, head_blocks, self._partials, self.tiles)
        return self._meta

    def forward(self, q_TNQ: torch.Tensor, layer: "MLAttention", fb: ForwardBatch,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q_TNQ = [q_nope | roped q_pe] per head -> o [T, N, V] (a transposed view), or into
        `out` [T, N, V] (a prefill graph's static buffer) when given."""
        m, n = layer.mla, layer.heads_local
        t = q_TNQ.shape[0]
        if fb.mode is ForwardMode.IDLE or t == 0:
            return q_TNQ.new_empty(t, n, m.v_head_dim) if out is None else out
        decode = fb.mode is ForwardMode.DECODE
        tiles = self.tiles.mla_decode if decode else self.tiles.mla_extend_tiles(n)
        meta = self._step_meta(fb, q_TNQ.device, -(-n // tiles[0]))
        if decode and meta.splits == 1:
            tiles = tiles[:2] + self.tiles.mla_whole_decode
        sdpa = (not decode and meta.sdpa
                and _sdpa_takes(q_TNQ.device, q_TNQ.dtype, _sdpa_dim(layer)))
        if not sdpa:
            o_TNV = self._absorbed(q_TNQ, layer, fb, meta, tiles, fb.extend_seq_lens,
                                   0 if decode else meta.max_extend)
            return o_TNV if out is None else out.copy_(o_TNV)
        out_TNV = q_TNQ.new_empty(t, n, m.v_head_dim) if out is None else out
        if meta.kernel_max:  # every row; those of SDPA's requests are overwritten below
            out_TNV.copy_(self._absorbed(q_TNQ, layer, fb, meta, tiles, meta.kernel_lens,
                                         meta.kernel_max))
        if meta.sdpa_slots is None:  # once a step, for every layer
            meta.sdpa_slots = sdpa_slots(fb, meta.sdpa, self.tiles.sdpa_length)
        mla_sdpa(q_TNQ, fb.kv_pool.latent_cache(layer.layer_id), meta.sdpa_slots, _kv_b(layer),
                 meta.sdpa, layer.scaling, out_TNV)
        return out_TNV

    def _absorbed(self, q_TNQ: torch.Tensor, layer: "MLAttention", fb: ForwardBatch,
                  meta: _StepMeta, tiles: tuple[int, ...], extend_lens: torch.Tensor,
                  max_extend: int) -> torch.Tensor:
        """The kernels' attention (decode, or the extend of `extend_lens` new tokens per
        request, at most max_extend) -> [T, N, V], a transposed view."""
        from moeserve.kernels.attention import kernels as AK
        from moeserve.kernels.mla import kernels as K
        from moeserve.kernels.launch.pdl import pdl_args

        m, n = layer.mla, layer.heads_local
        p, r, c = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        t = q_TNQ.shape[0]
        w_NWC = _kv_b(layer)
        cache = fb.kv_pool.latent_cache(layer.layer_id)
        table = fb.req_to_token
        gemv = t <= self.tiles.mla_head_gemv_max_tokens  # kv_b_proj's halves by chained GEMVs
        if gemv:
            q_lat_NTC = K.q_absorb(q_TNQ[..., :p], w_NWC[:, :p])
        else:
            q_lat_NTC = torch.bmm(q_TNQ[..., :p].transpose(0, 1), w_NWC[:, :p])
        q_pe_TNR = q_TNQ[..., p:]
        o_lat_NTC = torch.empty_like(q_lat_NTC)
        block_h, block_t, block_n, warps, stages = tiles
        head_blocks = -(-n // block_h)
        scale = layer.scaling * LOG2E
        common = dict(KV_RANK=c, ROPE=r, BLOCK_H=block_h, BLOCK_C=_pow2(c), BLOCK_R=_pow2(r),
                      BLOCK_N=block_n, IEEE=cache.dtype == torch.float32, num_warps=warps,
                      num_stages=stages)
        q_strides = (q_lat_NTC.stride(1), q_lat_NTC.stride(0), q_pe_TNR.stride(0),
                     q_pe_TNR.stride(1), cache.stride(0), table.stride(0))
        if fb.mode is ForwardMode.DECODE:
            bs = fb.batch_size
            assert t == bs, f"a decode batch has one token per request: {t} tokens, {bs} rows"
            splits = meta.splits
            direct = splits == 1  # no partials: the kernel writes the output itself
            if direct:  # stand-ins the kernel never touches
                po, pl = o_lat_NTC.transpose(0, 1)[:, :, None], o_lat_NTC[0]
            else:
                po, pl = partial_views(self._partials, bs, n, splits, c, q_TNQ.device)
            pdl = pdl_args(q_TNQ.device)
            K.mla_decode_kernel[(bs, head_blocks, splits)](
                q_lat_NTC, q_pe_TNR, cache, table, fb.req_pool_indices, fb.seq_lens, po, pl,
                o_lat_NTC, *q_strides, po.stride(0), po.stride(1), po.stride(2), pl.stride(0),
                pl.stride(1), o_lat_NTC.stride(1), o_lat_NTC.stride(0), scale, n, splits,
                DIRECT=direct, **common, **pdl)
            if not direct:
                block_d = min(_pow2(c), self.tiles.mla_combine_block_d)
                AK.decode_combine_kernel[(bs, n, -(-c // block_d))](
                    po, pl, o_lat_NTC, o_lat_NTC, pl, po.stride(0), po.stride(1),
                    po.stride(2), pl.stride(0), pl.stride(1), o_lat_NTC.stride(1),
                    o_lat_NTC.stride(0), 0, 0, splits, HEAD_DIM=c, BLOCK_D=block_d,
                    BLOCK_S=_pow2(self.tiles.max_splits, 2), QUANT=False, num_warps=4,
                    EARLY=False, **pdl)
        elif max_extend:
            grid = (fb.req_pool_indices.shape[0], head_blocks, -(-max_extend // block_t))
            K.mla_extend_kernel[grid](
                q_lat_NTC, q_pe_TNR, cache, o_lat_NTC, table, fb.req_pool_indices,
                fb.extend_prefix_lens, extend_lens, meta.q_starts, *q_strides,
                o_lat_NTC.stride(1), o_lat_NTC.stride(0), scale, n, BLOCK_T=block_t, **common)
        if gemv:
            return K.o_unabsorb(o_lat_NTC, w_NWC[:, p:])
        return torch.bmm(o_lat_NTC, w_NWC[:, p:].transpose(1, 2)).transpose(0, 1)


def _kv_b(layer: "MLAttention") -> torch.Tensor:
    """kv_b_proj's weight as [N, P + V, C]: W_UK = [:, :P], W_UV = [:, P:]."""
    m = layer.mla
    return layer.kv_b_proj.weight.view(layer.heads_local, m.qk_nope_head_dim + m.v_head_dim,
                                       m.kv_lora_rank)


def _sdpa_dim(layer: "MLAttention") -> int:
    """The head dim the expanded form runs SDPA at: q/k (nope + rope) and v padded alike."""
    return max(layer.mla.qk_head_dim, layer.mla.v_head_dim)


def sdpa_slots(fb: ForwardBatch, requests: list[tuple[int, int, int, int]],
               padded: Callable[[int], int]) -> list[torch.Tensor]:
    """The key slots of each request mla_sdpa takes: a fresh prompt's new tokens padded with
    its last slot to its SDPA length `padded(n)` (the tiles' sdpa_length), else the request
    table's first p + n slots (fetched by a gather: indexing by a device scalar would wait for
    the device)."""
    slots = []
    for i, s, n, p in requests:
        if p == 0:
            loc = fb.out_cache_loc[s:s + n]
            pad = padded(n) - n
            slots.append(torch.cat((loc, loc[-1:].expand(pad))) if pad else loc)
        else:
            row = fb.req_to_token.index_select(0, fb.req_pool_indices[i:i + 1])
            slots.append(row[0, :p + n].long())
    return slots


def mla_sdpa(q_TNQ: torch.Tensor, cache_SW: torch.Tensor, slots: list[torch.Tensor],
             w_NWC: torch.Tensor, requests: list[tuple[int, int, int, int]], scaling: float,
             out_TNV: torch.Tensor) -> None:
    """Causal attention of the given requests (batch index i, first row s, n new tokens,
    cached prefix p) in the expanded form, through torch's SDPA: request i's query rows are
    [s, s + n) and its keys its p + n cached rows (the new ones already written), expanded
    through kv_b_proj into per-head k_nope and v (one GEMM); k = [k_nope | k_pe], the same
    k_pe for every head. q/k and v are zero-padded to one head dim (SDPA's flash-class kernels
    take one). A fresh prompt (p = 0) runs at its length padded to the tiles' sdpa_bucket
    (its cuDNN plan built at startup), as attention_triton.sdpa_fresh does; after a prefix,
    the causal mask is aligned to the last key (torch's causal_lower_right). slots: each
    request's key slots (sdpa_slots, the same for every layer of a step)."""
    from torch.nn.attention.bias import causal_lower_right

    n_heads, width, c = w_NWC.shape
    qd, vd = q_TNQ.shape[-1], out_TNV.shape[-1]
    nope, dim = width - vd, max(qd, vd)
    w_XC = w_NWC.reshape(n_heads * width, c)
    for (i, s, n, p), loc in zip(requests, slots):
        q, t = q_TNQ[s:s + n], loc.shape[0]
        if p == 0 and t > n:
            q = torch.cat((q, q.new_zeros(t - n, *q.shape[1:])))
        rows_TW = cache_SW.index_select(0, loc)
        kv_TNW = (rows_TW[:, :c] @ w_XC.t()).view(t, n_heads, width)
        k = q.new_zeros(t, n_heads, dim) if dim > qd else q.new_empty(t, n_heads, dim)
        k[..., :nope] = kv_TNW[..., :nope]
        k[..., nope:qd] = rows_TW[:, None, c:]  # k_pe, the same for every head
        v = F.pad(kv_TNW[..., nope:], (0, dim - vd)) if dim > vd else kv_TNW[..., nope:]
        if dim > qd:
            q = F.pad(q, (0, dim - qd))
        if p == 0:
            o = _sdpa(q, k, v, scaling)
        else:
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=causal_lower_right(n, t), scale=scaling)[0].transpose(0, 1)
        out_TNV[s:s + n].copy_(o[:n, :, :vd])
