"""The radix cache's sliding-window pages (a mixin of RadixCache, kvcache/radix_cache.py).

With a sliding-window KV group each tree node holds `swa`, one sliding page per full page
(0: a tombstone, that sliding KV freed). This part keeps them: taking a caller's pages,
filling tombstones, the window rule of a match, and tombstoning what no reader's window
reaches. Freed sliding pages wait in `_swa_out` (PrefixCache.take_freed_swa).
"""

from __future__ import annotations

from typing import Any


class SlidingPages:
    page_size: int
    window: int
    swa_taken: frozenset[int]
    _root: Any
    _swa_pages: set[int]
    _swa_out: list[int]
    _swa_evictable: int
    _swa_protected: int

    def _window_cut(self, swa: list[int]) -> int:
        """The largest m <= len(swa) such that pages covering positions [m*ps - W + 1, m*ps)
        all have sliding pages (m = 0 always qualifies)."""
        ps, w = self.page_size, self.window
        run = 0  # sliding pages present, ending at page m - 1
        best = 0
        for m in range(1, len(swa) + 1):
            run = run + 1 if swa[m - 1] else 0
            if m - run <= max(0, m * ps - w + 1) // ps:
                best = m
        return best

    def _take_swa(self, new: list[int], node: Any) -> None:
        new = [p for p in new if p]
        if min(new, default=1) < 1 or not self._swa_pages.isdisjoint(new):
            raise ValueError(f"bad or already cached sliding pages: {new}")
        self._swa_pages.update(new)
        self.swa_taken = self.swa_taken | frozenset(new)
        if node.ref:
            self._swa_protected += len(new)
        else:
            self._swa_evictable += len(new)

    def _adopt_swa(self, node: Any, swa: list[int]) -> None:
        """The tree's path to `node` covers `swa` (the caller's sliding pages of the same
        tokens): the caller's fill the tree's tombstones; the rest stay the caller's."""
        j = len(swa)
        while node is not self._root and j > 0:
            j -= len(node.pages)
            for i, p in enumerate(swa[j : j + len(node.pages)]):
                if p and not node.swa[i]:
                    node.swa[i] = p
                    self._take_swa([p], node)
            assert node.parent is not None
            node = node.parent

    def trim_swa(self, handle: object, bound: int) -> None:
        """Tombstones the sliding pages on `handle`'s path below every reader's window: a
        node's readers lock it (and the node they matched); each has cached at least up to the
        end of its deepest locked node, so the window of the deepest node D that every reader of
        a node also locks (equal ref counts down the path) bounds them; at `handle` itself, a
        sole reader's `bound` (its cached tokens)."""
        if not self.window:
            return
        node = self._attached(handle)
        ps, w = self.page_size, self.window
        end = sum(len(n.key) for n in self._ancestry(node))
        reach, child_ref = bound if node.ref == 1 else end, None
        while node is not self._root:
            if child_ref is not None and node.ref != child_ref:
                reach = end
            start = end - len(node.key)
            cut = max(0, reach - w + 1) // ps - start // ps  # pages of this node below the window
            for i in range(min(cut, len(node.swa))):
                if node.swa[i]:
                    self._drop_swa(node, i)
            child_ref, end = node.ref, start
            assert node.parent is not None
            node = node.parent

    def _ancestry(self, node: Any) -> list[Any]:
        out = []
        while node is not self._root:
            out.append(node)
            assert node.parent is not None
            node = node.parent
        return out

    def _drop_swa(self, node: Any, i: int) -> None:
        p = node.swa[i]
        node.swa[i] = 0
        self._swa_pages.discard(p)
        if node.ref:
            self._swa_protected -= 1
        else:
            self._swa_evictable -= 1
        self._swa_out.append(p)
