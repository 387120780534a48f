"""The prefix cache: matches, page granularity, LRU eviction, locks, and slot ownership."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule)

from moeserve.runtime.radix_cache import RadixCache


class FreeLog:
    """The KV allocator's free, as the cache sees it: records every slot, refuses double frees."""

    def __init__(self) -> None:
        self.freed: Counter[int] = Counter()
        self.calls: list[list[int]] = []

    def __call__(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64 and slots.numel() > 0
        got = slots.tolist()
        self.calls.append(got)
        for s in got:
            assert self.freed[s] == 0, f"slot {s} freed twice"
            self.freed[s] += 1


def _cache(page_size: int = 1):
    log = FreeLog()
    return RadixCache(log, page_size=page_size), log


def test_match_and_split():
    cache, log = _cache()
    r = cache.insert([1, 2, 3], [10, 11, 12])
    assert (r.cached_len, r.freed) == (0, 0)
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == [10, 11, 12]
    m = cache.match_prefix([1, 2, 9])
    assert m.slots.tolist() == [10, 11] and m.last_node.key == (1, 2)  # split at the match
    assert cache.match_prefix([5, 1]).slots.numel() == 0
    assert cache.match_prefix([]).last_node is cache.root
    cache.insert([1, 2, 7, 8], [10, 11, 30, 31])
    assert cache.match_prefix([1, 2, 7, 8]).slots.tolist() == [10, 11, 30, 31]
    assert cache.cached_tokens == cache.evictable_tokens == 5 and not log.calls
    cache.check()


def test_insert_frees_duplicate_slots():
    cache, log = _cache()
    cache.insert([1, 2, 3], [10, 11, 12])
    # a request that computed the same prefix into its own slots, then one more token
    r = cache.insert([1, 2, 3, 4], [20, 21, 22, 23])
    assert (r.cached_len, r.freed) == (3, 3)
    assert log.calls == [[20, 21, 22]]
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == [10, 11, 12, 23]
    # re-inserting the tree's own slots frees nothing
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 23]).freed == 0
    with pytest.raises(ValueError, match="slots"):
        cache.insert([1, 2, 3], [1, 2])


def test_page_granularity():
    cache, log = _cache(page_size=4)
    r = cache.insert(list(range(10)), list(range(100, 110)))  # 2 whole pages; tail stays ours
    assert r.cached_len == 0 and cache.cached_tokens == 8 and not log.calls
    assert cache.match_prefix(list(range(7))).slots.tolist() == [100, 101, 102, 103]
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 9, 9]).slots.numel() == 4  # mismatch inside page 2
    # different second token: a different first page, a different branch
    cache.insert([0, 9, 2, 3, 4, 5, 6, 7], list(range(200, 208)))
    assert cache.match_prefix([0, 9, 2, 3]).slots.tolist() == [200, 201, 202, 203]
    assert cache.cached_tokens == 16
    cache.check()
    assert all(len(c) % 4 == 0 for c in log.calls)


def test_lru_eviction_order_and_cascade():
    cache, log = _cache()
    cache.insert([1, 1], [10, 11])
    cache.insert([2, 2], [20, 21])
    cache.insert([3, 3], [30, 31])
    cache.match_prefix([1, 1])  # touch 1: LRU order is now 2, 3, 1
    assert cache.evict(1) == 2 and log.calls == [[20, 21]]
    assert cache.evict(2) == 2 and log.calls[-1] == [30, 31]
    # a parent whose last child goes becomes an evictable leaf in the same call
    cache.insert([1, 1, 5], [10, 11, 15])
    cache.insert([1, 1, 6], [10, 11, 16])
    assert cache.evict(100) == 4 and cache.cached_tokens == 0
    assert sorted(log.freed) == [10, 11, 15, 16, 20, 21, 30, 31]


def test_locks_protect_paths():
    cache, log = _cache()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.insert([1, 2, 5], [10, 11, 15])
    m = cache.match_prefix([1, 2, 3])  # splits [3, 4] into [3] and [4]
    cache.lock(m.last_node)
    cache.lock(m.last_node)
    assert cache.protected_tokens == 3 and cache.evictable_tokens == 2
    assert cache.evict(100) == 2  # only [4] and [5] can go
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == [10, 11, 12]
    cache.unlock(m.last_node)
    assert cache.evict(100) == 0
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(m.last_node)
    with pytest.raises(RuntimeError, match="unbalanced"):
        cache.unlock(m.last_node)
    assert cache.evictable_tokens == 3 and cache.evict(1) == 1  # LRU leaf [3] first
    with pytest.raises(RuntimeError, match="evicted"):
        cache.lock(m.last_node)
    cache.reset()
    assert cache.cached_tokens == 0 and sorted(log.freed) == [10, 11, 12, 13, 15]


class CacheModel(RuleBasedStateMachine):
    """Random insert/match/lock/unlock/evict/reset against a dict of cached page prefixes. Every
    slot handed out ends up in exactly one place: in the tree, freed once by the cache, or (an
    unaligned tail) kept by the caller."""

    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.log = FreeLog()
        self.cache = RadixCache(self.log, page_size=self.page_size)
        # prefix of whole pages -> the slots of its last page
        self.cached: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.locks: list[tuple[object, tuple[int, ...]]] = []
        self.caller_kept: set[int] = set()
        self.next_slot = 0
        self.access: dict[tuple[int, ...], int] = {}  # prefix -> last op that touched it
        self.clock = 0

    def _touch(self, prefixes) -> None:
        self.clock += 1
        for p in prefixes:
            self.access[p] = self.clock

    def _fresh(self, n: int) -> list[int]:
        self.next_slot += n
        return list(range(self.next_slot - n, self.next_slot))

    def _pages(self, seq):
        ps = self.page_size
        return [(tuple(seq[:e]), e - ps, e) for e in range(ps, len(seq) // ps * ps + 1, ps)]

    tokens = st.lists(st.integers(0, 2), max_size=12)

    @rule(seq=tokens, reuse=st.booleans())
    def insert(self, seq, reuse):
        own = self._match(seq).slots.tolist() if reuse else []
        slots = own + self._fresh(len(seq) - len(own))
        expected_free, present, n = [], 0, 0
        for prefix, b, e in self._pages(seq):
            page, n = tuple(slots[b:e]), e
            if prefix in self.cached:
                present = e
                expected_free += [s for s, t in zip(page, self.cached[prefix]) if s != t]
            else:
                self.cached[prefix] = page
        self._touch(p for p, _, _ in self._pages(seq))
        self.caller_kept.update(slots[n:])
        before = len(self.log.calls)
        r = self.cache.insert(seq, torch.tensor(slots, dtype=torch.int64))
        freed = [s for c in self.log.calls[before:] for s in c]
        assert sorted(freed) == sorted(expected_free)
        assert r.cached_len == present and r.freed == len(expected_free)

    @rule(seq=tokens)
    def match(self, seq):
        expected = []
        for prefix, _, _ in self._pages(seq):
            if prefix not in self.cached:
                break
            expected += self.cached[prefix]
        assert self._match(seq).slots.tolist() == expected

    def _match(self, seq):
        m = self.cache.match_prefix(seq)
        self._touch(tuple(seq[:e]) for e in range(self.page_size, m.slots.numel() + 1,
                                                  self.page_size))
        return m

    @rule(seq=tokens)
    def lock(self, seq):
        m = self._match(seq)
        self.cache.lock(m.last_node)
        self.locks.append((m.last_node, tuple(seq[:m.slots.numel()])))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, _ = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(0, 20))
    def evict(self, n):
        before = len(self.log.calls)
        got = self.cache.evict(n)
        freed = {s for c in self.log.calls[before:] for s in c}
        assert got == len(freed)
        assert got >= n or self.cache.evictable_tokens == 0
        gone = {p for p, page in self.cached.items() if set(page) <= freed}
        assert len(gone) * self.page_size == len(freed), "freed a slot the tree did not hold"
        assert not gone & self._protected(), "evicted a locked prefix"
        for p in gone:
            del self.cached[p]
        # least recently used first: nothing left to evict is older than what went
        ps = self.page_size
        leaves = set(self.cached) - {p[:-ps] for p in self.cached}
        left = [self.access[p] for p in leaves - self._protected()]
        if gone and left:
            assert max(self.access[p] for p in gone) <= min(left)

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self):
        slots = [s for page in self.cached.values() for s in page]
        before = len(self.log.calls)
        self.cache.reset()
        assert sorted(s for c in self.log.calls[before:] for s in c) == sorted(slots)
        self.cached.clear()

    def _protected(self) -> set[tuple[int, ...]]:
        ps = self.page_size
        return {key[:j] for _, key in self.locks for j in range(ps, len(key) + 1, ps)}

    @invariant()
    def consistent(self):
        ps = self.page_size
        self.cache.check()
        tree: dict[tuple[int, ...], tuple[int, ...]] = {}
        stack = [((), self.cache.root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                values = child.value.tolist()
                for e in range(ps, len(child.key) + 1, ps):
                    tree[prefix + child.key[:e]] = tuple(values[e - ps:e])
                stack.append((prefix + child.key, child))
        assert tree == self.cached
        assert self.cache.cached_tokens == len(self.cached) * ps
        assert self.cache.protected_tokens == len(self._protected()) * ps
        in_tree = {s for page in self.cached.values() for s in page}
        assert len(in_tree) == len(self.cached) * ps, "one slot at two places of the tree"
        freed = set(self.log.freed)
        assert not (in_tree & freed) and not (in_tree & self.caller_kept)
        assert not (freed & self.caller_kept)
        assert len(in_tree) + len(freed) + len(self.caller_kept) == self.next_slot


_stateful = settings(max_examples=80, stateful_step_count=30, deadline=None)
CacheModel.TestCase.settings = _stateful


class CacheModelPage2(CacheModel):
    page_size = 2


class CacheModelPage3(CacheModel):
    page_size = 3


CacheModelPage2.TestCase.settings = _stateful
CacheModelPage3.TestCase.settings = _stateful
TestCachePage1 = CacheModel.TestCase
TestCachePage2 = CacheModelPage2.TestCase
TestCachePage3 = CacheModelPage3.TestCase


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([1, 4]), st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=40),
                                         min_size=1, max_size=6),
       st.lists(st.lists(st.integers(0, 2), max_size=40), min_size=1, max_size=4))
def test_matches_are_the_longest_cached_page_aligned_prefixes(page, inserted, queries):
    """Against a brute force over what was inserted: the matched length is the longest
    page-aligned common prefix with any inserted sequence's page-aligned part, and each
    matched position's slot is the one the first insertion through its whole page gave."""
    cache, _ = _cache(page_size=page)
    # (tokens through the end of a position's page, the position) -> its slot: pages are
    # shared whole or not at all
    first: dict[tuple[tuple[int, ...], int], int] = {}
    aligned = []
    for i, seq in enumerate(inserted):
        slots = [1000 * (i + 1) + j for j in range(len(seq))]
        cache.insert(seq, torch.tensor(slots, dtype=torch.int64))
        n = len(seq) // page * page
        aligned.append(seq[:n])
        for j in range(n):
            first.setdefault((tuple(seq[:(j // page + 1) * page]), j), slots[j])
    for q in queries + inserted:
        qa = q[:len(q) // page * page]
        best = 0
        for s in aligned:
            c = 0
            while c < min(len(qa), len(s)) and qa[c] == s[c]:
                c += 1
            best = max(best, c // page * page)
        m = cache.match_prefix(q)
        want = [first[(tuple(q[:(j // page + 1) * page]), j)] for j in range(best)]
        assert m.slots.tolist() == want, (q, best)
