"""Host-tier loads of a request's prefix (a mixin of RequestKV, scheduler/kv.py).

`match_and_load` extends a GPU prefix match with the host pages that continue it: fresh GPU
pages, a copy back (kvcache/host_tier.py), then the pages join the radix cache. On one GPU the
copy runs while the batch goes on: the request waits aside until the copy's event completed
(`finished_loads`, at each admission); requests needing the same host pages wait for the same
load; an aborted request's load still lands in the cache. With TP the ranks admit in lockstep,
which a copy's completion time is not: there the next step's forward waits for the copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minisgl.engine.engine import Engine
from minisgl.kvcache.host_tier import HostKVTier
from minisgl.kvcache.prefix_cache import MatchResult, PrefixCache
from minisgl.kvcache.radix_cache import RadixCache
from minisgl.scheduler.request import Request

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PendingLoad:
    """A host-tier load in flight: `pages` (fresh, held here) fill with the KV of `tokens`
    past the locked GPU `match`, from the pinned host `nodes`; `req` (None once aborted) and
    `waiters` (requests that need the same host pages) wait for `done()`."""

    req: Request | None
    tokens: tuple[int, ...]
    match: MatchResult
    nodes: list
    pages: list[int]
    done: Callable[[], bool]
    waiters: list[Request] = field(default_factory=list)


def make_host_tier(engine: Engine, cache: PrefixCache, gb: float) -> HostKVTier | None:
    """The host KV tier of `--host-kv-cache-gb` (None when 0), refusing what it cannot serve."""
    if gb <= 0:
        return None
    if not isinstance(cache, RadixCache):
        raise ValueError("--host-kv-cache-gb needs the radix prefix cache; drop --cache naive")
    if getattr(engine, "swa_allocator", None) is not None:
        # A host copy would need each page's sliding KV too, and the radix cache's tombstones
        # decide which exist: not built. Layers whose window covers the context share the one
        # full pool (no sliding group), and those are served.
        raise ValueError(f"--host-kv-cache-gb does not support {engine.model_config.architecture}: its sliding-window "
                         "layers keep a window-sized KV pool group, which has no host tier yet; run without it")
    if getattr(engine, "state_pool", None) is not None:  # a host hit would need its state snapshot on the host too
        raise ValueError(f"--host-kv-cache-gb does not support {engine.model_config.architecture}: its prefix hits "
                         "need recurrent-state snapshots, which have no host tier yet; run without it")
    if engine.drafter is not None and engine.cfg.speculative_algorithm != "ngram":
        raise ValueError("--host-kv-cache-gb does not restore a draft model's KV yet; use it without "
                         f"--speculative-algorithm {engine.cfg.speculative_algorithm}")
    tier = HostKVTier(engine.pool, gb)
    cache.on_evict = tier.on_evict
    logger.info("host KV tier: %.3f GiB, %d pages of %d tokens (%s host memory)", tier.capacity_bytes / 2**30,
                tier.num_pages, tier.page_size, "pinned" if engine.pool.device.type == "cuda" else "plain")
    return tier


class HostLoads:
    tier: HostKVTier | None
    cache: PrefixCache
    allocator: Any
    page_size: int
    defer_loads: bool
    _loads: list[PendingLoad]

    def match_and_load(self, req: Request) -> MatchResult | None:
        """`match`, extended by the host tier: host pages continuing the GPU match are copied
        into fresh GPU pages and inserted into the prefix cache (when the pool has room).
        None: the copy is in flight and `req` waits for it (`finished_loads`; one GPU). With TP
        the ranks must admit in lockstep, which a copy's completion time is not: there the
        next step's forward waits for the copy instead."""
        match = self.match(req)  # type: ignore[attr-defined]  # RequestKV's
        if self.tier is None or req.needs_prompt_logprobs or req.pooling is not None:
            return match
        tokens = req.tokens()[:-1]
        nodes = self.tier.lookup(tokens, len(match.pages))
        if not nodes:
            return match
        busy = next((ld for ld in self._loads if nodes[0] in ld.nodes), None)
        if busy is not None:  # its next host page is coming back already: wait for that load
            busy.waiters.append(req)
            return None
        self.cache.lock(match.handle)  # the GPU part must survive the eviction reserve() may do
        self.tier.pin(nodes)  # and the host part the host eviction that eviction may cause
        if not self.reserve(len(nodes)):  # type: ignore[attr-defined]
            self.tier.unpin(nodes)
            self.cache.unlock(match.handle)
            return match
        pages = self.allocator.allocate(len(nodes))
        end = (len(match.pages) + len(nodes)) * self.page_size
        load = PendingLoad(req, tuple(tokens[:end]), match, nodes, pages,
                     self.tier.load(nodes, pages, wait=not self.defer_loads))
        if not self.defer_loads or load.done():
            self._finish_load(load)
            return self.match(req)  # type: ignore[attr-defined]
        self._loads.append(load)
        return None

    def _finish_load(self, load: PendingLoad) -> None:
        """The copy is done: its pages join the prefix cache (those some request cached
        meanwhile are duplicates, freed), the locks go."""
        m = len(load.match.pages)
        n = self.cache.insert(load.tokens, list(load.match.pages) + load.pages) // self.page_size
        self.allocator.free(load.pages[: max(0, n - m)])
        assert self.tier is not None
        self.tier.unpin(load.nodes)
        self.cache.unlock(load.match.handle)

    def finished_loads(self) -> list[Request]:
        """Completes the loads whose copies are done; the requests waiting for them (not
        aborted meanwhile), to be queued again."""
        out: list[Request] = []
        for load in [ld for ld in self._loads if ld.done()]:
            self._loads.remove(load)
            self._finish_load(load)
            out.extend(r for r in (load.req, *load.waiters) if r is not None)
        return out

    def _forget_load(self, req: Request) -> None:
        """An aborted request stops waiting; its load runs on (its pages end up cached)."""
        for load in self._loads:
            if load.req is req:
                load.req = None
            if req in load.waiters:
                load.waiters.remove(req)
