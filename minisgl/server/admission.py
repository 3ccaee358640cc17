"""Admission at the API's door: the bounded queue's API half, the drain's refusals, and the
503 that every refusal for load gets.

A refusal is an OpenAI error object with `type: "server_overloaded"` and `code` naming the
reason, status 503 and `Retry-After`, sent before the request costs anything it need not:
- `queue_full` (here, before tokenizing): the generations accepted but not yet generating
  (tokenizing, waiting for admission, in prefill: those without a first reply) would pass
  --max-queued-requests. A request that finds none queued is never refused.
- `queue_tokens`, `queue_timeout`: the scheduler's (scheduler/queue_bounds.py), which come
  back as error replies with that `error_code`. The deadline of `queue_timeout` is set here
  (`admit_by`), from the time the HTTP request came in.
- `draining`: after SIGTERM (launch/drain.py) every new request, with `Connection: close`
  so that a client's next try opens a connection elsewhere.
/metrics counts refusals by reason (`minisgl_requests_refused_total{reason}`) and shows what
--max-queued-requests bounds (`minisgl_queued_generations`) and `minisgl_draining`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge

from minisgl.server.errors import ApiError

REASONS = ("queue_full", "queue_tokens", "queue_timeout", "draining")
# Seconds a refused client should wait before trying again. Short: the queue moves in seconds,
# and a router or client behind a load balancer retries where there is room (the openai client
# honours up to 60 s; its default backoff without the header is 0.5-8 s).
RETRY_AFTER_S = 1


class Overloaded(ApiError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message, None, 503, reason, "server_overloaded")  # code: the reason

    def response(self, headers: dict[str, str] | None = None, path: str | None = None) -> JSONResponse:
        extra = {"retry-after": str(RETRY_AFTER_S)}
        if self.code == "draining":
            extra["connection"] = "close"
        return super().response({**extra, **(headers or {})}, path)


@dataclass(frozen=True)
class QueueLimits:
    """The bounds the API enforces or stamps (0: none); the launcher resolves the defaults."""

    max_queued_requests: int = 0
    max_queue_wait_s: float = 0.0


class Admission:
    def __init__(self, limits: QueueLimits, registry: CollectorRegistry, queued: Callable[[], int]) -> None:
        self.limits = limits
        self.queued = queued
        self.draining = False
        self.refused = Counter(
            "minisgl_requests_refused",
            "Requests refused with 503 for load, by reason: queue_full, queue_tokens, queue_timeout, draining",
            ["reason"],
            registry=registry,
        )
        for reason in REASONS:
            self.refused.labels(reason)  # every series from the start, at 0
        Gauge("minisgl_draining", "1 once SIGTERM started the drain", registry=registry).set_function(
            lambda: float(self.draining)
        )
        Gauge(
            "minisgl_queued_generations",
            "Generations accepted but not generating yet (tokenizing, waiting, in prefill): what --max-queued-requests "
            "bounds",
            registry=registry,
        ).set_function(queued)

    def check(self, generations: int, metered: bool) -> None:
        """Raises Overloaded when a new request of `generations` must be refused now."""
        queued = self.queued()
        if self.draining:
            raise self.refuse("draining", "the server is shutting down (draining after SIGTERM); retry elsewhere")
        limit = self.limits.max_queued_requests
        if metered and limit and queued and queued + generations > limit:
            raise self.refuse(
                "queue_full",
                f"the server is overloaded: {queued} requests are waiting to start (--max-queued-requests {limit}); "
                "retry later or elsewhere",
            )

    def refuse(self, reason: str, message: str) -> Overloaded:
        self.refused.labels(reason).inc()
        return Overloaded(reason, message)

    def admit_by(self, received: float | None) -> float | None:
        """The CLOCK_MONOTONIC deadline for a request that came in at `received`."""
        wait = self.limits.max_queue_wait_s
        if not wait:
            return None
        return (time.monotonic() if received is None else received) + wait

    def start_drain(self) -> None:
        self.draining = True
