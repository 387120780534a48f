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
        req.kv_len = req.cached_len = req.recorded = 0
        del req.slots[:]
        if self.radix is not None and not req.needs_prompt_logprobs:
            # at least the last token is computed again: its logits pick the next token
            match = self.radix.match_prefix(req.ids(0, req.seq_len - 1))
            if match.slots.numel():
                self.radix.lock(match.last_node)
                req.prefix_node = match.last_node
                req.kv_len = req.cached_len = int(match.slots.numel())
                req.slots.extend(match.slots.tolist())  # (the tree's slots are on the host)
        return True

    def claim(self, req: Req, n: int) -> bool:
        """Slots for the next `n` tokens of `req` (positions kv_len.. kv_len+n), on the host
        only (the prefix cache gives up LRU entries if the pool is short); False if they don't
        fit. `record` writes a step's claims into the request table in one copy."""
        return self._take(req, n) is not None

    def claim_next(self, reqs: list[Req]) -> list[Req]:
        """One slot for the next token of each of `reqs` (a decode step's); those that got
        it, in order. The same slots as claiming one request after another: the fresh pages
        the step needs (a request whose last slot ends its page) come from the pool in one
        take, lowest first in batch order, and each other request takes the slot after its
        last. When the pool lacks some of them, each request claims on its own (the prefix
        cache gives up LRU entries)."""
        ps = self.page_size
        fresh = [not r.slots or (r.slots[-1] + 1) % ps == 0 for r in reqs]
        pages = self.kv_pool.take_pages(sum(fresh))
        if pages is None:
            return [r for r in reqs if self.claim(r, 1)]
        it = iter(pages)
        for req, new_page in zip(reqs, fresh):
            assert req.row is not None
            req.slots.append(next(it) * ps if new_page else req.slots[-1] + 1)
            req.kv_len += 1
        return reqs

    def record(self, reqs: list[Req], takes: list[int]) -> torch.Tensor:
        """The slots each request claimed for its last `take` positions, and those of a
        cached prefix admit gave it, into the request table in one write (a copy that does
        not wait for the device, where the step in flight may still run); returns the claimed
        ones on the device in batch order, int64."""
        n = np.asarray(takes, dtype=np.int64)
        ends = np.fromiter((r.kv_len for r in reqs), np.int64, len(reqs))
        rows = np.fromiter((r.row for r in reqs), np.int64, len(reqs))
        # the claimed positions in batch order first (the step's slots), then the others
        # that the device's rows lack (cached prefixes): [recorded, kv_len - take)
        lo = np.fromiter((r.recorded for r in reqs), np.int64, len(reqs))
        spans = [(ends - n, n), (lo, ends - n - lo)]
        parts = []
        for start, count in spans:
            if parts and not count.any():
                continue  # (a decode step: no prefix to write)
            first = np.cumsum(count) - count  # each request's first index in the part
            if (count == 1).all():  # one slot a request: no slices
                slots = np.fromiter((r.slots[s] for r, s in zip(reqs, start.tolist())),
                                    np.int64, len(reqs))
            else:
                slots = np.concatenate([np.frombuffer(r.slots, dtype=np.int64)[s:s + c]
                                        for r, s, c in zip(reqs, start.tolist(), count.tolist())]
                                       or [np.zeros(0, np.int64)])
            parts.append(np.stack((np.repeat(rows, count),
                                   np.arange(count.sum()) + np.repeat(start - first, count),
                                   slots)))
        for req in reqs:
            req.recorded = req.kv_len
        written = self.req_pool.write_packed(np.concatenate(parts, axis=1))
        return written[:int(n.sum())].to(torch.int64)

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
        req.recorded = 0
        del req.slots[:]
