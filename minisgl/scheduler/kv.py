"""A request's KV pages: prefix-cache match, growth, release and retraction bookkeeping.

Invariant (checked by `check_integrity`): every page is in exactly one place — the
allocator's free list, the prefix cache, or the private pages of one active request
(`req.pages` past its locked `req.match.pages`). The same holds for the sliding-window group's
pages (`req.swa_pages`, one per page of `req.pages`, 0 where freed) and its own allocator.

Recurrent states (a hybrid model's Gated DeltaNet layers, kvcache/state_pool.py): a request
holds one state slot from admission (`attach`) to `release` (finish, abort, retraction), so a
table row is free for admission only with a state slot free. Prefix hits need a snapshot of
the state where the hit ends (kvcache/radix_snap.py: a match ends at the deepest snapshot on its
path): `attach` copies it into the request's slot. `snapshot` takes one after the step that
computed a prompt up to a position (launched, so the copy follows it on the stream): at each
prompt's end, where its KV match went past its snapshot (the chunk ends there: the next request
sharing that prefix resumes it whole), and at chunk ends every `state_snapshot_interval` tokens;
such an interval snapshot supersedes the prompt's previous one (dropped first, radix_snap.py).
Without snapshot slots (`--state-snapshots 0`) such a model takes no prefix hit; its KV still
goes to the cache.

Sliding window W: before a step with `prefix` cached tokens a request needs sliding slots for
positions >= prefix - W + 1 only (what its sliding layers read); whenever the scheduler next
grows the request, the pages wholly below that are freed (or, where the cache owns them,
offered to `cache.trim_swa`) and their table entries point at the dummy slot.
"""

from __future__ import annotations

import logging

from minisgl.engine.engine import Engine
from minisgl.kvcache.prefix_cache import MatchResult, PrefixCache
from minisgl.kvcache.radix_cache import RadixCache
from minisgl.scheduler.host_loads import HostLoads, make_host_tier
from minisgl.scheduler.request import Request

logger = logging.getLogger(__name__)


class RequestKV(HostLoads):
    def __init__(self, engine: Engine, cache: PrefixCache, host_kv_cache_gb: float = 0.0) -> None:
        self.engine = engine
        self.cache = cache
        self.tier = make_host_tier(engine, cache, host_kv_cache_gb)
        self.page_size = engine.cfg.page_size
        self.allocator = engine.allocator
        self.swa = getattr(engine, "swa_allocator", None)  # the sliding group's pages (or None)
        self.window = engine.swa_window if self.swa is not None else 0  # W of the sliding group
        # Request-table writes wait here and go to the device in one copy (flush) per step.
        # Keyed by (row, position): a row freed and reused before a flush keeps the last write
        # only (one scatter with duplicate indices would pick a winner at random).
        self._pending: dict[tuple[int, int], int] = {}
        self._pending_swa: dict[tuple[int, int], int] = {}
        self.states = getattr(engine, "state_pool", None)  # recurrent-state slots (None: no linear layers)
        self._pending_states: dict[int, int] = {}  # row -> state slot (-1: none), flushed with the rest
        # Hybrid models: prefix hits resume from state snapshots held by the radix cache.
        self.snapshots = self.states is not None and self.states.num_snapshots > 0 and isinstance(cache, RadixCache)
        self.snapshot_interval = engine.cfg.state_snapshot_interval if self.snapshots else 0
        if self.snapshots:
            cache.free_snapshot = self.states.free_snapshot  # type: ignore[attr-defined]
        elif self.states is not None:
            logger.info("%s: prefix-cache hits are off (no state snapshot slots, or not the radix cache); "
                        "every prompt is computed from its first token", engine.model_config.architecture)

    def _write(self, row: int, start: int, pages: list[int], swa: bool = False) -> None:
        pending = self._pending_swa if swa else self._pending
        for i, slot in enumerate(self.allocator.slot_ids(pages)):  # page 0: the dummy slots
            pending[(row, start + i)] = slot

    def flush(self) -> None:
        """Sends the pending request-table writes (before the batch that reads them)."""
        for pending, swa in ((self._pending, False), (self._pending_swa, True)):
            if pending:
                keys = list(pending)
                self.engine.write_slots([k[0] for k in keys], [k[1] for k in keys], list(pending.values()), swa=swa)
        self._pending, self._pending_swa = {}, {}
        if self._pending_states:
            self.engine.write_state_slots(list(self._pending_states), list(self._pending_states.values()))
            self._pending_states = {}

    def _free_swa(self, pages: list[int]) -> None:
        """Gives sliding pages (0s skipped) and those the cache dropped back to the allocator."""
        if self.swa is not None:
            self.swa.free([p for p in pages if p] + self.cache.take_freed_swa())

    def flush_cache(self, active: list[Request]) -> str | None:
        """Empties the prefix cache unless an `active` request holds some of its pages; returns
        why not, or None once flushed. (A step in flight writes only pages its requests hold,
        or later the same stream's work does; a host-tier load still in flight is fenced.)"""
        held = self.cache.protected_pages
        if held:
            holders = sum(1 for r in active if r.match is not None and r.match.pages)
            return (f"{held} cached pages are in use by {holders} running request(s) sharing a cached prefix; "
                    "retry once they finish")
        if self.tier is not None:
            self.tier.fence()  # a load still in flight may write some of the pages freed here
        self.allocator.free(self.cache.reset())
        self._free_swa([])
        if self.tier is not None:
            self.tier.reset()
        return None

    @property
    def available_pages(self) -> int:
        """Free pages plus what eviction could free now."""
        return self.allocator.free_pages + self.cache.evictable_pages

    def swa_stats(self) -> dict[str, int]:
        """The sliding group's slots in all and in use (cached prefixes' evictable ones free),
        for StatsMsg and /metrics; empty without a sliding group."""
        if self.swa is None:
            return {}
        ps, total = self.page_size, self.swa.total_pages
        used = total - self.swa.free_pages - self.cache.evictable_swa_pages
        return {"kv_swa_slots_total": total * ps, "kv_swa_slots_used": used * ps}

    def state_stats(self) -> dict[str, int]:
        """Recurrent-state slots in all and held by requests, snapshot slots in all and held by the
        prefix cache (StatsMsg, /metrics); empty without."""
        if self.states is None:
            return {}
        return {"state_slots_total": self.states.num_slots,
                "state_slots_used": self.states.num_slots - self.states.free_slots,
                "state_snapshots_total": self.states.num_snapshots,
                "state_snapshots": self.states.num_snapshots - self.states.free_snapshots}

    @property
    def free_rows(self) -> int:
        """Request-table rows free for new requests (each with a state slot, where it needs one)."""
        rows = self.engine.table.free_rows
        return rows if self.states is None else min(rows, self.states.free_slots)

    def check_fits(self, req: Request, step_tokens: int) -> None:
        """Raises ValueError if `req` could not run alone: all its tokens in the full pool, and
        its window plus one step's new tokens (two partial pages) in the sliding pool."""
        if self.pages_for(req.max_total_len) > self.allocator.total_pages:
            raise ValueError(
                f"request needs up to {req.max_total_len} tokens of KV cache but the pool holds "
                f"{self.allocator.total_pages * self.page_size}"
            )
        if self.swa is not None:
            need = self.pages_for(min(req.max_total_len, self.window + step_tokens)) + 2
            if need > self.swa.total_pages:
                raise ValueError(
                    f"request needs up to {need * self.page_size} sliding-window KV slots (window {self.window} + "
                    f"a {step_tokens}-token step) but that pool holds {self.swa.total_pages * self.page_size}; "
                    "raise --swa-full-tokens-ratio or lower --max-prefill-tokens"
                )

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def match(self, req: Request) -> MatchResult:
        # Prompt logprobs need every prompt position's logits; an embedding, its hidden states.
        # A hybrid model without snapshots: nothing to resume its state from (module docstring).
        if req.needs_prompt_logprobs or req.pooling is not None or (self.states is not None and not self.snapshots):
            return self.cache.match_prefix([])
        # At least one token must be computed (its logits pick the next token).
        return self.cache.match_prefix(req.tokens()[:-1])

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
        if self.swa is not None:
            req.swa_pages, req.swa_lo = list(match.swa_pages), 0
            self._write(req.row, 0, req.swa_pages, swa=True)
        if self.states is not None:  # free_rows counted it: a slot is free
            req.state_slot = self.states.allocate()
            self._pending_states[req.row] = req.state_slot
            if match.snapshot >= 0:  # the state after the hit (the KV match cut to it)
                self.states.copy(match.snapshot, req.state_slot)
            req.snap_at = match.branch_tokens if self.snapshots else 0
            req.interval_snap = 0  # a requeued request's old one may since be another prompt's

    def snapshot(self, req: Request, prefix: int) -> None:
        """After the launch of the step that computed `req`'s prompt from `prefix` to
        `req.cached_len`: snapshot its state there, if that is a snapshot point (module
        docstring). Its KV up to there goes to the cache first (the node the snapshot hangs on)."""
        pos = req.cached_len
        if not self.snapshots or req.pooling is not None or pos % self.page_size:
            return
        prompt_end = pos == len(req.prompt)
        branch = pos == req.snap_at
        if branch:
            req.snap_at = 0
        crossed = pos // self.snapshot_interval > prefix // self.snapshot_interval
        if not (prompt_end or branch or crossed):
            return
        # A snapshot taken only for the interval supersedes this prompt's previous one (radix_snap.py).
        interval = crossed and not (prompt_end or branch)
        if req.match is None or req.match.matched_tokens < pos:  # a chunk's KV is cached already
            self.cache_progress(req)
        if interval and 0 < req.interval_snap <= prefix:  # this pass's own; before a drop picks its victim
            self.cache.supersede_snapshot(req.tokens()[: req.interval_snap])  # type: ignore[attr-defined]
        slot = self.states.allocate_snapshot()
        if slot is None and self.cache.drop_lru_snapshot():  # type: ignore[attr-defined]
            slot = self.states.allocate_snapshot()
        if slot is None:
            return
        if self.cache.set_snapshot(req.tokens()[:pos], slot):  # type: ignore[attr-defined]
            self.states.copy(req.state_slot, slot)
            if interval:
                req.interval_snap = pos
        else:  # that prefix has one already
            self.states.free_snapshot(slot)

    def grow(self, req: Request, tokens: int) -> bool:
        """Ensures slots for positions [0, tokens); evicts cached prefixes if it must.
        Returns False (changing nothing) when the pool cannot hold it."""
        self._trim(req)
        need = self.pages_for(tokens) - len(req.pages)
        if need <= 0:
            return True
        if not self.reserve(need) or not self.reserve_swa(need):
            return False
        start = len(req.pages) * self.page_size
        new = self.allocator.allocate(need)
        req.pages.extend(new)
        self._write(req.row, start, new)
        if self.swa is not None:
            new_swa = self.swa.allocate(need)
            req.swa_pages.extend(new_swa)
            self._write(req.row, start, new_swa, swa=True)
        return True

    def _trim(self, req: Request) -> None:
        """Frees the request's sliding pages wholly below its window (module docstring)."""
        if self.swa is None or req.match is None:
            return
        bound = min(req.cached_len, req.seq_len - 1)  # the next step's prefix, at the least
        lo = min(max(0, bound - self.window + 1) // self.page_size, len(req.swa_pages))
        if lo <= req.swa_lo:
            return
        m = len(req.match.pages)
        self._free_swa(req.swa_pages[max(m, req.swa_lo) : lo])
        if req.swa_lo < min(lo, m):  # part of it is the cache's: it frees what no one reads
            self.cache.trim_swa(req.match.handle, bound)
            self._free_swa([])
        req.swa_pages[req.swa_lo : lo] = [0] * (lo - req.swa_lo)
        self._write(req.row, req.swa_lo * self.page_size, [0] * (lo - req.swa_lo), swa=True)
        req.swa_lo = lo

    def reserve_swa(self, pages: int) -> bool:
        """Makes `pages` sliding pages free, evicting least-recently-used cached prefixes."""
        if self.swa is None:
            return True
        short = pages - self.swa.free_pages
        if short > 0:
            if short > self.cache.evictable_swa_pages:
                return False
            self.allocator.free(self.cache.evict(0, short))
            self._free_swa([])
        return self.swa.free_pages >= pages

    def shrink(self, req: Request, tokens: int) -> None:
        """Frees the request's private pages past the first `tokens` positions (the slots of
        rejected draft tokens). Table entries past them go stale; a later grow rewrites them."""
        keep = max(self.pages_for(tokens), len(req.match.pages) if req.match is not None else 0)
        if keep < len(req.pages):
            self.allocator.free(req.pages[keep:])
            del req.pages[keep:]
            if self.swa is not None:
                self._free_swa(req.swa_pages[keep:])
                del req.swa_pages[keep:]

    def reserve(self, pages: int) -> bool:
        """Makes `pages` pages free, evicting least-recently-used cached prefixes."""
        short = pages - self.allocator.free_pages
        if short > 0:
            if short > self.cache.evictable_pages:
                return False
            self.allocator.free(self.cache.evict(short))
            self._free_swa([])  # the evicted prefixes' sliding pages
        return self.allocator.free_pages >= pages

    def release(self, req: Request) -> None:
        """A finished, aborted or retracted request hands its computed KV to the prefix cache
        and frees the rest, plus its table row."""
        if req.match is None:
            return
        # An embedding's KV is not kept: no later request could use it (they match nothing).
        computed = [] if req.pooling is not None else req.tokens()[: req.cached_len]
        swa = req.swa_pages if self.swa is not None else None
        to_free = self.cache.cache_finished_request(computed, req.pages, req.match, swa)
        self.allocator.free(to_free)
        self._free_swa([])
        if req.state_slot >= 0:
            self.states.free(req.state_slot)
            self._pending_states[req.row] = -1
            req.state_slot = -1
        self.engine.table.free_row(req.row)
        req.match, req.pages, req.row, req.swa_pages, req.swa_lo = None, [], -1, [], 0

    def cache_progress(self, req: Request) -> None:
        """After a prefill chunk: let the cache hold what the request computed so far (other
        requests sharing the prompt can reuse it), keeping it locked for this request."""
        assert req.match is not None
        old_m = len(req.match.pages)
        computed = req.tokens()[: req.cached_len]
        swa = req.swa_pages if self.swa is not None else None
        match, pages, to_free = self.cache.cache_unfinished_request(computed, req.pages, req.match, swa)
        self.allocator.free(to_free)
        self._free_swa([])
        new_m = len(match.pages)
        if new_m > old_m:  # positions whose pages were replaced by the cached copies
            changed = match.pages[old_m:new_m]
            self._write(req.row, old_m * self.page_size, changed)
            if self.swa is not None:
                self._write(req.row, old_m * self.page_size, match.swa_pages[old_m:new_m], swa=True)
        if self.swa is not None:
            req.swa_pages = match.swa_pages + req.swa_pages[new_m:]
        req.match, req.pages = match, pages
        self._trim(req)

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
        if self.states is not None:
            held = [r.state_slot for r in active if r.state_slot >= 0]
            assert all(r.state_slot >= 0 for r in active if r.match is not None), "an admitted request has no state"
            assert len(held) == len(set(held)), "a state slot is held by two requests"
            assert not set(self.states.free_slot_ids()).intersection(held), "a state slot is free and held"
            assert self.states.free_slots + len(held) == self.states.num_slots, (
                f"state accounting broken: free {self.states.free_slots} + held {len(held)} != {self.states.num_slots}"
            )
            snaps = self.cache.snapshot_slots() if self.snapshots else []  # type: ignore[attr-defined]
            free_snaps = self.states.free_snapshot_ids()
            assert sorted(snaps + free_snaps) == list(range(self.states.num_slots, self.states.total_slots)), (
                f"snapshot slots leaked or doubled: {len(snaps)} held by the cache + {len(free_snaps)} free != "
                f"{self.states.num_snapshots}"
            )
        if self.swa is not None:
            mine = [p for r in active if r.match is not None for p in r.swa_pages[len(r.match.pages) :] if p]
            free, cached, total = self.swa.free_pages, self.cache.cached_swa_pages, self.swa.total_pages
            assert len(mine) == len(set(mine)), "a sliding page is private to two requests"
            assert free + cached + len(mine) == total, (
                f"sliding KV accounting broken: free {free} + cached {cached} + in use {len(mine)} != total {total}"
            )
            assert not self.cache.cached_swa_page_ids().intersection(mine), "a sliding page is cached and private"
            assert not set(self.swa.free_page_ids()).intersection(mine), "a sliding page is free and private"
