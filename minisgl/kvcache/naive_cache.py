"""The naive cache (`--cache naive`): caches nothing, so every request prefills from scratch.

It follows the PrefixCache contract with the trivial answers: nothing ever matches, and
`insert` takes ownership of no page (returns `len(token_ids)`), so the one caller code path
frees all of a finished request's pages and leaves a running request's pages with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from minisgl.kvcache.prefix_cache import MatchResult, PrefixCache


class NaiveCache(PrefixCache):
    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size

    def match_prefix(self, token_ids: Sequence[int], whole: bool = False) -> MatchResult:
        return MatchResult(handle=None, pages=[], matched_tokens=0)

    def lock(self, handle: object) -> None:
        pass

    def unlock(self, handle: object) -> None:
        pass

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], swa: Sequence[int] | None = None) -> int:
        if len(token_ids) != len(pages) * self.page_size:
            raise ValueError(
                f"insert needs whole pages: {len(token_ids)} tokens for {len(pages)} pages of {self.page_size}"
            )
        return len(token_ids)

    def evict(self, num_pages: int) -> list[int]:
        return []

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def protected_pages(self) -> int:
        return 0

    def cached_page_ids(self) -> frozenset[int]:
        return frozenset()

    def check_integrity(self) -> None:
        pass

    def reset(self) -> list[int]:
        return []
