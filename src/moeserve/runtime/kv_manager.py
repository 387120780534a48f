"""Who owns which KV slot: requests, the prefix cache, or the free list.

Every slot is in exactly one place. A request's row in the request table maps its positions
[0, kv_len) to slots; [0, cached_len) are the prefix cache's (the path is locked for the
request), [cached_len, kv_len) are the request's own until it finishes or is retracted, when the
page-aligned part goes to the prefix cache and the tail back to the pool. `Req.slots` holds
the same row on the host, so that nothing here reads the device's table: with the overlap
schedule such a read would wait for the step in flight.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from moeserve.batch.kv_cache import KVCachePool, ReqToTokenPool
from moeserve.runtime.radix_cache import RadixCache
from moeserve.runtime.request import Req


class KVManager:
    def __init__(self, kv_pool: KVCachePool, req_pool: ReqToTokenPool,
                 prefix_cache: bool = True) -> None:
        self.kv_pool, self.req_pool = kv_pool, req_pool
        self.page_size = kv_pool.page_size
        self.radix: Optional[RadixCache] = (
            RadixCache(kv_pool.free, kv_pool.page_size) if prefix_cache else None)

    @property
    def available_slots(self) -> int:
        """Slots a new allocation could get: free ones and the evictable part of the cache."""
        evictable = self.radix.evictable_tokens if self.radix else 0
        return self.kv_pool.available_slots + evictable

    @property
    def used_slots(self) -> int:
        """Slots held by requests or the prefix cache (the pool's dummy page excluded)."""
        return self.kv_pool.num_slots - self.page_size - self.kv_pool.available_slots

    def admit(self, req: Req) -> bool:
        """Give `req` a request-table row and its cached prefix; False when no row is free."""
        if req.row is not None:
            return True
        row = self.req_pool.alloc()
        if row is None:
            return False
        req.row = row
        req.kv_len = req.cached_len = 0
        del req.slots[:]
        if self.radix is not None and not req.needs_prompt_logprobs:
            # at least the last token is computed again: its logits pick the next token
            match = self.radix.match_prefix(req.ids(0, req.seq_len - 1))
            if match.slots.numel():
                self.radix.lock(match.last_node)
                req.prefix_node = match.last_node
                self.req_pool.write(row, 0, match.slots)
                req.kv_len = req.cached_len = int(match.slots.numel())
                req.slots.extend(match.slots.tolist())  # (the tree's slots are on the host)
        return True

    def claim(self, req: Req, n: int) -> bool:
        """Slots for the next `n` tokens of `req` (positions kv_len.. kv_len+n), on the host
        only (the prefix cache gives up LRU entries if the pool is short); False if they don't
        fit. `record` writes a step's claims into the request table in one copy."""
        return self._take(req, n) is not None

    def record(self, reqs: list[Req], takes: list[int]) -> torch.Tensor:
        """The slots each request claimed for its last `take` positions, into the request
        table in one write (a copy that does not wait for the device, where the step in
        flight may still run); returns them on the device in batch order, int64."""
        n = np.asarray(takes, dtype=np.int64)
        first = np.cumsum(n) - n  # each request's first index in the step
        ends = np.fromiter((r.kv_len for r in reqs), np.int64, len(reqs))
        rows = np.fromiter((r.row for r in reqs), np.int64, len(reqs))
        slots = [np.frombuffer(r.slots, dtype=np.int64)[r.kv_len - t:]
                 for r, t in zip(reqs, takes)]
        packed = np.stack((np.repeat(rows, n), np.arange(n.sum()) + np.repeat(ends - n - first, n),
                           np.concatenate(slots) if slots else np.zeros(0, np.int64)))
        return self.req_pool.write_packed(packed).to(torch.int64)

    def _take(self, req: Req, n: int) -> Optional[list[int]]:
        """Allocate n slots after req's last one (evicting from the prefix cache if the pool
        is short) and advance kv_len; the caller records them in the table."""
        assert req.row is not None and n >= 1
        last = req.slots[-1] if req.slots else None
        slots = self.kv_pool.alloc_slots(last, n)
        if slots is None and self.radix is not None:
            self.radix.evict(n + self.page_size)
            slots = self.kv_pool.alloc_slots(last, n)
        if slots is None:
            return None
        req.kv_len += n
        req.slots.extend(slots)
        return slots

    def release(self, req: Req, cache: bool = True) -> None:
        """Return everything `req` holds: its computed K/V to the prefix cache (page-aligned
        part; or the pool without one), its tail to the pool, its row to the table."""
        if req.row is None:
            return
        # from the host copy: reading the device's table would wait for the step in flight
        slots = (torch.frombuffer(req.slots, dtype=torch.int64).clone() if req.slots
                 else torch.zeros(0, dtype=torch.int64))
        assert slots.numel() == req.kv_len, (req, slots.numel())
        own_from = req.cached_len
        if self.radix is not None and cache and req.kv_len:
            aligned = req.kv_len // self.page_size * self.page_size
            self.radix.insert(req.ids(0, aligned), slots[:aligned])
            own_from = aligned
        if own_from < req.kv_len:
            self.kv_pool.free(slots[own_from:])
        if self.radix is not None and req.prefix_node is not None:
            self.radix.unlock(req.prefix_node)
        self.req_pool.free(req.row)
        req.row, req.prefix_node, req.kv_len, req.cached_len = None, None, 0, 0
        del req.slots[:]
