"""The scheduler's requests by state, and the only calls that move them between states.

A request is in at most one place: `waiting` (FIFO, a retracted or un-admitted request going
back to its front; under the priority policy ordered by (priority, arrival), so that it goes
back to its own place), `prefilling` (the one request mid chunked prefill) or `running`
(prefilled, decoding).
Admission (prefill.py), the speculative step and the scheduler itself change states through
these calls alone, so each transition is written once.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque

from minisgl.scheduler.request import Request


def _rank(req: Request) -> tuple[int, int]:
    return req.params.priority, req.arrival


class RequestQueues:
    def __init__(self, policy: str = "fcfs") -> None:
        self.by_priority = policy == "priority"
        self._arrivals = itertools.count()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilling: Request | None = None

    @property
    def active(self) -> list[Request]:
        """The requests that hold KV: running, then the one mid prefill."""
        return [*self.running, *([self.prefilling] if self.prefilling is not None else [])]

    @property
    def num_active(self) -> int:
        return len(self.running) + (self.prefilling is not None)

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def add(self, req: Request) -> None:
        req.arrival = next(self._arrivals)
        if self.by_priority:
            bisect.insort(self.waiting, req, key=_rank)
        else:
            self.waiting.append(req)

    def next_waiting(self) -> Request | None:
        return self.waiting[0] if self.waiting else None

    def take_waiting(self) -> Request:
        """The first waiting request leaves the queue (admission took it)."""
        return self.waiting.popleft()

    def requeue(self, req: Request) -> None:
        """Back to the front of the queue (retracted, or its admission undone); by priority, to
        its place among the waiting."""
        if self.by_priority:
            bisect.insort(self.waiting, req, key=_rank)
        else:
            self.waiting.appendleft(req)

    def prefilled(self, req: Request) -> None:
        """Its whole prompt is in the KV cache (or in flight): it decodes from now on."""
        if req is self.prefilling:
            self.prefilling = None
        self.running.append(req)

    def chunked(self, req: Request) -> None:
        """It ran part of its prompt: it continues in the next prefill step."""
        self.prefilling = req

    def remove(self, req: Request) -> None:
        """It leaves whichever state it is in (finished, aborted or retracted)."""
        if req is self.prefilling:
            self.prefilling = None
        elif req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
