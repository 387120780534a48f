"""The paged KV cache of one rank, and the request-to-token table.

KVCachePool keeps, per layer, K and V as [slots, kv_heads_local, head_dim]; MLAKVCachePool
(DeepSeek's latent attention) one row [kv_lora_rank + rope_dim] per slot. Both hand out slots
in pages of `page_size` consecutive slots (PagedKVPool); page 0 is reserved, so slot 0 is the
dummy slot that padded rows (CUDA-graph padding, idle ranks) write to without touching any
request's cache.

KVWrite is one layer's store of the new tokens' K/V, handed to the rope so that its GPU kernel
writes the rotated K and V into their slots in the same launch (KVCachePool.fused_write).

ReqToTokenPool is the [rows, context_length] table mapping a request's token position to its KV
slot; row 0 is reserved for the dummy request of padded graph rows.

Both are sized from the capacity plan ("kv_cache" and "req_to_token" records, which the binder
of runtime/buffers.py turns into these pools), never from traffic.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from moeserve.batch.host_copy import to_device
from moeserve.kernels import ops as K

DUMMY_SLOT = 0
DUMMY_REQ_ROW = 0


class PagedKVPool:
    """The page allocator every KV pool shares: `num_slots` slots in pages of `page_size`
    consecutive slots, page 0 reserved (it holds DUMMY_SLOT). Subclasses add the storage."""

    def __init__(self, num_layers: int, num_slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 2 * page_size:
            raise ValueError(f"a KV cache of {num_slots} slots holds no page besides the "
                             f"reserved dummy page (page_size {page_size}); give it at least "
                             f"{2 * page_size} slots (--max-total-tokens / "
                             "--mem-fraction-static)")
        self.num_layers, self.page_size, self.dtype = num_layers, page_size, dtype
        self.num_pages = num_slots // page_size
        self.num_slots = self.num_pages * page_size
        self.device = torch.device(device)
        # free pages, lowest first: the pages never handed out are the range [_fresh,
        # num_pages), taken as a whole range at a time; pages given back (all below _fresh)
        # wait in a min-heap and go out before any fresh one. A flag per page serves the
        # double-free check; page 0 (with the dummy slot) is never handed out
        self._fresh = 1
        self._free_pages: list[int] = []
        self._is_free = bytearray([0]) + bytearray([1]) * (self.num_pages - 1)

    # --- allocation ---------------------------------------------------------------------------
    @property
    def available_slots(self) -> int:
        return (len(self._free_pages) + self.num_pages - self._fresh) * self.page_size

    def take_pages(self, n: int) -> Optional[list[int]]:
        """The n lowest free pages in ascending order, or None (taking nothing) when fewer
        are free (a prefill's thousands of slots: the fresh range's part costs one slice, not
        a heap operation per page)."""
        given_back = min(n, len(self._free_pages))
        if n - given_back > self.num_pages - self._fresh:
            return None
        pages = [heapq.heappop(self._free_pages) for _ in range(given_back)]
        for p in pages:
            self._is_free[p] = 0
        if given_back < n:
            start, self._fresh = self._fresh, self._fresh + n - given_back
            pages.extend(range(start, self._fresh))
            self._is_free[start:self._fresh] = bytes(self._fresh - start)
        return pages

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        """n slots for a new request: whole fresh pages, filled from their start. None when
        the cache cannot hold them."""
        return self.alloc_after(None, n)

    def alloc_after(self, last_slot: Optional[int], n: int) -> Optional[torch.Tensor]:
        """n slots continuing a request whose last cached token sits in `last_slot` (None for
        a new request): first the rest of that slot's page, then fresh pages."""
        slots = self.alloc_slots(last_slot, n)
        return None if slots is None else torch.tensor(slots, dtype=torch.int64,
                                                       device=self.device)

    def alloc_slots(self, last_slot: Optional[int], n: int) -> Optional[list[int]]:
        """alloc_after as a list of ints (no tensor: the scheduler's per-step path)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        slots: list[int] = []
        if last_slot is not None and self.page_size > 1:
            page_end = (last_slot // self.page_size + 1) * self.page_size
            slots = list(range(last_slot + 1, min(page_end, last_slot + 1 + n)))
        rest = n - len(slots)
        pages = self.take_pages(-(-rest // self.page_size))
        if pages is None:
            return None
        if self.page_size == 1:
            return slots + pages
        ps = self.page_size
        whole = (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps)).ravel()
        return slots + whole[:rest].tolist()

    def free(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Give back every page that holds one of `slots` (a request frees all its slots at
        once). The dummy page is never freed."""
        slots_t = torch.as_tensor(slots, dtype=torch.int64).cpu()
        pages = set((slots_t // self.page_size).tolist()) - {DUMMY_SLOT // self.page_size}
        double = [p for p in pages if self._is_free[p]]
        assert not double, f"pages {sorted(double)} freed twice"
        for p in pages:
            self._is_free[p] = 1
            heapq.heappush(self._free_pages, p)


class KVCachePool(PagedKVPool):
    """Per-layer K/V storage plus the page allocator.

    Storage is one buffer [layers, 2, slots, kv_heads, head_dim]; k_cache(l) / v_cache(l) are
    contiguous [slots, kv_heads, head_dim] views of it.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", page_size: int = 1):
        super().__init__(num_layers, num_slots, dtype, device, page_size)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.kv_LSKD = torch.zeros(num_layers, 2, self.num_slots, num_kv_heads, head_dim,
                                   dtype=dtype, device=self.device)

    # --- storage ------------------------------------------------------------------------------
    def k_cache(self, layer: int) -> torch.Tensor:
        return self.kv_LSKD[layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.kv_LSKD[layer, 1]

    def set_kv(self, layer: int, loc_T: torch.Tensor, k_TKD: torch.Tensor,
               v_TKD: torch.Tensor) -> None:
        ops = K.elementwise(self.device)
        if ops is not None and ops.store_kv(self.kv_LSKD[layer, 0], self.kv_LSKD[layer, 1],
                                            loc_T, k_TKD, v_TKD):
            return  # one launch on a GPU
        self.kv_LSKD[layer, 0].index_copy_(0, loc_T, k_TKD.to(self.dtype))
        self.kv_LSKD[layer, 1].index_copy_(0, loc_T, v_TKD.to(self.dtype))

    def fused_write(self, layer: int, loc_T: torch.Tensor, v_TKD: torch.Tensor
                    ) -> Optional["KVWrite"]:
        """This layer's K/V store for the rope kernel to do (layers/fused_kernels.rotary with
        kv_cache): a KVWrite on a GPU whose rope kernel takes this layout, else None (then
        set_kv stores them)."""
        ops = K.elementwise(self.device)
        if loc_T.shape[0] == 0 or ops is None:
            return None
        k_cache, v_cache = self.k_cache(layer), self.v_cache(layer)
        if not ops.rotary_stores_kv(k_cache, v_cache, loc_T, v_TKD, v_TKD):  # k has v's shape
            return None
        return KVWrite(self, layer, loc_T, v_TKD)


@dataclass(frozen=True)
class KVWrite:
    """The store of one layer's new K/V: v_TKD into the v cache and the k that the rope gives
    into the k cache, at slots loc_T. Whoever takes it (RotaryEmbedding.forward) leaves both
    in the cache: its kernel writes them, or `write` does."""

    pool: KVCachePool
    layer: int
    loc_T: torch.Tensor
    v_TKD: torch.Tensor

    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        """(k_cache, v_cache, loc_T, v_TKD): fused_kernels.rotary's kv_cache."""
        return (self.pool.k_cache(self.layer), self.pool.v_cache(self.layer), self.loc_T,
                self.v_TKD)

    def write(self, k_TKD: torch.Tensor) -> None:
        self.pool.set_kv(self.layer, self.loc_T, k_TKD, self.v_TKD)


class MLAKVCachePool(PagedKVPool):
    """The KV cache of multi-head latent attention (DeepSeek-V2/V3): per token and layer one
    row [kv_lora_rank + rope_dim] holding the normalised compressed KV (the latent, C) and the
    roped key shared by all heads (R). Every attn_tp rank keeps the whole row: the heads'
    keys and values are expanded from it by each rank's own kv_b_proj shard.

    Storage is one buffer [layers, slots, C + R]; latent_cache(l) is [slots, C + R].
    """

    def __init__(self, num_layers: int, num_slots: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", page_size: int = 1):
        super().__init__(num_layers, num_slots, dtype, device, page_size)
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.kv_LSW = torch.zeros(num_layers, self.num_slots, kv_lora_rank + rope_dim,
                                  dtype=dtype, device=self.device)

    def latent_cache(self, layer: int) -> torch.Tensor:
        return self.kv_LSW[layer]

    def set_latent(self, layer: int, loc_T: torch.Tensor, latent_TC: torch.Tensor,
                   k_pe_TR: torch.Tensor) -> None:
        row = torch.cat((latent_TC, k_pe_TR), dim=-1).to(self.dtype)
        self.kv_LSW[layer].index_copy_(0, loc_T, row)


class ReqToTokenPool:
    """[rows, context_length] int32 table: req_to_token[row, position] = KV slot."""

    def __init__(self, rows: int, context_length: int, device: torch.device | str = "cpu"):
        if rows < 2:
            raise ValueError(f"the request table needs at least 2 rows (one is the dummy), "
                             f"got {rows}")
        self.table = torch.zeros(rows, context_length, dtype=torch.int32, device=device)
        self._free_rows = list(range(rows - 1, DUMMY_REQ_ROW, -1))  # a stack: lowest on top
        self._free_set = set(self._free_rows)

    @property
    def available_rows(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> Optional[int]:
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._free_set.discard(row)
        return row

    def free(self, row: int) -> None:
        assert row != DUMMY_REQ_ROW and row not in self._free_set, f"bad free of row {row}"
        self._free_rows.append(row)
        self._free_set.add(row)

    def write_packed(self, packed: np.ndarray) -> torch.Tensor:
        """One slot per (row, position) of a [3, N] array of (rows, positions, slots), in one
        indexed write; the array goes to the device in one copy that does not wait for it.
        Returns the slots there (the table's dtype)."""
        as_table = np.dtype(str(self.table.dtype).removeprefix("torch."))
        dev = to_device(packed.astype(as_table), self.table.device)
        self.table.index_put_((dev[0], dev[1]), dev[2])
        return dev[2]

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Slots of positions start.. of `row` (from the host without waiting for the
        device)."""
        self.table[row, start:start + len(slots)] = slots.to(self.table.device,
                                                             self.table.dtype,
                                                             non_blocking=True)
