"""The KV copy's pinned slot-list ring (ops/kv_copy.py `_SlotRing`) on the CPU, with fake events:
regions handed out in order and wrapped, a region in flight never handed out again before its
event has run (the host waits for exactly those), finished regions forgotten, and a request
larger than the ring refused (the caller takes a one-off block)."""

from __future__ import annotations

import torch

from minisgl.ops.kv_copy import _SlotRing


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def test_regions_wrap_and_wait_only_for_overlapping_copies_in_flight() -> None:
    ring = _SlotRing(torch.arange(10, dtype=torch.int32))
    a = ring.take(4)
    assert a is not None and (a[1], a[2]) == (0, 4) and a[0].tolist() == [0, 1, 2, 3]
    ev_a = FakeEvent()
    ring.release(a[1], a[2], ev_a)
    b = ring.take(4)
    assert (b[1], b[2]) == (4, 8)
    ev_b = FakeEvent()
    ring.release(b[1], b[2], ev_b)
    assert not ev_a.waited and not ev_b.waited  # disjoint regions: nobody waits
    c = ring.take(3)  # 8 + 3 > 10: wraps to 0 and overlaps a (in flight): the host waits for a only
    assert (c[1], c[2]) == (0, 3)
    assert ev_a.waited and not ev_b.waited
    ring.release(c[1], c[2], FakeEvent())
    ev_b.done = True
    d = ring.take(5)  # [3, 8): b has run, nothing to wait for; finished regions are forgotten
    assert (d[1], d[2]) == (3, 8) and all(not e.query() for _, _, e in ring.inflight)
    assert len(ring.inflight) == 1


def test_a_request_larger_than_the_ring_is_refused() -> None:
    ring = _SlotRing(torch.zeros(8, dtype=torch.int32))
    assert ring.take(9) is None
    assert ring.take(8) is not None
