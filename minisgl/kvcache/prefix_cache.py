"""The prefix-cache interface shared by the radix cache and the naive (no-op) cache.

Page ownership is the whole point of this interface: a KV page is at any moment in exactly one
of three places, so that `allocator free + cached + held only by running requests == total`:
  1. the PageAllocator's free list;
  2. the cache (`cached_pages`: `evictable_pages` + `protected_pages`);
  3. a running request alone (pages it allocated and has not handed to the cache).
A running request also *reads* cached pages it got from `match_prefix`; it holds them under
`lock` and never frees them: they belong to the cache.

Insert contract (the rule that keeps two requests computing the same prefix apart):
`n = insert(token_ids, pages)` -> the cache takes ownership of `pages[n // page_size:]` and of
none of `pages[:n // page_size]`. For the radix cache `n` is the number of leading tokens that
were already cached: the cached copy wins, and the caller's pages for that part are either
the cache's own (the first `len(match.pages)`, obtained from `match_prefix` and still locked)
or duplicates that this caller alone holds and must free once it stops reading them. The
naive cache takes nothing: `n == len(token_ids)`, so the same caller code frees everything.
`cache_finished_request` / `cache_unfinished_request` below implement that caller code once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MatchResult:
    """The longest cached page-aligned prefix of a lookup.

    `handle` is opaque: pass it to `lock`/`unlock`. `pages` are the cache's pages for the first
    `matched_tokens` tokens (`matched_tokens == len(pages) * page_size`). `swa_pages`: with a
    sliding-window group, the cache's sliding page of each of those pages (0: a tombstone, its
    sliding KV freed; never inside the window of `matched_tokens`)."""

    handle: object
    pages: list[int]
    matched_tokens: int
    swa_pages: list[int] = field(default_factory=list)
    # With recurrent-state snapshots (kvcache/radix_snap.py): the snapshot slot holding the state
    # after `matched_tokens` (-1: none, resume from zeros), and where the KV-only match ended when
    # the snapshot rule cut it shorter (0: it did not).
    snapshot: int = -1
    branch_tokens: int = 0


class PrefixCache(ABC):
    page_size: int
    # Sliding-window pages (models with a sliding KV group). `insert(..., swa)` records in
    # `swa_taken` the caller's sliding pages the cache now owns; sliding pages the cache itself
    # drops (eviction, trimming, reset) wait in `_swa_out` until `take_freed_swa()`.
    swa_taken: frozenset[int] = frozenset()
    _swa_out: list[int]

    def take_freed_swa(self) -> list[int]:
        """Sliding pages the cache dropped since the last call: the caller frees them."""
        out = getattr(self, "_swa_out", None) or []
        self._swa_out = []
        return out

    @property
    def evictable_swa_pages(self) -> int:
        return 0

    @property
    def cached_swa_pages(self) -> int:
        return 0

    def cached_swa_page_ids(self) -> frozenset[int]:
        return frozenset()

    def trim_swa(self, handle: object, bound: int) -> None:
        """A request locking `handle` has `bound` tokens cached: sliding pages of its prefix that
        no reader's window can reach any more become tombstones (default: none held)."""

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int], whole: bool = False) -> MatchResult:
        """Longest cached prefix of `token_ids` (list of ints), truncated to whole pages; marks
        it as used now (LRU). A trailing partial page is ignored. A caller that must compute
        at least one token (for logits) passes `token_ids[:-1]`. The result is only safe to
        use until the next `evict` unless its handle is locked. With a sliding-window group
        the match ends where the window's sliding KV exists (DESIGN.md), unless `whole`."""

    @abstractmethod
    def lock(self, handle: object) -> None:
        """Pin the matched prefix: +1 reference on its node and every ancestor."""

    @abstractmethod
    def unlock(self, handle: object) -> None:
        """Undo one `lock(handle)`; the prefix becomes evictable when no lock holds it."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], pages: Sequence[int], swa: Sequence[int] | None = None) -> int:
        """Cache a page-aligned prefix (`len(token_ids) == len(pages) * page_size`) whose KV
        lives in `pages`. Returns `n`: the cache now owns `pages[n // page_size:]`, the caller
        keeps `pages[:n // page_size]` (see the module docstring for who frees what)."""

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Drop least-recently-used unlocked prefixes until at least `num_pages` pages are
        freed or nothing is evictable. Returns the freed pages; the caller gives them back to
        the PageAllocator."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Cached pages that no lock holds (freeable by `evict`)."""

    @property
    @abstractmethod
    def protected_pages(self) -> int:
        """Cached pages held by at least one lock."""

    @property
    def cached_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    @abstractmethod
    def cached_page_ids(self) -> frozenset[int]:
        """Every page the cache owns (for debug-mode accounting: disjoint from free/in use)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError naming the first inconsistency found."""

    @abstractmethod
    def reset(self) -> list[int]:
        """Forget everything (nothing may be locked); returns the pages it held, for the
        caller to give back to the allocator."""

    # The two caller paths, written once so the scheduler cannot get the ownership wrong.

    def cache_finished_request(self, token_ids: Sequence[int], pages: list[int], match: MatchResult,
                               swa: list[int] | None = None) -> list[int]:
        """A request that finishes (or is retracted) hands its KV to the cache.

        `token_ids`: the tokens whose KV is in `pages` (any length); `pages`: the request's
        pages in order, starting with `match.pages` (its locked match). Inserts the whole pages,
        unlocks `match`, and returns the pages the caller must free: its duplicates of already
        cached pages, the trailing partial page and any unused pages past the tokens."""
        ps = self.page_size
        full = len(token_ids) // ps
        m = len(match.pages)
        if pages[:m] != match.pages:
            raise ValueError("a request's pages must start with the pages of its locked match")
        self.swa_taken = frozenset()
        n = self.insert(list(token_ids[: full * ps]), pages[:full], _private(swa, m, full)) // ps
        self.unlock(match.handle)
        assert m <= n <= full, "a locked prefix vanished from the cache"
        if swa is not None:  # the private sliding pages the cache did not take
            self._swa_out = self.take_freed_swa() + [p for p in swa[m:] if p and p not in self.swa_taken]
        return pages[m:n] + pages[full:]

    def cache_unfinished_request(
        self, token_ids: Sequence[int], pages: list[int], match: MatchResult, swa: list[int] | None = None
    ) -> tuple[MatchResult, list[int], list[int]]:
        """A running request (chunked prefill, long decode) caches what it computed so far.

        Returns `(new_match, new_pages, to_free)`: `new_match` is locked (and `match`
        unlocked) and replaces the request's match; `new_pages` replaces its page list, so the
        caller rewrites its request-table row where it changed (positions
        `[len(match.pages) * page_size, len(new_match.pages) * page_size)`); `to_free` are its
        duplicates, now superseded by the cached copies it reads instead."""
        ps = self.page_size
        full = len(token_ids) // ps
        m = len(match.pages)
        if pages[:m] != match.pages:
            raise ValueError("a request's pages must start with the pages of its locked match")
        aligned = list(token_ids[: full * ps])
        self.swa_taken = frozenset()
        n = self.insert(aligned, pages[:full], _private(swa, m, full)) // ps
        new_match = self.match_prefix(aligned, whole=True)
        # Lock the new prefix before dropping the old lock: no window where it is evictable.
        self.lock(new_match.handle)
        self.unlock(match.handle)
        k = len(new_match.pages)
        if swa is not None:  # its sliding pages of [m, k) are now the cache's, or duplicates
            self._swa_out = self.take_freed_swa() + [p for p in swa[m:k] if p and p not in self.swa_taken]
        # Radix: k == full >= n, pages[m:n] are duplicates and pages[n:full] now the cache's.
        # Naive: k == 0, nothing is freed and the request keeps owning all its pages.
        return new_match, new_match.pages + pages[k:], pages[m : min(n, k)]


def _private(swa: list[int] | None, m: int, full: int) -> list[int] | None:
    """The caller's sliding pages of its first `full` pages, with 0 for the `m` its match holds
    (the cache's own: never handed over twice, even where the caller's copy went stale)."""
    return None if swa is None else [0] * m + list(swa[m:full])
