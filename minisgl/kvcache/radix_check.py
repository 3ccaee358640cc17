"""The radix cache's integrity check (a mixin of RadixCache, kvcache/radix_cache.py): walks the
tree and raises on any broken invariant of the module docstring there (links and keys, refs,
access times, the eviction heap, the page and sliding-page sets and counts, the snapshots).
Tests and the scheduler's `check_integrity` call it; nothing on the serving path does."""

from __future__ import annotations

from typing import Any


class RadixIntegrity:
    page_size: int
    window: int
    events: Any
    _root: Any
    _evictable: int
    _protected: int
    _pages: set[int]
    _heap: list
    _swa_pages: set[int]
    _snaps: Any
    _swa_evictable: int
    _swa_protected: int

    def check_integrity(self) -> None:
        ps = self.page_size
        root = self._root
        _require(root.key == () and not root.pages and root.parent is None, "root is not empty")
        seen: set[int] = set()
        evictable = protected = in_heap = 0
        seen_swa: set[int] = set()
        snapped: list[Any] = []
        swa_counts = [0, 0]
        stack = [root]
        while stack:
            node = stack.pop()
            in_heap += node.in_heap
            child_refs = 0
            for first, child in node.children.items():
                where = f"node {child.key[:8]}... (depth under {node.key[:8]})"
                _require(child.parent is node, f"{where}: wrong parent link")
                _require(child.key[:ps] == first, f"{where}: keyed by {first}")
                _require(
                    len(child.pages) > 0 and len(child.key) == len(child.pages) * ps,
                    f"{where}: {len(child.key)} tokens for {len(child.pages)} pages",
                )
                _require(child.ref >= 0, f"{where}: ref {child.ref} < 0")
                _require(child.last_access <= node.last_access, f"{where}: newer than parent")
                if self.events is not None:
                    _require(len(child.hashes) == len(child.pages), f"{where}: {len(child.hashes)} block hashes")
                if not child.children and child.ref == 0:
                    _require(child.in_heap, f"{where}: evictable leaf missing from the heap")
                for p in child.pages:
                    _require(p >= 1 and p not in seen, f"{where}: page {p} is 0 or cached twice")
                    seen.add(p)
                if self.window:
                    _require(len(child.swa) == len(child.pages), f"{where}: {len(child.swa)} sliding entries")
                    live = [p for p in child.swa if p]
                    _require(not seen_swa.intersection(live), f"{where}: a sliding page cached twice")
                    seen_swa.update(live)
                    swa_counts[child.ref > 0] += len(live)
                if child.snap >= 0:
                    snapped.append(child)
                if child.ref:
                    protected += len(child.pages)
                else:
                    evictable += len(child.pages)
                child_refs += child.ref
                stack.append(child)
            if node is not root:
                _require(node.ref >= child_refs, f"ref {node.ref} < children's {child_refs}")
        _require(evictable == self._evictable, f"evictable_pages {self._evictable}, tree has {evictable}")
        _require(protected == self._protected, f"protected_pages {self._protected}, tree has {protected}")
        _require(seen == self._pages, "page set differs from the tree's pages")
        _require(in_heap == len(self._heap), f"{len(self._heap)} heap entries, {in_heap} marked")
        _require(seen_swa == self._swa_pages, "sliding page set differs from the tree's")
        _require(set(snapped) == set(self._snaps) and len(snapped) == len(self._snaps),
                 "snapshot list differs from the tree's snapshots")
        slots = [n.snap for n in snapped]
        _require(len(set(slots)) == len(slots), "a snapshot slot held by two nodes")
        _require(swa_counts == [self._swa_evictable, self._swa_protected],
                 f"sliding pages evictable/protected {swa_counts}, counted {self._swa_evictable}/{self._swa_protected}")


def _require(cond: bool, message: str) -> None:
    # Explicit raise rather than `assert`: the check must also run under `python -O`.
    if not cond:
        raise AssertionError(f"RadixCache integrity: {message}")
