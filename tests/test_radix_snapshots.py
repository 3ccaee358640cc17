"""The radix cache's recurrent-state snapshots (kvcache/radix_snap.py): a match ends at the
deepest snapshot on its path, splits keep a snapshot on the node that ends where it was taken,
every snapshot slot comes back through `free_snapshot` exactly once (eviction, LRU drop,
reset), and a superseded snapshot is dropped first."""

from __future__ import annotations

import random

import pytest

from minisgl.kvcache.radix_cache import RadixCache


def _cache(ps: int = 1) -> tuple[RadixCache, list[int]]:
    cache = RadixCache(ps, snapshots=True)
    freed: list[int] = []
    cache.free_snapshot = freed.append
    return cache, freed


def test_a_match_ends_at_the_deepest_snapshot_and_reports_the_branch() -> None:
    cache, _ = _cache()
    a = list(range(100, 130))
    cache.insert(a, list(range(1, 31)))
    m = cache.match_prefix(a + [7])
    assert (m.matched_tokens, m.snapshot, m.branch_tokens) == (0, -1, 30)  # KV but no state: no hit
    assert cache.set_snapshot(a[:10], 500) and cache.set_snapshot(a[:20], 501)
    m = cache.match_prefix(a + [7])
    assert (m.matched_tokens, m.snapshot, m.branch_tokens, m.pages) == (20, 501, 30, list(range(1, 21)))
    m = cache.match_prefix(a[:15] + [9, 9])
    assert (m.matched_tokens, m.snapshot, m.branch_tokens) == (10, 500, 15)
    m = cache.match_prefix(a[:20])
    assert (m.matched_tokens, m.snapshot, m.branch_tokens) == (20, 501, 0)  # ends on its snapshot
    whole = cache.match_prefix(a, whole=True)  # the scheduler's own re-match ignores snapshots
    assert whole.matched_tokens == 30 and whole.snapshot == -1
    assert not cache.set_snapshot(a[:20], 502), "a second snapshot of one prefix"
    assert not cache.set_snapshot(a + [1], 503), "a snapshot past the cached tokens"
    cache.check_integrity()


def test_pages_of_several_tokens_align_snapshots() -> None:
    cache, _ = _cache(ps=4)
    a = list(range(16))
    cache.insert(a, [1, 2, 3, 4])
    assert not cache.set_snapshot(a[:6], 9), "not page aligned"
    assert cache.set_snapshot(a[:8], 9)
    m = cache.match_prefix(a + [1])
    assert (m.matched_tokens, m.snapshot, m.branch_tokens, m.pages) == (8, 9, 16, [1, 2])


def test_a_split_keeps_the_snapshot_where_it_was_taken() -> None:
    cache, _ = _cache()
    a = list(range(40))
    cache.insert(a, list(range(1, 41)))
    assert cache.set_snapshot(a, 600)  # at the leaf's end
    cache.insert(a[:25] + [999] * 5, list(range(1, 26)) + list(range(41, 46)))  # splits the edge at 25
    m = cache.match_prefix(a + [1])
    assert (m.matched_tokens, m.snapshot) == (40, 600)
    m = cache.match_prefix(a[:30] + [5])
    assert (m.matched_tokens, m.snapshot, m.branch_tokens) == (0, -1, 30)
    cache.check_integrity()


def test_eviction_lru_drop_and_reset_free_each_slot_once() -> None:
    cache, freed = _cache()
    a, b = list(range(10)), list(range(50, 60))
    cache.insert(a, list(range(1, 11)))
    cache.insert(b, list(range(11, 21)))
    assert cache.set_snapshot(a[:5], 700) and cache.set_snapshot(a, 701) and cache.set_snapshot(b, 702)
    cache.match_prefix(a + [0])  # resumes 701: 700 (never used) and 702 are older now
    assert cache.drop_lru_snapshot() and freed == [700]
    assert cache.match_prefix(a[:7]).matched_tokens == 0, "a dropped snapshot still matched"
    cache.evict(10)  # b's leaf (matched least recently), with 702
    assert freed == [700, 702]
    cache.evict(3)  # a's last node (a[7:10] since the match at 7 split it), whose end holds 701
    assert freed == [700, 702, 701] and cache.num_snapshots == 0
    cache.insert(b, list(range(11, 21)))
    assert cache.set_snapshot(b, 703)
    cache.reset()
    assert sorted(freed) == [700, 701, 702, 703] and cache.num_snapshots == 0
    assert not cache.drop_lru_snapshot()
    cache.check_integrity()


def test_a_superseded_snapshot_is_dropped_first() -> None:
    """`supersede_snapshot` moves the snapshot after exactly those tokens to the front of the
    drop order (older ones stay behind it) and touches nothing else: a length that ends inside
    an edge or holds no snapshot, or tokens not cached, change nothing and split nothing."""
    cache, freed = _cache()
    a, b = list(range(100, 130)), list(range(200, 210))
    cache.insert(a, list(range(1, 31)))
    cache.insert(b, list(range(31, 41)))
    assert cache.set_snapshot(b, 800) and cache.set_snapshot(a[:10], 801) and cache.set_snapshot(a[:20], 802)
    before = sorted(cache.cached_prefixes())
    for miss in (a[:15], a[:30], a[:5] + [1] * 5, [7] * 10):  # mid-edge, no snapshot there, not cached
        cache.supersede_snapshot(miss)
    assert sorted(cache.cached_prefixes()) == before, "supersede_snapshot split an edge"
    assert cache.drop_lru_snapshot() and freed == [800], "a miss moved a snapshot"
    cache.insert(b, list(range(31, 41)))
    assert cache.set_snapshot(b, 803)
    cache.supersede_snapshot(a[:20])  # 802 is now dropped before the older 801 and the newer 803
    assert cache.drop_lru_snapshot() and freed == [800, 802]
    assert cache.drop_lru_snapshot() and freed == [800, 802, 801]
    assert cache.match_prefix(a + [1]).matched_tokens == 0
    cache.check_integrity()
    paged, freed = _cache(ps=2)
    paged.insert(a[:8], [1, 2, 3, 4])
    assert paged.set_snapshot(a[:4], 900) and paged.set_snapshot(a[:8], 901)
    paged.supersede_snapshot(a[:5])  # not a page boundary: nothing
    assert paged.drop_lru_snapshot() and freed == [900]
    assert paged.set_snapshot(a[:4], 902)
    paged.supersede_snapshot(a[:8])
    assert paged.drop_lru_snapshot() and freed == [900, 901]
    paged.check_integrity()


def test_random_operations_keep_snapshots_consistent() -> None:
    """Random inserts, snapshots, matches, locks and evictions: integrity after each, and the
    slots freed plus those held always add up to those handed in, each once."""
    rng = random.Random(0)
    cache, freed = _cache(ps=2)
    pages = iter(range(1, 10**6))
    given: list[int] = []
    locked = []
    for step in range(600):
        op = rng.random()
        toks = [rng.randrange(3) for _ in range(2 * rng.randrange(1, 8))]
        if op < 0.35:
            m = cache.match_prefix(toks, whole=True)
            cache.insert(toks, m.pages + [next(pages) for _ in range(len(toks) // 2 - len(m.pages))])
        elif op < 0.6:
            slot = 10_000 + step
            if cache.set_snapshot(toks[: 2 * rng.randrange(1, len(toks) // 2 + 1)], slot):
                given.append(slot)
        elif op < 0.75:
            m = cache.match_prefix(toks)
            assert m.snapshot == -1 or m.snapshot in given
            if rng.random() < 0.5:
                cache.lock(m.handle)
                locked.append(m.handle)
        elif op < 0.85 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.95:
            cache.evict(rng.randrange(1, 6))
        else:
            cache.drop_lru_snapshot()
        cache.check_integrity()
        held = cache.snapshot_slots()
        assert sorted(held + freed) == sorted(given) and len(set(freed)) == len(freed)
    for h in locked:
        cache.unlock(h)
    cache.reset()
    assert sorted(freed) == sorted(given)


def test_set_snapshot_needs_a_snapshot_cache() -> None:
    with pytest.raises(RuntimeError, match="without snapshots"):
        RadixCache(1).set_snapshot([1, 2], 3)
