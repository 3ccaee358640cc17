"""The prefix cache a server flag names (`--cache {radix,naive}`)."""

from __future__ import annotations

from minisgl.kvcache.events import CacheEvents
from minisgl.kvcache.naive_cache import NaiveCache
from minisgl.kvcache.prefix_cache import PrefixCache
from minisgl.kvcache.radix_cache import RadixCache


def make_prefix_cache(kind: str, page_size: int, events: CacheEvents | None = None, window: int = 0,
                      snapshots: bool = False) -> PrefixCache:
    """`events`: report what the cache stores and drops (KV-cache events); the naive cache
    stores nothing, so it has nothing to report. `window`: the engine's sliding-window KV
    group's W (0: none), whose pages the radix cache keeps beside the full ones. `snapshots`:
    the radix cache holds recurrent-state snapshots (hybrid models; kvcache/radix_snap.py)."""
    if kind == "radix":
        return RadixCache(page_size, events, window, snapshots)
    if kind == "naive":
        return NaiveCache(page_size)
    raise ValueError(f"unknown cache kind {kind!r} (expected 'radix' or 'naive')")
