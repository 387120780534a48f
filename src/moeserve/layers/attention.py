"""GQA attention over the paged KV cache.

Legend: T new tokens of the forward, N query heads (local), K KV heads (local), D head dim,
S a request's cached tokens (prefix + new).

PagedAttention writes the new tokens' K/V into the pool at `out_cache_loc`, then asks an
attention backend for the output. On a GPU the rope kernel can do that write in its own
launch (`kv_write`: the decoder hands it to the rope, then tells forward the K/V are stored).
Backends share one small contract (AttentionBackend) and are chosen by name from a registry;
"torch" is the reference that runs anywhere: per request it gathers the request's K/V through
req_to_token and computes causal softmax attention in fp32. It serves extend (new tokens after
an already cached prefix) and decode alike. It reads the host copies of the lengths, so a CUDA
graph cannot replay it. The GPU backend is "triton" (attention_triton.py); layers/backends.py
creates either by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from itertools import accumulate
from typing import ClassVar, Optional, Sequence

import torch
from torch import nn

from moeserve.batch.buffers import AttentionPartials
from moeserve.batch.forward_batch import ForwardBatch, ForwardMode
from moeserve.batch.kv_cache import KVWrite
from moeserve.config.registry import Registry

# False: the rope never stores K/V, PagedAttention.forward always does (a switch for tests)
FUSE_ROPE_KV_STORE = True


def query_starts(extend_lens: Sequence[int]) -> list[int]:
    """Each request's first row among the step's new tokens (requests in batch order)."""
    return [0, *accumulate(extend_lens[:-1])]


class AttentionBackend(ABC):
    # True when forward launches a fixed amount of work for a decode batch of a given size and
    # reads every length from device tensors: a CUDA graph captured once replays correctly for
    # any lengths (runtime/cuda_graph.py refuses backends that are not). Such a backend's
    # forward also takes `out=` (runtime/prefill_graph.py hands it the static output buffer)
    graph_capturable: ClassVar[bool] = False

    @abstractmethod
    def forward(self, q_TND: torch.Tensor, layer: "PagedAttention",
                fb: ForwardBatch) -> torch.Tensor:
        """Attention output [T, N, D] of the new tokens, whose K/V are already in the pool."""

    def warm_up(self, layer: "PagedAttention", max_extend: int, dtype: torch.dtype,
                device: torch.device) -> list[int]:
        """Whatever the backend builds per shape, built once at startup for extends of up to
        max_extend tokens (not during the first requests). Returns the lengths run."""
        return []

    def bind_partials(self, partials: Optional[AttentionPartials]) -> None:
        """The plan's attn.decode.* buffers, which the plan records only for the backends that
        take them (the triton ones): this backend refuses them."""
        if partials is not None:
            raise ValueError(f"the plan recorded attn.decode.* for the triton attention "
                             f"backend, but this rank runs {type(self).__name__}")


ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = Registry("attention backend")


@ATTENTION_BACKENDS.register("torch")
class TorchAttentionBackend(AttentionBackend):
    def forward(self, q_TND: torch.Tensor, layer: "PagedAttention",
                fb: ForwardBatch) -> torch.Tensor:
        out_TND = torch.empty_like(q_TND)
        if fb.mode is ForwardMode.IDLE or q_TND.shape[0] == 0:
            return out_TND
        k_cache = fb.kv_pool.k_cache(layer.layer_id)
        v_cache = fb.kv_pool.v_cache(layer.layer_id)
        groups = layer.num_heads // layer.num_kv_heads
        start = 0
        for i, (prefix, new) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
            seq = prefix + new
            row = fb.req_pool_indices[i]
            slots_S = fb.req_to_token[row, :seq].long()
            k_SND = k_cache[slots_S].float().repeat_interleave(groups, dim=1)
            v_SND = v_cache[slots_S].float().repeat_interleave(groups, dim=1)
            q_tND = q_TND[start:start + new].float()
            scores_NtS = torch.einsum("tnd,snd->nts", q_tND, k_SND) * layer.scaling
            probs_NtS = causal_softmax(scores_NtS, prefix, layer.sliding_window)
            out_TND[start:start + new] = torch.einsum("nts,snd->tnd", probs_NtS,
                                                      v_SND).to(q_TND.dtype)
            start += new
        return out_TND


def causal_softmax(scores_NtS: torch.Tensor, prefix: int,
                   window: Optional[int] = None) -> torch.Tensor:
    """Softmax over the keys of a request's new tokens, which sit after `prefix` cached ones:
    each query sees the keys up to its own position (and, with a window, the last `window`)."""
    new, seq = scores_NtS.shape[-2:]
    q_pos = torch.arange(prefix, prefix + new, device=scores_NtS.device)[:, None]
    k_pos = torch.arange(seq, device=scores_NtS.device)[None, :]
    visible_tS = k_pos <= q_pos
    if window is not None:
        visible_tS &= k_pos > q_pos - window
    return torch.softmax(scores_NtS.masked_fill(~visible_tS, float("-inf")), dim=-1)


class PagedAttention(nn.Module):
    """One layer's attention core: cache write + backend. No weights."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float, backend: AttentionBackend,
                 sliding_window: Optional[int] = None):
        super().__init__()
        self.layer_id, self.num_heads, self.num_kv_heads = layer_id, num_heads, num_kv_heads
        self.head_dim, self.scaling, self.sliding_window = head_dim, scaling, sliding_window
        self.backend = backend

    def kv_write(self, v_TKD: torch.Tensor, fb: ForwardBatch) -> Optional[KVWrite]:
        """This step's K/V store for the rope kernel to do (its GPU kernel writes the rotated
        k and v into their slots), or None: forward stores them."""
        if not FUSE_ROPE_KV_STORE or v_TKD.shape[0] == 0:
            return None
        make = getattr(fb.kv_pool, "fused_write", None)  # KVCachePool's; not MLA's
        return None if make is None else make(self.layer_id, fb.out_cache_loc, v_TKD)

    def quantizes_output(self, q_TND: torch.Tensor, fb: ForwardBatch, group: int) -> bool:
        """Whether forward can also quantize its output per `group` columns (quant_out): where
        the backend's kernels do it (the triton backend's split decode)."""
        takes = getattr(self.backend, "quantizes_output", None)
        return (fb.attention_hook is None and takes is not None
                and takes(q_TND, self, fb, group))

    def forward(self, q_TND: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                fb: ForwardBatch, kv_stored: bool = False,
                quant_out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                ) -> torch.Tensor:
        """kv_stored: the new K/V are in the pool already (the rope took kv_write).
        quant_out (where quantizes_output): fp8 [T, N D] and float32 [T, N D / group] that
        the output's rows are also quantized into."""
        if q_TND.shape[0] and not kv_stored:
            fb.kv_pool.set_kv(self.layer_id, fb.out_cache_loc, k_TKD, v_TKD)
        if fb.attention_hook is not None:  # a prefill graph's capture cuts the forward here
            assert quant_out is None
            return fb.attention_hook(q_TND, self, fb)
        if quant_out is not None:
            return self.backend.forward(q_TND, self, fb, quant_out=quant_out)
        return self.backend.forward(q_TND, self, fb)
