"""The radix prefix cache: a page-aligned radix tree over token ids (`--cache radix`).

Each non-root node is an edge of whole pages: `key` (token ids, `len(key) == len(pages) *
page_size`) and the `pages` holding their KV. Children are keyed by their first page's tokens,
so lookups compare whole pages and every match is page aligned; a match or insert that ends
inside an edge splits it at that page boundary. Invariants (`check_integrity`, kvcache/radix_check.py):
- a lock adds 1 to a node and all its ancestors, so `node.ref >= sum(child.ref)`;
- a touch (match/insert) stamps the whole path, so `parent.last_access >= child.last_access`;
- `evictable_pages` (ref == 0) + `protected_pages` (ref > 0) == pages in the tree, each once;
- every evictable leaf (no children, ref 0) has exactly one entry in the eviction heap.

Eviction pops a heap of `(last_access, seq, node)` instead of scanning the tree. Entries are
lazy: an entry whose node has since gained children or a lock is dropped when popped, one whose
node was touched later is pushed again at its new time. Each node has at most one entry, and
each touch causes at most one re-push: O(log n) amortized per evicted node and per touch.

KV-cache events (kvcache/events.py): with `events`, every node also holds its pages' chained
hashes, and the three places pages enter or leave the tree report it: a new leaf in `insert`
(BlockStored, its parent the block above it), an evicted leaf in `evict` (BlockRemoved), and
`reset` (AllBlocksCleared). Splitting an edge moves no page, so it reports nothing.

Sliding-window group (`window` W > 0): each node also holds `swa`, its pages' sliding pages (0:
a tombstone, that sliding KV freed). A match ends at the largest page boundary m whose window
positions [m - W + 1, m) all have sliding pages (what a request with m cached tokens reads);
eviction frees both kinds; `trim_swa` tombstones sliding pages no reader's window reaches.

Recurrent-state snapshots (`snapshots`, hybrid models; kvcache/radix_snap.py): a node may hold
the snapshot of the state after its end; a match ends at the deepest one on its path.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from minisgl.kvcache.events import CacheEvents
from minisgl.kvcache.prefix_cache import MatchResult, PrefixCache
from minisgl.kvcache.radix_check import RadixIntegrity
from minisgl.kvcache.radix_snap import StateSnapshots
from minisgl.kvcache.radix_swa import SlidingPages


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "ref", "last_access", "in_heap", "hashes", "swa", "snap")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: _Node | None, now: int) -> None:
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent  # None for the root and for evicted (detached) nodes
        self.ref = 0
        self.last_access = now
        self.in_heap = False
        self.hashes: list[int] = []  # the pages' chained hashes, with KV events on
        self.swa: list[int] = []  # with a sliding group: each page's sliding page (0: tombstone)
        self.snap = -1  # with snapshots: the state snapshot slot after this node's end (-1: none)

    @property
    def nswa(self) -> int:
        return sum(1 for p in self.swa if p)


class RadixCache(SlidingPages, StateSnapshots, RadixIntegrity, PrefixCache):
    def __init__(self, page_size: int, events: CacheEvents | None = None, window: int = 0,
                 snapshots: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if events is not None and events.page_size != page_size:
            raise ValueError(f"events hash blocks of {events.page_size} tokens, the cache's pages hold {page_size}")
        self.page_size = page_size
        self.window = window  # the sliding group's window W (0: no sliding group)
        self.snapshots = snapshots
        self.free_snapshot: Callable[[int], None] | None = None
        self.events = events
        self.heap_pops = 0  # eviction work counter (tests and metrics)
        # Called with (the evicted leaf's whole prefix, its pages) before they are freed: the
        # host KV tier (kvcache/host_tier.py) keeps a copy there.
        self.on_evict: Callable[[tuple[int, ...], list[int]], None] | None = None
        self._swa_out: list[int] = []
        self._clear()

    def _clear(self) -> None:
        self._root = _Node((), [], None, 0)
        self._clock = 0  # logical time: deterministic on every rank, no ties between ops
        self._heap: list[tuple[int, int, _Node]] = []
        self._seq = itertools.count()  # heap tiebreak, so nodes are never compared
        self._pages: set[int] = set()
        self._evictable = 0
        self._protected = 0
        self._swa_pages: set[int] = set()
        self._swa_evictable = 0
        self._swa_protected = 0
        self._init_snapshots()

    # ---- lookups -------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], whole: bool = False) -> MatchResult:
        ps = self.page_size
        ids = tuple(token_ids[: len(token_ids) // ps * ps])
        self._clock += 1
        handle, matched = self._walk(ids, self._clock)
        pages, swa = self._path(handle)
        if self.window and not whole:
            m = self._window_cut(swa)
            if m < len(pages):  # walk again to split the edge at the cut
                handle, matched = self._walk(ids[: m * ps], self._clock)
                pages, swa = pages[:m], swa[:m]
        snap, branch = -1, 0
        if self.snapshots and not whole:
            cut = self._snapshot_cut(handle)
            if cut is not handle:
                branch, node = matched, handle
                while node is not cut:  # the tokens between the snapshot and the KV match's end
                    matched -= len(node.key)
                    node = node.parent
                handle, pages, swa = cut, pages[: matched // ps], swa[: matched // ps]
            snap = cut.snap if cut is not self._root else -1
        return MatchResult(handle=handle, pages=pages, matched_tokens=matched,
                           swa_pages=swa if self.window else [], snapshot=snap, branch_tokens=branch)

    def _path(self, node: _Node) -> tuple[list[int], list[int]]:
        runs: list[_Node] = []
        while node is not self._root:
            runs.append(node)
            assert node.parent is not None
            node = node.parent
        runs.reverse()
        return [p for n in runs for p in n.pages], [p for n in runs for p in n.swa]

    def _walk(self, ids: tuple[int, ...], now: int) -> tuple[_Node, int]:
        """Follow `ids` (page aligned) down from the root over whole matching pages, splitting
        the edge where the match ends inside one; stamps `now` on the path."""
        ps = self.page_size
        node, pos = self._root, 0
        node.last_access = now
        while pos < len(ids):
            child = node.children.get(ids[pos : pos + ps])
            if child is None:
                break
            n = self._common_pages(child.key, ids, pos)  # >= 1: the first page matched
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            node = child
            pos += len(child.key)
        return node, pos

    def _common_pages(self, key: tuple[int, ...], ids: tuple[int, ...], pos: int) -> int:
        n = min(len(key), len(ids) - pos)
        if key[:n] == ids[pos : pos + n]:
            return n // self.page_size
        i = next(i for i in range(n) if key[i] != ids[pos + i])
        return i // self.page_size

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after `n` pages; `child` keeps the lower part (so handles and
        heap entries that name it stay valid) and the new upper node inherits its ref count
        (every lock on `child` also counts on its ancestors)."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None
        mid = _Node(child.key[: n * ps], child.pages[:n], parent, child.last_access)
        mid.ref = child.ref
        mid.hashes, child.hashes = child.hashes[:n], child.hashes[n:]
        if self.window:
            mid.swa, child.swa = child.swa[:n], child.swa[n:]
        parent.children[mid.key[:ps]] = mid
        child.key, child.pages, child.parent = child.key[n * ps :], child.pages[n:], mid
        mid.children[child.key[:ps]] = child
        return mid

    # ---- locks ---------------------------------------------------------------------------

    def _attached(self, handle: object) -> _Node:
        if not isinstance(handle, _Node):
            raise TypeError(f"not a RadixCache handle: {handle!r}")
        node: _Node | None = handle
        while node is not None and node is not self._root:
            node = node.parent
        if node is None:
            raise ValueError("stale handle: its prefix was evicted or the cache was reset")
        return handle

    def lock(self, handle: object) -> None:
        node = self._attached(handle)
        while node is not self._root:
            if node.ref == 0:
                self._evictable -= len(node.pages)
                self._protected += len(node.pages)
                k = node.nswa
                self._swa_evictable -= k
                self._swa_protected += k
            node.ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, handle: object) -> None:
        node = self._attached(handle)
        if node is not self._root and node.ref <= 0:
            raise ValueError("unlock of a prefix that is not locked")
        while node is not self._root:
            node.ref -= 1
            if node.ref == 0:
                self._protected -= len(node.pages)
                self._evictable += len(node.pages)
                k = node.nswa
                self._swa_protected -= k
                self._swa_evictable += k
                if not node.children:
                    self._push(node)
            assert node.parent is not None
            node = node.parent

    # ---- insert and evict ----------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], swa: Sequence[int] | None = None) -> int:
        ps = self.page_size
        if len(token_ids) != len(pages) * ps:
            raise ValueError(f"insert needs whole pages: {len(token_ids)} tokens for {len(pages)} pages of {ps}")
        if self.window and (swa is None or len(swa) != len(pages)):
            raise ValueError("a cache with a sliding-window group needs each page's sliding page (0: none)")
        ids = tuple(token_ids)
        self._clock += 1
        node, present = self._walk(ids, self._clock)
        self.swa_taken = frozenset()
        if self.window:
            self._adopt_swa(node, list(swa[: present // ps]))
        if present == len(ids):
            return present
        new_pages = list(pages[present // ps :])
        if min(new_pages) < 1 or len(set(new_pages)) != len(new_pages):
            raise ValueError(f"bad pages to cache (page 0 is the dummy page): {new_pages}")
        if not self._pages.isdisjoint(new_pages):
            raise ValueError(f"pages already cached: {sorted(self._pages & set(new_pages))}")
        leaf = _Node(ids[present:], new_pages, node, self._clock)
        node.children[leaf.key[:ps]] = leaf
        if self.window:
            leaf.swa = list(swa[present // ps :])
            self._take_swa(leaf.swa, leaf)
        if self.events is not None:
            parent = node.hashes[-1] if node is not self._root else None
            leaf.hashes = self.events.block_hashes(parent, leaf.key)
            self.events.stored(leaf.hashes, parent, leaf.key)
        self._pages.update(new_pages)
        self._evictable += len(new_pages)
        self._push(leaf)
        return present

    def _push(self, node: _Node) -> None:
        if not node.in_heap:
            node.in_heap = True
            heapq.heappush(self._heap, (node.last_access, next(self._seq), node))

    def evict(self, num_pages: int, swa_pages: int = 0) -> list[int]:
        """Also until `swa_pages` sliding pages are freed (they go to `take_freed_swa`)."""
        freed: list[int] = []
        swa_freed: list[int] = []
        while (len(freed) < num_pages or len(swa_freed) < swa_pages) and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            self.heap_pops += 1
            node.in_heap = False
            parent = node.parent
            if parent is None or node.children or node.ref > 0:
                continue  # no longer an evictable leaf; pushed again if it becomes one
            if stamp < node.last_access:
                self._push(node)  # touched since pushed: requeue at its real time
                continue
            if self.on_evict is not None:
                self.on_evict(self._prefix_of(node), node.pages)
            self._release_snapshot(node)
            del parent.children[node.key[: self.page_size]]
            node.parent = None
            freed.extend(node.pages)
            self._pages.difference_update(node.pages)
            if self.window:
                live = [p for p in node.swa if p]
                swa_freed.extend(live)
                self._swa_pages.difference_update(live)
                self._swa_evictable -= len(live)
            if self.events is not None:
                self.events.removed(node.hashes)
            self._evictable -= len(node.pages)
            if parent is not self._root and not parent.children and parent.ref == 0:
                self._push(parent)
        self._swa_out.extend(swa_freed)
        return freed

    def _prefix_of(self, node: _Node) -> tuple[int, ...]:
        keys: list[tuple[int, ...]] = []
        n: _Node | None = node
        while n is not None and n is not self._root:
            keys.append(n.key)
            n = n.parent
        return tuple(t for k in reversed(keys) for t in k)

    # ---- accounting ----------------------------------------------------------------------

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    def cached_page_ids(self) -> frozenset[int]:
        return frozenset(self._pages)

    @property
    def evictable_swa_pages(self) -> int:
        return self._swa_evictable

    @property
    def cached_swa_pages(self) -> int:
        return self._swa_evictable + self._swa_protected

    def cached_swa_page_ids(self) -> frozenset[int]:
        return frozenset(self._swa_pages)

    def reset(self) -> list[int]:
        if self._protected:
            raise RuntimeError(f"cannot reset the cache: {self._protected} pages are locked")
        pages = list(self._pages)
        swa = list(self._swa_pages)
        self._reset_snapshots()
        self._clear()
        self._swa_out.extend(swa)
        if self.events is not None:
            self.events.cleared()
        return pages

    def cached_prefixes(self) -> list[tuple[int, ...]]:
        """Every cached page-aligned prefix (one per page: the tokens up to its end), for
        inspection; it copies the whole tree's tokens."""
        out: list[tuple[int, ...]] = []
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, above = stack.pop()
            for child in node.children.values():
                path = above + child.key
                out.extend(path[: len(above) + (i + 1) * self.page_size] for i in range(len(child.pages)))
                stack.append((child, path))
        return out
