"""The radix cache's recurrent-state snapshots (a mixin of RadixCache, kvcache/radix_cache.py).

A hybrid model's Gated DeltaNet layers keep no KV per token, only a state after the last one, so
a prefix hit needs that state as of the hit's end. With `snapshots` on, a node may hold `snap`:
a snapshot slot of the state pool (kvcache/state_pool.py) holding the state after exactly the
tokens up to the node's end. The match rule: a match ends at the deepest node of its path that
holds a snapshot (0 if none), so the request resumes the recurrence there and recomputes the
rest; `MatchResult.kv_tokens` keeps the KV-only match length (the branch point: the scheduler
snapshots there when it recomputes past it, so the next request sharing it hits it whole).

A split keeps `snap` on the lower node (its end does not move). Snapshots are dropped with their
node's eviction, by `reset`, and least-recently-matched first by `drop_lru_snapshot` when the
scheduler needs a slot; each dropped slot goes to `free_snapshot` (the pool's free list).
A superseded snapshot (`supersede_snapshot`) moves to the front of that order: a
long prompt's interval snapshots each make the one before it on the same path nearly useless
(only a prompt that leaves the path between the two resumes from it), and keeping them all in
LRU order let a few long prompts push every other prompt's snapshots out (issue 34's
`--documents` workload: 12 documents of 16k tokens, 32 slots, no hit at all at interval 1024).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any


class StateSnapshots:
    page_size: int
    snapshots: bool
    _root: Any
    _clock: int
    # Called with each snapshot slot the cache lets go (the state pool's free_snapshot).
    free_snapshot: Callable[[int], None] | None

    def _init_snapshots(self) -> None:
        self._snaps: OrderedDict[Any, None] = OrderedDict()  # nodes holding a snapshot, LRU first

    def _snapshot_cut(self, node: Any) -> Any:
        """The deepest node at or above `node` holding a snapshot (the root if none); touched."""
        while node is not self._root and node.snap < 0:
            node = node.parent
        if node is not self._root:
            self._snaps.move_to_end(node)
        return node

    def set_snapshot(self, token_ids: Sequence[int], slot: int) -> bool:
        """Hands snapshot `slot` (the state after `token_ids`, whole pages) to the node ending
        there. False (the caller keeps the slot) when those tokens are not all cached or that
        prefix already has a snapshot."""
        if not self.snapshots:
            raise RuntimeError("set_snapshot on a prefix cache built without snapshots")
        ids = tuple(token_ids)
        if not ids or len(ids) % self.page_size:
            return False
        self._clock += 1
        node, matched = self._walk(ids, self._clock)  # type: ignore[attr-defined]  # RadixCache's; splits there
        if matched != len(ids) or node.snap >= 0:
            return False
        node.snap = slot
        self._snaps[node] = None
        return True

    def supersede_snapshot(self, token_ids: Sequence[int]) -> None:
        """Moves the snapshot after exactly `token_ids`, if there is one, to the front of the
        drop order (module docstring). Touches nothing else: no split, no clock."""
        ids, ps = tuple(token_ids), self.page_size
        node, pos = self._root, 0
        while pos < len(ids):
            node = node.children.get(ids[pos : pos + ps])
            if node is None or node.key != ids[pos : pos + len(node.key)]:
                return
            pos += len(node.key)
        if node is not self._root and node.snap >= 0:
            self._snaps.move_to_end(node, last=False)

    def drop_lru_snapshot(self) -> bool:
        """Frees the least recently matched snapshot (its node keeps its KV); False if none."""
        if not self._snaps:
            return False
        node, _ = self._snaps.popitem(last=False)
        self._release_snapshot(node, listed=False)
        return True

    def _release_snapshot(self, node: Any, listed: bool = True) -> None:
        if node.snap < 0:
            return
        slot, node.snap = node.snap, -1
        if listed:
            del self._snaps[node]
        if self.free_snapshot is not None:
            self.free_snapshot(slot)

    def _reset_snapshots(self) -> None:
        for node in list(self._snaps):
            self._release_snapshot(node)

    @property
    def num_snapshots(self) -> int:
        return len(self._snaps)

    def snapshot_slots(self) -> list[int]:
        return [n.snap for n in self._snaps]
