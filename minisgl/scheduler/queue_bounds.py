"""Scheduler rank 0's half of the bounded queue (the API holds the other: server/admission.py).

Two refusals need what only the scheduler knows, and both answer the API with an error reply
whose `error_code` makes it a 503 with Retry-After:
- `queue_tokens`: the prompt tokens already waiting plus this request's would pass
  `max_tokens` (--max-queued-tokens, per replica). The prompt had to be tokenized to know its
  length; nothing else is done for it. A request that finds the queue empty is never refused
  (a prompt larger than the bound could otherwise never run).
- `queue_timeout`: a request still waiting for admission at its deadline (`UserMsg.admit_by`,
  the API's arrival time + --max-queue-wait-s, CLOCK_MONOTONIC, which the host's processes
  share) leaves the queue. Rank 0 checks between steps, so the answer comes at most one step
  late. Requests that produced tokens (retracted ones, back in the queue) are never expired:
  their client is being answered.

Rank 0 decides; the removal reaches every TP rank as a "finish" input (scheduler/tp_sync.py),
applied before the next step on all of them alike.
"""

from __future__ import annotations

from collections.abc import Iterable

from minisgl.scheduler.request import Request

QUEUE_TOKENS = "queue_tokens"
QUEUE_TIMEOUT = "queue_timeout"
TIMEOUT_MESSAGE = (
    "the server is overloaded: the request was not admitted within --max-queue-wait-s; retry later or elsewhere"
)


def waiting_tokens(waiting: Iterable[Request]) -> int:
    """Tokens the waiting requests still have to prefill (a retracted one: its output too)."""
    return sum(r.total_len for r in waiting)


class QueueBounds:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens  # 0: no bound
        self.deadlines: dict[int, float] = {}  # uid -> admit_by, while the scheduler holds it
        self._earliest = float("inf")  # no deadline passes before this (a lower bound: forget() keeps it)
        # The waiting tokens, counted once per batch of received messages (a scan of the queue)
        # and kept up to date by the requests accepted since (they join the queue at the next
        # exchange of inputs, after the batch).
        self._tokens: int | None = None

    def new_batch(self) -> None:
        self._tokens = None

    def refuse(
        self, waiting: Iterable[Request], prompt_len: int, admit_by: float | None, now: float
    ) -> tuple[str, str] | None:
        """(error_code, message) when a new request must be refused, else None (it is counted).
        `waiting`: the scheduler's waiting requests (scanned only when the count is stale)."""
        if admit_by is not None and now >= admit_by:  # it waited its time before reaching the queue
            return QUEUE_TIMEOUT, TIMEOUT_MESSAGE
        if self.max_tokens:
            if self._tokens is None:
                self._tokens = waiting_tokens(waiting)
            if self._tokens and self._tokens + prompt_len > self.max_tokens:
                return QUEUE_TOKENS, (
                    f"the server is overloaded: {self._tokens} prompt tokens are waiting and this request's "
                    f"{prompt_len} would pass --max-queued-tokens {self.max_tokens}; retry later or elsewhere"
                )
            self._tokens += prompt_len
        return None

    def track(self, uid: int, admit_by: float | None) -> None:
        if admit_by is not None:
            self.deadlines[uid] = admit_by
            self._earliest = min(self._earliest, admit_by)

    def forget(self, uid: int) -> None:
        self.deadlines.pop(uid, None)

    def expired(self, waiting: Iterable[Request], now: float) -> list[Request]:
        """Waiting requests past their deadline that have produced nothing yet."""
        if now < self._earliest:  # called every step: the queue is scanned only once a deadline passed
            return []
        get = self.deadlines.get
        late = [r for r in waiting if not r.output and (d := get(r.uid)) is not None and d <= now]
        late_uids = {r.uid for r in late}
        self._earliest = min((d for u, d in self.deadlines.items() if u not in late_uids), default=float("inf"))
        return late
