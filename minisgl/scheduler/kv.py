"""A request's KV pages: prefix-cache match, growth, release and retraction bookkeeping.

Invariant (checked by `check_integrity`): every page is in exactly one place — the
allocator's free list, the prefix cache, or the private pages of one active request
(`req.pages` past its locked `req.match.pages`).
"""

from __future__ import annotations

import logging

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
    if engine.model_config.has_sliding_layers:
        raise ValueError("--host-kv-cache-gb does not support models with sliding-window layers yet "
                         "(their window pool has no host tier); run without it")
    if engine.drafter is not None and engine.cfg.speculative_algorithm != "ngram":
        raise ValueError("--host-kv-cache-gb does not restore a draft model's KV yet; use it without "
                         f"--speculative-algorithm {engine.cfg.speculative_algorithm}")
    tier = HostKVTier(engine.pool, gb)
    cache.on_evict = tier.on_evict
    logger.info("host KV tier: %.3f GiB, %d pages of %d tokens (%s host memory)", tier.capacity_bytes / 2**30,
                tier.num_pages, tier.page_size, "pinned" if engine.pool.device.type == "cuda" else "plain")
    return tier


class RequestKV:
    def __init__(self, engine: Engine, cache: PrefixCache, host_kv_cache_gb: float = 0.0) -> None:
        self.engine = engine
        self.cache = cache
        self.tier = make_host_tier(engine, cache, host_kv_cache_gb)
        self.page_size = engine.cfg.page_size
        self.allocator = engine.allocator
        # Request-table writes wait here and go to the device in one copy (flush) per step.
        # Keyed by (row, position): a row freed and reused before a flush keeps the last write
        # only (one scatter with duplicate indices would pick a winner at random).
        self._pending: dict[tuple[int, int], int] = {}

    def _write(self, row: int, start: int, pages: list[int]) -> None:
        for i, slot in enumerate(self.allocator.slot_ids(pages)):
            self._pending[(row, start + i)] = slot

    def flush(self) -> None:
        """Sends the pending request-table writes (before the batch that reads them)."""
        if self._pending:
            keys = list(self._pending)
            self.engine.write_slots([k[0] for k in keys], [k[1] for k in keys], list(self._pending.values()))
            self._pending = {}

    def flush_cache(self, active: list[Request]) -> str | None:
        """Empties the prefix cache unless an `active` request holds some of its pages; returns
        why not, or None once flushed. (A step in flight writes only pages its requests hold,
        or later the same stream's work does: nothing to wait for.)"""
        held = self.cache.protected_pages
        if held:
            holders = sum(1 for r in active if r.match is not None and r.match.pages)
            return (f"{held} cached pages are in use by {holders} running request(s) sharing a cached prefix; "
                    "retry once they finish")
        self.allocator.free(self.cache.reset())
        if self.tier is not None:
            self.tier.reset()
        return None

    @property
    def available_pages(self) -> int:
        """Free pages plus what eviction could free now."""
        return self.allocator.free_pages + self.cache.evictable_pages

    @property
    def free_rows(self) -> int:
        """Request-table rows free for new requests."""
        return self.engine.table.free_rows

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def match(self, req: Request) -> MatchResult:
        # Prompt logprobs need every prompt position's logits; an embedding, its hidden states.
        if req.needs_prompt_logprobs or req.pooling is not None:
            return self.cache.match_prefix([])
        # At least one token must be computed (its logits pick the next token).
        return self.cache.match_prefix(req.tokens()[:-1])

    def match_and_load(self, req: Request) -> MatchResult:
        """`match`, extended by the host tier: host pages continuing the GPU match are copied
        into fresh GPU pages and inserted into the prefix cache (when the pool has room)."""
        match = self.match(req)
        if self.tier is None or req.needs_prompt_logprobs or req.pooling is not None:
            return match
        tokens = req.tokens()[:-1]
        nodes = self.tier.lookup(tokens, len(match.pages))
        if not nodes:
            return match
        self.cache.lock(match.handle)  # the GPU part must survive the eviction reserve() may do
        self.tier.pin(nodes)  # and the host part the host eviction that eviction may cause
        try:
            if not self.reserve(len(nodes)):
                return match
            pages = self.allocator.allocate(len(nodes))
            self.tier.load(nodes, pages)
            end = (len(match.pages) + len(nodes)) * self.page_size
            self.cache.insert(tokens[:end], list(match.pages) + pages)
        finally:
            self.tier.unpin(nodes)
            self.cache.unlock(match.handle)
        return self.match(req)

    def attach(self, req: Request, match: MatchResult) -> None:
        """Gives a new (or requeued) request its table row and its cached prefix, locked."""
        self.cache.lock(match.handle)
        req.match = match
        req.pages = list(match.pages)
        req.cached_len = match.matched_tokens
        req.cache_hit_tokens = max(req.cache_hit_tokens, min(match.matched_tokens, len(req.prompt)))
        req.row = self.engine.table.allocate_row()
        if req.pages:
            self._write(req.row, 0, req.pages)

    def grow(self, req: Request, tokens: int) -> bool:
        """Ensures slots for positions [0, tokens); evicts cached prefixes if it must.
        Returns False (changing nothing) when the pool cannot hold it."""
        need = self.pages_for(tokens) - len(req.pages)
        if need <= 0:
            return True
        if not self.reserve(need):
            return False
        start = len(req.pages) * self.page_size
        new = self.allocator.allocate(need)
        req.pages.extend(new)
        self._write(req.row, start, new)
        return True

    def shrink(self, req: Request, tokens: int) -> None:
        """Frees the request's private pages past the first `tokens` positions (the slots of
        rejected draft tokens). Table entries past them go stale; a later grow rewrites them."""
        keep = max(self.pages_for(tokens), len(req.match.pages) if req.match is not None else 0)
        if keep < len(req.pages):
            self.allocator.free(req.pages[keep:])
            del req.pages[keep:]

    def reserve(self, pages: int) -> bool:
        """Makes `pages` pages free, evicting least-recently-used cached prefixes."""
        short = pages - self.allocator.free_pages
        if short > 0:
            if short > self.cache.evictable_pages:
                return False
            self.allocator.free(self.cache.evict(short))
        return self.allocator.free_pages >= pages

    def release(self, req: Request) -> None:
        """A finished, aborted or retracted request hands its computed KV to the prefix cache
        and frees the rest, plus its table row."""
        if req.match is None:
            return
        # An embedding's KV is not kept: no later request could use it (they match nothing).
        computed = [] if req.pooling is not None else req.tokens()[: req.cached_len]
        to_free = self.cache.cache_finished_request(computed, req.pages, req.match)
        self.allocator.free(to_free)
        self.engine.table.free_row(req.row)
        req.match, req.pages, req.row = None, [], -1

    def cache_progress(self, req: Request) -> None:
        """After a prefill chunk: let the cache hold what the request computed so far (other
        requests sharing the prompt can reuse it), keeping it locked for this request."""
        assert req.match is not None
        old_m = len(req.match.pages)
        computed = req.tokens()[: req.cached_len]
        match, pages, to_free = self.cache.cache_unfinished_request(computed, req.pages, req.match)
        self.allocator.free(to_free)
        new_m = len(match.pages)
        if new_m > old_m:  # positions whose pages were replaced by the cached copies
            changed = match.pages[old_m:new_m]
            self._write(req.row, old_m * self.page_size, changed)
        req.match, req.pages = match, pages

    def check_integrity(self, active: list[Request]) -> None:
        self.cache.check_integrity()
        if self.tier is not None:
            self.tier.check_integrity()
        private: list[int] = []
        for r in active:
            if r.match is not None:
                head = r.pages[: len(r.match.pages)]
                assert head == r.match.pages, f"request {r.uid}: pages do not start with its match"
                private.extend(r.pages[len(r.match.pages) :])
        free = self.allocator.free_pages
        cached = self.cache.cached_pages
        total = self.allocator.total_pages
        assert len(private) == len(set(private)), "a page is private to two requests"
        assert free + cached + len(private) == total, (
            f"KV accounting broken: free {free} + cached {cached} + in use {len(private)} != total {total}"
        )
        cached_ids = self.cache.cached_page_ids()
        assert not cached_ids.intersection(private), "a page is both cached and private to a request"
