"""Who gives up KV under pressure, and (with the priority policy) who makes room for a waiting
request of higher priority. Pure policy over the queues and the KV bookkeeping; the Scheduler
retracts whom these name.

Priorities are vLLM's: an integer, smaller runs first; equal priorities keep arrival order.
Under `scheduling_policy="priority"`:
- the waiting queue is ordered by (priority, arrival) (scheduler/queues.py);
- when the running requests need more KV than the pool has, the lowest-priority one (largest
  number) is retracted first, then, as under fcfs, the one with the least progress;
- when the first waiting request cannot be admitted (no request-table row, or its KV estimate
  does not fit), running requests of strictly lower priority are retracted, lowest first,
  until it fits: a burst of low-priority work holds a later high-priority request back by at
  most the step already being formed. Nothing is retracted unless that makes it fit.
"""

from __future__ import annotations

from minisgl.scheduler.kv import RequestKV
from minisgl.scheduler.prefill import expected_pages, reserved_pages
from minisgl.scheduler.queues import RequestQueues
from minisgl.scheduler.request import Request


def retraction_order(reqs: list[Request], by_priority: bool) -> list[Request]:
    """The order in which running requests give up their KV: least progress first (the least
    work to redo), the newest among equals; by priority, the lowest priority before that."""
    if by_priority:
        return sorted(reqs, key=lambda r: (-r.params.priority, len(r.output), -r.uid))
    return sorted(reqs, key=lambda r: (len(r.output), -r.uid))


def preemption_victims(queues: RequestQueues, kv: RequestKV, new_token_ratio: float) -> list[Request]:
    """The active requests to retract so that the first waiting request is admitted in the
    next step; empty when it is admitted anyway, or when retracting every request of lower
    priority would still not make it fit. Uses the admission estimate of scheduler/prefill.py.

    A request mid chunked prefill takes a whole step's budget before anything waiting: one of
    lower priority goes first (its chunks stay in the prefix cache, so little is lost); one of
    equal or higher priority is let finish its prompt."""
    head = queues.next_waiting()
    if head is None:
        return []
    mid = queues.prefilling
    if mid is not None and mid.params.priority <= head.params.priority:
        return []
    lower = [r for r in queues.running if r.params.priority > head.params.priority]
    candidates = ([mid] if mid is not None else []) + retraction_order(lower, by_priority=True)
    if not candidates:
        return []
    rows, reserved, available = kv.free_rows, reserved_pages(queues, kv, new_token_ratio), kv.available_pages
    need = expected_pages(kv, head, new_token_ratio)
    if mid is None and rows > 0 and need + reserved <= available:
        return []  # it fits without its cached prefix: no radix walk (this runs every step)
    need -= len(kv.match(head).pages)

    def fits() -> bool:
        return rows > 0 and (need + reserved <= available or len(victims) == queues.num_active)

    victims: list[Request] = []
    for victim in candidates:
        if fits() and (mid is None or victims):  # (the request mid prefill, if any, goes first)
            break
        victims.append(victim)
        rows += 1
        own = len(victim.pages) - (len(victim.match.pages) if victim.match is not None else 0)
        available += own  # its private pages go to the cache, evictable (its match may be shared)
        reserved -= max(0, expected_pages(kv, victim, new_token_ratio) - len(victim.pages))
    return victims if fits() else []
