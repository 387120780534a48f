"""Prefix cache: a radix tree over token ids whose nodes own the KV slots of those tokens.

Ownership is the contract that keeps slots from leaking or being freed twice:
- `insert(tokens, slots)` takes ownership of the page-aligned part of `slots`: each of those slots
  ends up in the tree, or (when the tree already holds other slots for that token) is handed to
  `free_slots` at once. The unaligned tail stays the caller's.
- a slot leaves the tree only through `free_slots`, on `evict` or `reset`.
- `lock(node)` pins the path from the root to `node` (reference counts); `evict` takes LRU
  unlocked leaves only, so a request's matched prefix cannot disappear under it.

Everything works at page granularity: keys and values of every node are whole pages, children
are keyed by their first page, and matches are cut to a page boundary.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

Tokens = Sequence[int]
Slots = Union[torch.Tensor, Sequence[int]]


class TreeNode:
    __slots__ = ("parent", "children", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: Optional["TreeNode"], key: tuple[int, ...],
                 value: torch.Tensor, last_access: int) -> None:
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.key = key  # token ids, a whole number of pages
        self.value = value  # int64 slots, one per token of key
        self.lock_ref = 0
        self.last_access = last_access

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass(frozen=True)
class MatchResult:
    slots: torch.Tensor  # int64 slots of the matched prefix (a whole number of pages)
    last_node: TreeNode  # lock this node to pin the match


@dataclass(frozen=True)
class InsertResult:
    cached_len: int  # tokens that were already in the tree before this insert
    freed: int  # of the caller's slots, how many were duplicates and went to free_slots
    last_node: TreeNode  # the node that ends the inserted (page-aligned) tokens


class RadixCache:
    def __init__(self, free_slots: Callable[[torch.Tensor], None], page_size: int = 1,
                 device: torch.device | str = "cpu") -> None:
        if page_size < 1:
            raise ValueError(f"page_size={page_size}: must be >= 1")
        self.free_slots = free_slots
        self.page_size = page_size
        self.device = torch.device(device)
        self._clock = itertools.count()
        self.reset_tree()

    # --- counters --------------------------------------------------------------------------
    @property
    def cached_tokens(self) -> int:
        return self._evictable + self._protected

    @property
    def evictable_tokens(self) -> int:
        return self._evictable

    @property
    def protected_tokens(self) -> int:
        return self._protected

    # --- lookups ---------------------------------------------------------------------------
    def match_prefix(self, tokens: Tokens) -> MatchResult:
        """The longest cached page-aligned prefix of `tokens`. A match that ends inside a node
        splits it, so that `last_node` ends exactly at the match."""
        node, values = self.root, []
        for node, _, _ in self._walk(self._aligned(tokens)):
            values.append(node.value)
        slots = torch.cat(values) if values else self._empty()
        return MatchResult(slots, node)

    def insert(self, tokens: Tokens, slots: Slots) -> InsertResult:
        key = self._aligned(tokens)
        if len(slots) < len(key):
            raise ValueError(f"{len(key)} page-aligned tokens but only {len(slots)} slots")
        value = torch.as_tensor(slots, dtype=torch.int64)[:len(key)].to(self.device)
        node, pos, freed = self.root, 0, 0
        for node, start, n in self._walk(key):
            # the tree keeps its own slots; any different slot of ours duplicates it
            ours = value[start:start + n]
            dup = ours[ours != node.value]
            if dup.numel():
                self.free_slots(dup)
                freed += dup.numel()
            pos = start + n
        cached_len = pos
        if pos < len(key):
            leaf = TreeNode(node, key[pos:], value[pos:].clone(), self.root.last_access)
            node.children[leaf.key[:self.page_size]] = leaf
            self._evictable += len(leaf.key)
            node = leaf
        return InsertResult(cached_len, freed, node)

    # --- reference counts ------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """Pin the path root..node: none of it can be evicted until `unlock(node)`."""
        if node is not self.root and node.parent is None:
            raise RuntimeError(f"lock of {node} that was evicted; match the prefix again")
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of {node} that is not locked (unbalanced unlock)")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    # --- eviction --------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots (whole leaves, least recently used first) if the
        unlocked part of the tree holds them; returns the number freed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            self.free_slots(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            del parent.children[leaf.key[:self.page_size]]
            leaf.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Free every cached slot and empty the tree; no path may be locked."""
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} tokens locked by running requests")
        values = [n.value for n in self._nodes()]
        if values:
            self.free_slots(torch.cat(values))
        self.reset_tree()

    def reset_tree(self) -> None:
        """Forget the tree without freeing its slots (when the KV pool is reset too)."""
        self.root = TreeNode(None, (), self._empty(), next(self._clock))
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    # --- internals -------------------------------------------------------------------------
    def _walk(self, key: tuple[int, ...]):
        """Follow `key` down from the root, touching each node's access time and splitting the
        node where the key leaves it; yields (node, start, length) of every matched node."""
        node, pos = self.root, 0
        now = next(self._clock)
        node.last_access = now
        while pos < len(key):
            child = node.children.get(key[pos:pos + self.page_size])
            if child is None:
                return
            n = self._match_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            yield child, pos, n
            node, pos = child, pos + n

    def _aligned(self, tokens: Tokens) -> tuple[int, ...]:
        n = len(tokens) // self.page_size * self.page_size
        if isinstance(tokens, (list, tuple)):  # (a request's ids: ints already)
            return tuple(tokens[:n])
        return tuple(map(int, tokens[:n]))

    def _match_len(self, node_key: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Tokens of node_key that match key[pos:], cut down to whole pages: the most pages
        whose slices compare equal (a long shared prefix compares in C, not token by token;
        equal prefixes are nested, so a binary search over page counts finds it)."""
        ps = self.page_size
        lo, hi = 0, min(len(node_key), len(key) - pos) // ps  # pages known equal / at most
        if node_key[:hi * ps] == key[pos:pos + hi * ps]:  # (most often all of them)
            return hi * ps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if node_key[:mid * ps] == key[pos:pos + mid * ps]:
                lo = mid
            else:
                hi = mid - 1
        return lo * ps

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child after n tokens; the new upper node inherits its locks and access time."""
        upper = TreeNode(child.parent, child.key[:n], child.value[:n].clone(), child.last_access)
        upper.lock_ref = child.lock_ref
        upper.children[child.key[n:n + self.page_size]] = child
        child.parent.children[child.key[:self.page_size]] = upper
        child.parent, child.key, child.value = upper, child.key[n:], child.value[n:].clone()
        return upper

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def check(self) -> None:
        """Assert the tree's structural invariants (for tests and debugging)."""
        evictable = protected = 0
        for node in self._nodes():
            assert node.key and len(node.key) % self.page_size == 0, node
            assert node.value.shape == (len(node.key),), node
            assert node.parent.children[node.key[:self.page_size]] is node, node
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), node
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, protected) == (self._evictable, self._protected), (
            evictable, protected, self._evictable, self._protected)
