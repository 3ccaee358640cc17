"""Prefix caches: property tests against a reference model, plus the cases that matter most.

Model: cached page-aligned prefixes (token tuples) -> their last page, with a last-use clock.
Few page patterns (some differ only in the last token) and partial tails make prefixes collide
and edges split. After every step: `check_integrity`, and each page is in exactly one place
(allocator free list, cache, or one running request alone)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minisgl.kvcache.naive_cache import NaiveCache
from minisgl.kvcache.pool import PageAllocator
from minisgl.kvcache.prefix_cache import MatchResult
from minisgl.kvcache.radix_cache import RadixCache
from minisgl.kvcache.select import make_prefix_cache

NUM_PAGES = 20  # small enough that admission has to evict (and sometimes gives up)
PATTERNS = {
    1: [(0,), (1,), (2,), (3,)],
    4: [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 2, 3), (1, 1, 1, 1), (3, 2, 1, 0)],
}


@dataclass(eq=False)
class Req:
    tokens: list[int]
    pages: list[int]  # pages[:len(match.pages)] are the cache's (locked), the rest its own
    match: MatchResult


def make_machine(ps: int, radix: bool) -> type[RuleBasedStateMachine]:
    tokens_st = st.builds(
        lambda pages, tail: [t for p in pages for t in p] + tail,
        st.lists(st.sampled_from(PATTERNS[ps]), max_size=6),
        st.lists(st.integers(0, 3), max_size=ps - 1),
    )

    @settings(max_examples=120, stateful_step_count=40, deadline=None)
    class Machine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.cache = RadixCache(ps) if radix else NaiveCache(ps)
            self.alloc = PageAllocator(NUM_PAGES + 1, ps)
            self.model: dict[tuple[int, ...], int] = {}
            self.stamp: dict[tuple[int, ...], int] = {}
            self.clock = 0
            self.reqs: list[Req] = []

        # The reference model: touching stamps every prefix on the path, like the tree does.
        def m_match(self, ids: list[int]) -> list[int]:
            self.clock += 1
            pages = []
            for k in range(ps, len(ids) + 1, ps):
                p = tuple(ids[:k])
                if p not in self.model:
                    break
                pages.append(self.model[p])
                self.stamp[p] = self.clock
            return pages

        def m_insert(self, ids: list[int], pages: list[int]) -> int:
            self.clock += 1
            if not radix:
                return len(ids)
            present = len(ids)
            for i, page in enumerate(pages):
                p = tuple(ids[: (i + 1) * ps])
                if p not in self.model:
                    present = min(present, i * ps)
                    self.model[p] = page
                self.stamp[p] = self.clock
            return present

        def locked(self) -> set[tuple[int, ...]]:
            spans = [(r.tokens, r.match.matched_tokens) for r in self.reqs]
            return {tuple(t[:k]) for t, m in spans for k in range(ps, m + 1, ps)}

        def give_back(self, pages: list[int]) -> None:
            # The safety property: never free a page a running request reads or the cache owns.
            held = {p for r in self.reqs for p in r.pages} | self.cache.cached_page_ids()
            assert not held & set(pages), f"freeing pages still in use: {held & set(pages)}"
            self.alloc.free(pages)

        def do_evict(self, n: int) -> None:
            parents = {p[:-ps] for p in self.model}
            locked = self.locked()
            old_leaves = [p for p in self.model if p not in parents and p not in locked]
            freed = self.cache.evict(n)
            by_page = {page: p for p, page in self.model.items()}
            removed = {by_page[page] for page in freed}
            assert not removed & locked, "evicted a locked prefix"
            self.model = {p: page for p, page in self.model.items() if p not in removed}
            assert all(len(p) == ps or p[:-ps] in self.model for p in self.model)
            assert len(freed) >= n or self.cache.evictable_pages == 0
            if removed:  # LRU: no surviving unlocked leaf is older than anything evicted
                newest = max(self.stamp[p] for p in removed)
                assert all(self.stamp[p] >= newest for p in old_leaves if p not in removed)
            self.give_back(freed)

        def alloc_pages(self, n: int) -> list[int] | None:
            if self.alloc.free_pages < n:
                self.do_evict(n - self.alloc.free_pages)
            return self.alloc.allocate(n) if self.alloc.can_allocate(n) else None

        @precondition(lambda self: len(self.reqs) < 4)
        @rule(tokens=tokens_st)
        def start(self, tokens: list[int]) -> None:
            m = self.cache.match_prefix(tokens)
            assert m.pages == self.m_match(tokens) and m.matched_tokens == len(m.pages) * ps
            self.cache.lock(m.handle)  # before allocating: our own eviction must spare it
            req = Req(list(tokens), list(m.pages), m)
            self.reqs.append(req)
            own = self.alloc_pages(-(-len(tokens) // ps) - len(m.pages))
            if own is not None:
                req.pages += own
            else:  # does not fit now: back to the queue
                self.reqs.remove(req)
                self.cache.unlock(m.handle)

        @precondition(lambda self: self.reqs)
        @rule(i=st.integers(0, 3), aborted=st.booleans())
        def finish(self, i: int, aborted: bool) -> None:
            r = self.reqs.pop(i % len(self.reqs))
            if aborted:  # cancelled mid-prefill: its KV is incomplete, cache none of it
                self.cache.unlock(r.match.handle)
                return self.give_back(r.pages[len(r.match.pages) :])
            full = len(r.tokens) // ps
            to_free = self.cache.cache_finished_request(r.tokens, r.pages, r.match)
            n = self.m_insert(r.tokens[: full * ps], r.pages[:full]) // ps
            assert to_free == r.pages[len(r.match.pages) : n] + r.pages[full:]
            self.give_back(to_free)

        @precondition(lambda self: self.reqs)
        @rule(i=st.integers(0, 3), extra=st.lists(st.integers(0, 3), max_size=2 * ps))
        def chunk_then_extend(self, i: int, extra: list[int]) -> None:
            r = self.reqs[i % len(self.reqs)]
            full = len(r.tokens) // ps
            new, pages, to_free = self.cache.cache_unfinished_request(r.tokens, r.pages, r.match)
            n = self.m_insert(r.tokens[: full * ps], r.pages[:full]) // ps
            expect = self.m_match(r.tokens[: full * ps])
            assert new.pages == expect and pages == expect + r.pages[len(expect) :]
            assert to_free == r.pages[len(r.match.pages) : min(n, len(expect))]
            r.pages, r.match = pages, new
            self.give_back(to_free)
            own = self.alloc_pages(-(-(len(r.tokens) + len(extra)) // ps) - len(r.pages))
            if own is not None:  # prefill the next chunk / decode a few tokens
                r.tokens += extra
                r.pages += own

        @rule(tokens=tokens_st)
        def match_only(self, tokens: list[int]) -> None:
            assert self.cache.match_prefix(tokens).pages == self.m_match(tokens)

        @rule(tokens=tokens_st)
        def insert_fresh(self, tokens: list[int]) -> None:
            # A request that computed this prefix on its own pages without matching (the race).
            ids = tokens[: len(tokens) // ps * ps]
            pages = self.alloc_pages(len(ids) // ps)
            if pages is not None:
                n = self.cache.insert(ids, pages)
                assert n == self.m_insert(ids, pages)
                self.give_back(pages[: n // ps])

        @rule(n=st.integers(0, 8))
        def evict(self, n: int) -> None:
            self.do_evict(n)

        @invariant()
        def consistent(self) -> None:
            self.cache.check_integrity()
            cached = self.cache.cached_page_ids()
            own = [p for r in self.reqs for p in r.pages[len(r.match.pages) :]]
            everything = self.alloc.free_page_ids() + list(cached) + own
            assert len(everything) == len(set(everything)) == self.alloc.total_pages
            assert all(set(r.pages[: len(r.match.pages)]) <= cached for r in self.reqs)
            locked = self.locked()
            assert set(self.model.values()) == cached
            assert self.cache.protected_pages == len(locked)
            assert self.cache.evictable_pages == len(self.model) - len(locked)

    return Machine


TestRadixPage1, TestRadixPage4, TestNaivePage1, TestNaivePage4 = (
    make_machine(ps, radix).TestCase for radix in (True, False) for ps in (1, 4)
)


def test_shared_prefix_race_frees_only_own_duplicates() -> None:
    cache, alloc = RadixCache(4), PageAllocator(64, 4)
    prompt = list(range(10))  # two full pages and a partial one
    # A and B arrive together: neither matches anything, both prefill on their own pages.
    ma, mb = cache.match_prefix(prompt), cache.match_prefix(prompt)
    cache.lock(ma.handle)
    cache.lock(mb.handle)
    a, b = alloc.allocate(3), alloc.allocate(3)
    ma, a2, free_a = cache.cache_unfinished_request(prompt, a, ma)
    assert free_a == [] and a2 == a  # first in: the cache adopts A's full pages
    mb, b2, free_b = cache.cache_unfinished_request(prompt, b, mb)
    assert free_b == b[:2] and b2 == a[:2] + b[2:]  # B switches to A's copy, keeps its tail
    alloc.free(free_b)
    mc = cache.match_prefix(prompt + [99] * 6)  # C reads the shared prefix under a lock
    cache.lock(mc.handle)
    assert mc.pages == a[:2]
    assert cache.evict(100) == []  # everything cached is locked
    assert cache.cache_finished_request(prompt + [7, 7], a2, ma) == []  # a[2] cached now
    assert cache.cache_finished_request(prompt + [5, 5], b2, mb) == []  # b[2]: new branch
    assert sorted(cache.evict(100)) == sorted([a[2], b[2]])  # C still holds a[:2]
    cache.unlock(mc.handle)
    freed = cache.evict(100)
    assert sorted(freed) == sorted(a[:2])
    assert cache.cached_pages == 0 and not set(freed) & set(free_b)
    # Both finish without chunking: the second frees all of its pages, none of the first's.
    ma, mb = cache.match_prefix(prompt), cache.match_prefix(prompt)
    assert cache.cache_finished_request(prompt, a, ma) == a[2:]
    assert cache.cache_finished_request(prompt, b, mb) == b
    assert cache.cached_page_ids() == frozenset(a[:2])


def test_evicts_least_recently_used_first() -> None:
    cache = RadixCache(1)
    cache.insert([1, 2, 3], [1, 2, 3])
    assert cache.insert([1, 2, 4], [1, 2, 7]) == 2  # shares [1, 2]: the cache takes page 7
    cache.insert([5, 5], [5, 6])
    cache.insert([8], [8])
    cache.match_prefix([5, 5, 9])
    # [1, 2] becomes a leaf once its children go and is ordered by its own last use; a leaf
    # goes whole even when one page was asked for.
    assert [cache.evict(1) for _ in range(5)] == [[3], [7], [1, 2], [8], [5, 6]]
    cache.check_integrity()


def test_locked_prefix_survives_splits_and_eviction() -> None:
    cache = RadixCache(1)
    cache.insert([1, 2, 3, 4], [1, 2, 3, 4])
    cache.insert([9], [9])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.handle)
    assert cache.match_prefix([1, 2, 7]).pages == [1, 2]  # splits the locked edge
    cache.insert([1, 2, 5], [1, 2, 5])  # a new unlocked branch under the locked part
    cache.check_integrity()
    assert cache.protected_pages == 4 and cache.evictable_pages == 2
    assert sorted(cache.evict(100)) == [5, 9]
    cache.unlock(m.handle)
    assert cache.evictable_pages == 4 and cache.protected_pages == 0
    assert cache.evict(100) == [3, 4, 1, 2]
    with pytest.raises(ValueError, match="stale"):
        cache.lock(m.handle)


def test_eviction_does_not_scan_the_tree() -> None:
    n = 2000
    cache = RadixCache(1)
    for i in range(n):
        cache.insert([i + 1, 0], [2 * i + 1, 2 * i + 2])
    before = cache.heap_pops
    assert cache.evict(1) == [1, 2]
    assert cache.heap_pops - before == 1  # one heap pop, not a walk over 2000 leaves
    for i in range(2, n, 2):  # touch half the leaves: their heap entries go stale
        cache.match_prefix([i + 1, 0])
    before = cache.heap_pops
    freed: list[int] = []
    while got := cache.evict(1):
        freed += got
    assert freed[:2] == [3, 4]  # untouched leaves go first
    assert len(freed) == 2 * (n - 1)
    assert cache.heap_pops - before <= 2 * n  # each stale entry is re-pushed at most once


def test_bad_input_and_corruption_are_reported() -> None:
    cache = make_prefix_cache("radix", 1)
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert([1, 2, 3], [1, 2])
    cache.insert([1, 2], [5, 6])
    with pytest.raises(ValueError, match="already cached"):
        cache.insert([3], [5])
    with pytest.raises(ValueError, match="dummy"):
        cache.insert([4], [0])
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(cache.match_prefix([1, 2]).handle)
    m = cache.match_prefix([1])
    cache.lock(m.handle)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.check_integrity()
    m.handle.children[(2,)].ref = 5  # corrupt: a child locked more than its parent
    with pytest.raises(AssertionError, match="ref|protected"):
        cache.check_integrity()
    m.handle.children[(2,)].ref = 0
    cache.unlock(m.handle)
    assert sorted(cache.reset()) == [5, 6] and cache.cached_pages == 0
    assert isinstance(make_prefix_cache("naive", 4), NaiveCache)  # the rest: the machines above
    with pytest.raises(ValueError, match="unknown cache"):
        make_prefix_cache("lru", 1)
