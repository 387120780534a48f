"""ForwardBatch: what one forward of one DP rank needs, built by the scheduler (or a test).

Legend: T new tokens of this forward (all requests concatenated), B requests.

  mode               extend (prefill chunks, possibly after a cached prefix), decode (one new
                     token per request), idle (no tokens; the rank still joins every collective)
  input_ids_T        token ids of the new tokens
  positions_T        their positions in their sequence
  out_cache_loc_T    the KV slot each new token's K/V is written to
  req_pool_indices_B rows of req_to_token, one per request
  seq_lens_B         tokens of each request in the cache after this forward (prefix + new)
  extend_prefix_lens_B / extend_seq_lens_B   cached tokens before the forward, new tokens
  req_to_token       [rows, context_length] slot of each (request row, position)
  kv_pool            the KVCachePool the attention layers read and write

Host copies of the per-request lengths (`*_cpu`) travel with the batch so that the torch
attention can loop over requests without a device sync.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from moeserve.batch.host_copy import to_device
from moeserve.batch.kv_cache import KVCachePool, ReqToTokenPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    IDLE = "idle"


class KVCacheFull(RuntimeError):
    """The KV cache has no room for the tokens a batch wants to add."""


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    extend_prefix_lens: torch.Tensor  # [B] int64 (decode: seq_lens - 1)
    extend_seq_lens: torch.Tensor  # [B] int64 (decode: ones)
    req_to_token: torch.Tensor = field(repr=False)  # [rows, context_length] int32
    kv_pool: KVCachePool = field(repr=False)
    seq_lens_cpu: tuple[int, ...] = ()
    extend_prefix_lens_cpu: tuple[int, ...] = ()
    extend_seq_lens_cpu: tuple[int, ...] = ()
    return_all_logits: bool = False  # else only each request's last new token gets logits
    # rows that get logits too, after those of each request's last new token (the prompt
    # positions of requests that asked for prompt logprobs)
    extra_logit_rows: Optional[torch.Tensor] = None
    # (q, layer, fb) -> attention output in place of the layer's backend: set only while
    # runtime/prefill_graph.py captures, to end one graph piece at each attention
    attention_hook: Optional[Callable[..., torch.Tensor]] = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def logit_rows(self) -> Optional[torch.Tensor]:
        """Rows of the hidden states that get logits: None for all, else each request's last
        new token, then the extra rows."""
        if self.return_all_logits:
            return None
        last = torch.cumsum(self.extend_seq_lens, 0) - 1
        return last if self.extra_logit_rows is None else torch.cat([last,
                                                                     self.extra_logit_rows])

    @classmethod
    def from_requests(cls, mode: ForwardMode, new_tokens: Sequence[Sequence[int]],
                      prefix_lens: Sequence[int], req_rows: Sequence[int],
                      out_cache_loc: torch.Tensor, req_to_token: torch.Tensor,
                      kv_pool: KVCachePool, return_all_logits: bool = False,
                      extra_logit_rows: Sequence[int] = ()) -> "ForwardBatch":
        """A batch from per-request lists; `out_cache_loc` [T] must already be written into
        req_to_token at positions [prefix, prefix + new) of each request's row."""
        if mode is ForwardMode.DECODE and any(len(t) != 1 for t in new_tokens):
            raise ValueError("a decode batch has exactly one new token per request")
        dev = kv_pool.device
        ext = [len(t) for t in new_tokens]
        seq = [p + e for p, e in zip(prefix_lens, ext)]
        # each token's position: its index in the step, less its request's first index, plus
        # its request's prefix
        ext_a = np.asarray(ext, dtype=np.int64)
        first = np.cumsum(ext_a) - ext_a
        pos = np.arange(ext_a.sum()) + np.repeat(np.asarray(prefix_lens, np.int64) - first, ext_a)
        ids = [i for t in new_tokens for i in t]
        lists = (ids, pos, req_rows, seq, prefix_lens, ext, extra_logit_rows)
        # one copy to the device, which does not wait for it (the step in flight may still
        # run there: a blocking copy would wait for it), and each field a view of it, starting
        # on a 16-byte boundary (Triton specialises a kernel on its pointers' alignment: a
        # field one int64 off would compile another variant mid-serving)
        starts, total = [], 0
        for part in lists:
            starts.append(total)
            total += len(part) + len(part) % 2
        flat = np.zeros(total, dtype=np.int64)
        for start, part in zip(starts, lists):
            flat[start:start + len(part)] = part
        packed = to_device(flat, dev)
        ids_t, pos_t, rows_t, seq_t, prefix_t, ext_t, extra_t = (
            packed[start:start + len(part)] for start, part in zip(starts, lists))
        return cls(mode, ids_t, pos_t, out_cache_loc.to(dev, torch.int64), rows_t, seq_t,
                   prefix_t, ext_t, req_to_token, kv_pool, tuple(seq), tuple(prefix_lens),
                   tuple(ext), return_all_logits, extra_t if extra_logit_rows else None)

    @classmethod
    def idle(cls, req_to_token: torch.Tensor, kv_pool: KVCachePool) -> "ForwardBatch":
        empty = torch.zeros(0, dtype=torch.int64, device=kv_pool.device)
        return cls(ForwardMode.IDLE, empty, empty, empty, empty, empty, empty, empty,
                   req_to_token, kv_pool)


def prepare_batch(mode: ForwardMode, new_tokens: Sequence[Sequence[int]],
                  prefix_lens: Sequence[int], req_rows: Sequence[int],
                  req_pool: ReqToTokenPool, kv_pool: KVCachePool,
                  return_all_logits: bool = False) -> ForwardBatch:
    """Allocate KV slots for the new tokens of each request (continuing the page of its last
    cached token), record them in the request table, and build the batch. A small scheduler
    for tests and tools; the runtime's scheduler does the same with its own bookkeeping."""
    locs = []
    for toks, prefix, row in zip(new_tokens, prefix_lens, req_rows):
        last = int(req_pool.table[row, prefix - 1]) if prefix > 0 else None
        slots = kv_pool.alloc_after(last, len(toks))
        if slots is None:
            raise KVCacheFull(f"the KV cache has {kv_pool.available_slots} free slots, fewer "
                              f"than the {len(toks)} tokens of request row {row}")
        req_pool.write(row, prefix, slots)
        locs.append(slots)
    loc = torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64)
    return ForwardBatch.from_requests(mode, new_tokens, prefix_lens, req_rows, loc,
                                      req_pool.table, kv_pool, return_all_logits)


def resolve_futures(ids: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """Token ids with each placeholder -(j + 1) replaced by next_tokens[j] (on the device, no
    wait for the host)."""
    return torch.where(ids < 0, next_tokens[(-1 - ids).clamp(min=0)], ids)
