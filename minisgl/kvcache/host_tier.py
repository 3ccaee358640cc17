"""The host-memory tier of the prefix cache (`--host-kv-cache-gb N`; 0 = off).

When the radix cache evicts a leaf, its pages' KV is copied into a second pool in host memory
(pinned when the GPU pool is on CUDA; a second CPU tensor on the CPU, same code path) before the
GPU pages are freed. A later prefix match that ends where host copies continue loads them back
into fresh GPU pages and inserts them into the radix cache (RequestKV.match_and_load).

Host copies are indexed by a token trie with one node per page: `key` is that page's tokens,
`slot` its host page (None for a placeholder: a page whose KV is on the GPU, kept only so the
path to host pages below it exists). Host pages are evicted least-recently-used, leaves only,
so every host page's ancestors stay reachable; a placeholder left without children is pruned.
A host copy stays after a load-back (its GPU copy is identical), so evicting that prefix again
costs no copy.

Copies (ops/kv_copy.py: on CUDA a gather/scatter kernel, reading or writing the pinned host pool
through its device address) run on the tier's own CUDA stream and never block the host.
Ordering, per copy: the copy stream first waits for everything already enqueued on the compute
stream (a write-back reads KV that an in-flight step may still be writing; a load fills pages
that an in-flight step may still touch, e.g. those of a request aborted meanwhile). After a
write-back the compute stream waits for an event recorded after the copy, so the first step that
may reuse the freed pages starts once it read them (one launch for all layers). A load copies
the layers in LOAD_CHUNKS chunks (one launch each, the slot lists uploaded once), recording each
chunk's event of the pool (KVPool.load_chunks) after it. Its request is admitted in the step that
starts the load, and that step (every extend, mixed or verify step) waits per chunk at the
chunk's first layer (KVPool.wait_loaded): the load overlaps the forward, and decode steps never
wait. Pages freed while a load may still be writing them (`fence`) make the compute stream wait
for that load first. Host-pool slots are only touched on the copy stream, so stores and loads of
the same slot stay in order. On the CPU (a second CPU tensor) the same calls run synchronously.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from minisgl.kvcache.pool import KVPool
from minisgl.ops.kv_copy import copy_slots, pinned_empty, prepare_kernel_copies

LOAD_CHUNKS = 4  # chunks of layers a load lands in (each one event and one copy launch)


class _HNode:
    __slots__ = ("key", "slot", "parent", "children")

    def __init__(self, key: tuple[int, ...], parent: _HNode | None) -> None:
        self.key = key
        self.slot: int | None = None
        self.parent = parent
        self.children: dict[tuple[int, ...], _HNode] = {}


class HostKVTier:
    def __init__(self, pool: KVPool, gb: float) -> None:
        if gb <= 0:
            raise ValueError(f"host_kv_cache_gb must be > 0 to build the host tier, got {gb}")
        self.pool = pool
        self.page_size = ps = pool.page_size
        page_bytes = pool.bytes_per_token * ps
        self.num_pages = int(gb * 2**30) // page_bytes
        if self.num_pages < 1:
            raise ValueError(f"--host-kv-cache-gb {gb} holds no page of {page_bytes} bytes; give more")
        self.page_bytes = page_bytes
        # K and V in one allocation, pinned (page-locked, device-mapped) beside a CUDA pool.
        shape = (2, pool.num_full_layers, self.num_pages * ps, pool.kv_heads, pool.head_dim)  # the full group
        cuda = pool.device.type == "cuda"
        self._kv = pinned_empty(shape, pool.dtype) if cuda else torch.empty(shape, dtype=pool.dtype)
        if cuda:
            prepare_kernel_copies()
        self._k, self._v = self._kv[0], self._kv[1]
        self._copier = _Copier(pool.device)
        # Per chunk of layers: (first, last + 1, event) on CUDA; one chunk without event on the CPU.
        self._chunks = pool.enable_load_waits(LOAD_CHUNKS) if cuda else [(0, pool.num_full_layers, None)]
        # Loads not known to be done: (event after the copy, its GPU pages), for `fence`.
        self._in_flight: list[tuple[torch.cuda.Event, frozenset[int]]] = []
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._root = _HNode((), None)
        self._lru: OrderedDict[_HNode, None] = OrderedDict()  # nodes holding a host page, oldest first
        self._busy: set[_HNode] = set()  # being loaded back: not evictable meanwhile
        # Statistics (metrics): cumulative.
        self.pages_stored = 0
        self.hits = 0
        self.tokens_loaded = 0

    @property
    def bytes_used(self) -> int:
        return len(self._lru) * self.page_bytes

    @property
    def used_pages(self) -> int:
        return len(self._lru)

    @property
    def load_seconds(self) -> float:
        """Time spent copying KV back (cumulative; on CUDA the copies' GPU time, once done)."""
        return self._copier.seconds

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    # ---- trie ----------------------------------------------------------------------------

    def _path(self, tokens: Sequence[int], pages: int, create: bool) -> list[_HNode]:
        """The nodes of the first `pages` pages of `tokens` (fewer where the trie ends and
        `create` is off)."""
        ps = self.page_size
        node, out = self._root, []
        for i in range(pages):
            key = tuple(tokens[i * ps : (i + 1) * ps])
            child = node.children.get(key)
            if child is None:
                if not create:
                    break
                child = node.children[key] = _HNode(key, node)
            out.append(child)
            node = child
        return out

    def _touch(self, nodes: list[_HNode]) -> None:
        for n in nodes:  # root to leaf: a leaf ends newer than its ancestors
            if n.slot is not None:
                self._lru.move_to_end(n)

    def _prune(self, node: _HNode) -> None:
        # A busy placeholder is about to get its page (on_evict): it stays.
        while node is not self._root and node.slot is None and not node.children and node not in self._busy:
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            node.parent = None
            node = parent

    def _make_room(self, n: int) -> None:
        """Frees host pages until `n` are free, LRU leaves first (fewer if the rest are busy)."""
        while len(self._free) < n:
            victims = [v for v in self._lru if not v.children and v not in self._busy][: n - len(self._free)]
            if not victims:
                return
            for v in victims:
                del self._lru[v]
                assert v.slot is not None
                self._free.append(v.slot)
                v.slot = None
                self._prune(v)

    # ---- store and load ------------------------------------------------------------------

    def on_evict(self, tokens: tuple[int, ...], pages: list[int]) -> None:
        """The radix cache evicts `pages`, the last pages of the prefix `tokens`: keep a host
        copy of those not already on the host (the GPU pages are freed after this returns)."""
        self.fence(pages)
        ps = self.page_size
        total = len(tokens) // ps
        nodes = self._path(tokens, total, create=True)[total - len(pages) :]
        todo = [(n, p) for n, p in zip(nodes, pages) if n.slot is None]
        self._busy.update(n for n, _ in todo)  # new leaves must not evict each other
        try:
            self._make_room(len(todo))
        finally:
            self._busy.difference_update(n for n, _ in todo)
        todo = todo[: len(self._free)]  # host full of busy pages: keep what fits (a prefix)
        if todo:
            for n, _ in todo:
                n.slot = self._free.pop()
                self._lru[n] = None
            self._copy([p for _, p in todo], [n.slot for n, _ in todo], to_host=True)
            self.pages_stored += len(todo)
        self._touch(nodes)
        if nodes:
            self._prune(nodes[-1])  # pages that did not fit leave placeholders behind

    def lookup(self, tokens: Sequence[int], start_page: int) -> list[_HNode]:
        """Consecutive host pages continuing a GPU match of `start_page` pages of `tokens`."""
        path = self._path(tokens, len(tokens) // self.page_size, create=False)
        out = []
        for n in path[start_page:]:
            if n.slot is None:
                break
            out.append(n)
        self._touch(path[: start_page + len(out)])
        return out

    def pin(self, nodes: list[_HNode]) -> None:
        self._busy.update(nodes)

    def unpin(self, nodes: list[_HNode]) -> None:
        self._busy.difference_update(nodes)

    def load(self, nodes: list[_HNode], gpu_pages: list[int]) -> None:
        """Copies the host pages of `nodes` into `gpu_pages`, chunk of layers by chunk, each
        chunk's pool event recorded after it: every extend or mixed step waits for a chunk before
        its attention reads it (KVPool.wait_loaded), nothing else waits. On the CPU the copy is
        synchronous."""
        slots = [n.slot for n in nodes]
        assert None not in slots, "load of a node without a host page"
        self._copy(gpu_pages, slots, to_host=False)  # type: ignore[arg-type]
        self.hits += 1
        self.tokens_loaded += len(nodes) * self.page_size

    def fence(self, pages: Sequence[int] | None = None) -> None:
        """`pages` (None: any) leave the GPU pool's cache to be reused: where a load still in
        flight writes one of them, the compute stream's later work (a step reusing it, which may
        be a decode step: no load wait) waits for that load first. The step that admitted a
        load's request waits for the whole load itself, and all later work on the stream comes
        after it: this matters only for pages freed before that step, e.g. an admission undone."""
        self._prune_loads()
        hit = None if pages is None else set(pages)
        for ev, p in self._in_flight:
            if hit is None or not hit.isdisjoint(p):
                torch.cuda.current_stream(self.pool.device).wait_event(ev)

    def _copy(self, gpu_pages: list[int], host_pages: list[int], to_host: bool) -> None:
        ps = self.page_size
        g = _slots(gpu_pages, ps)
        h = _slots(host_pages, ps)
        pool_k, pool_v = self.pool._k, self.pool._v
        if to_host:
            self._copier.run(lambda: copy_slots(pool_k, pool_v, g, self._k, self._v, h), timed=False)
            return

        def recorded(i: int) -> None:  # chunk i is enqueued on the copy stream (the current one here)
            event = self._chunks[i][2]
            if event is not None:
                event.record()

        spans = [(a, b) for a, b, _ in self._chunks]
        done = self._copier.run(lambda: copy_slots(self._k, self._v, h, pool_k, pool_v, g, spans, recorded),
                                timed=True, wait=False)
        if done is not None:
            self._prune_loads()
            self._in_flight.append((done, frozenset(gpu_pages)))

    def _prune_loads(self) -> None:
        self._in_flight = [(ev, p) for ev, p in self._in_flight if not ev.query()]

    def synchronize(self) -> None:
        """Waits for every copy enqueued so far (tests and benchmarks)."""
        self._copier.synchronize()

    def reset(self) -> None:
        """Drops every host copy (with /flush_cache)."""
        if self._busy:
            raise RuntimeError("cannot reset the host KV tier during a load")
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._root = _HNode((), None)
        self._lru.clear()

    def check_integrity(self) -> None:
        slotted, stack = [], [self._root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                if child.parent is not node or child.key != key:
                    raise AssertionError("HostKVTier integrity: broken trie link")
                if child.slot is None and not child.children:
                    raise AssertionError("HostKVTier integrity: unpruned placeholder")
                if child.slot is not None:
                    slotted.append(child)
                stack.append(child)
        if set(slotted) != set(self._lru) or len(slotted) != len(self._lru):
            raise AssertionError("HostKVTier integrity: LRU differs from the trie's host pages")
        slots = [n.slot for n in slotted] + self._free
        if sorted(slots) != list(range(self.num_pages)):  # type: ignore[type-var]
            raise AssertionError(f"HostKVTier integrity: host pages leaked or doubled ({self.num_pages} in all)")


class _Copier:
    """Runs the tier's copies: synchronously on the CPU; on CUDA on a side stream, ordered
    against the compute stream both ways (module docstring). Times the timed ones."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # timed copies not yet read
        self._seconds = 0.0

    def run(self, copy: Callable[[], None], timed: bool, wait: bool = True) -> torch.cuda.Event | None:
        """Runs `copy`; returns an event recorded after it (None on the CPU: done). wait: the
        compute stream waits for it (else the caller orders its readers)."""
        if self.stream is None:
            t0 = time.perf_counter()
            copy()
            if timed:
                self._seconds += time.perf_counter() - t0
            return None
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True) if timed else None
            if start is not None:
                start.record()
            copy()
            done = torch.cuda.Event(enable_timing=timed)
            done.record()
        if wait:
            compute.wait_event(done)
        if start is not None:
            self._pending.append((start, done))
            if len(self._pending) > 64:  # nothing read the time lately (an offline LLM): fold it in
                _ = self.seconds
        return done

    @property
    def seconds(self) -> float:
        while self._pending and self._pending[0][1].query():  # completed in order: one stream
            start, end = self._pending.pop(0)
            self._seconds += start.elapsed_time(end) / 1000
        return self._seconds

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def _slots(pages: list[int], ps: int) -> list[int]:
    return [p * ps + i for p in pages for i in range(ps)] if ps > 1 else list(pages)
