"""Host-tier loads of a request's prefix (a mixin of RequestKV, scheduler/kv.py).

`match_and_load` extends a GPU prefix match with the host pages that continue it: fresh GPU
pages, a copy back (kvcache/host_tier.py) started on the tier's copy stream, and the pages join
the radix cache at once. The request is admitted in the same step: its attention, like every
extend or mixed step's, waits per chunk of layers for the copy (KVPool.wait_loaded), so the load
overlaps the forward and decode steps never wait. Same on one GPU and with TP (the ranks admit
in lockstep: nothing depends on when a copy completes).
"""

from __future__ import annotations

import logging
from typing import Any

from minisgl.engine.engine import Engine
from minisgl.kvcache.host_tier import HostKVTier
from minisgl.kvcache.prefix_cache import MatchResult, PrefixCache
from minisgl.kvcache.radix_cache import RadixCache
from minisgl.scheduler.request import Request

logger = logging.getLogger(__name__)


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
    if getattr(engine, "graphs", None) is not None:
        # The graphs would hold no wait for the loads (KVPool.enable_load_waits runs below).
        raise RuntimeError("the host KV tier must be built before the engine captures its CUDA graphs")
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

    def match_and_load(self, req: Request) -> MatchResult:
        """`match`, extended by the host tier: host pages continuing the GPU match are copied
        into fresh GPU pages, which join the prefix cache at once (when the pool has room); the
        steps that read them wait for the copy per chunk of layers."""
        match = self.match(req)  # type: ignore[attr-defined]  # RequestKV's
        if self.tier is None or req.needs_prompt_logprobs or req.pooling is not None:
            return match
        tokens = req.tokens()[:-1]
        nodes = self.tier.lookup(tokens, len(match.pages))
        if not nodes:
            return match
        self.cache.lock(match.handle)  # the GPU part must survive the eviction reserve() may do
        self.tier.pin(nodes)  # and the host part the host eviction that eviction may cause
        try:
            if not self.reserve(len(nodes)):  # type: ignore[attr-defined]
                return match
            pages = self.allocator.allocate(len(nodes))
            self.tier.load(nodes, pages)
            m = len(match.pages)
            end = (m + len(nodes)) * self.page_size
            n = self.cache.insert(tuple(tokens[:end]), list(match.pages) + pages) // self.page_size
            if n > m:  # already cached (not expected: the match just ended there): duplicates
                dup = pages[: n - m]
                self.tier.fence(dup)
                self.allocator.free(dup)
        finally:
            self.tier.unpin(nodes)
            self.cache.unlock(match.handle)
        return self.match(req)  # type: ignore[attr-defined]
