"""Per-request hop timestamps (opt-in: MINISGL_TRACE_REQUESTS=1), for finding where a
request's time to first token goes.

A traced request carries a dict hop -> time (seconds of CLOCK_MONOTONIC, which every process
on the host shares) in its messages: TokenizeMsg -> UserMsg -> the first TokenOut -> the first
UserReply. Each process adds its hops; the API server logs the whole as one line when it has
sent the first chunk. Untraced requests carry None and pay nothing.

Hops, in order (each logged as ms since the previous one):
  http       the API server's outermost gate saw the request (headers read)
  submit     parsed, validated and handed to a tokenizer worker
  tok_in     the tokenizer worker received it
  tok_out    tokenized and checked, sent to the scheduler
  sched_in   scheduler rank 0 received it
  admit      the first step that runs its prompt started being built
  launched   the step that samples its first token was launched (host work done)
  ready      the host saw that step's tokens (the GPU finished; with overlap, read after
             the next step was launched)
  emit       its first token was sent to the detokenizer
  detok_in   the detokenizer received it
  detok_out  the detokenizer sent the text
  api_in     the API server received the reply
  sent       the API server wrote the first chunk (or the whole answer) to the socket
"""

from __future__ import annotations

import time

from minisgl import env

HOPS = ("http", "submit", "tok_in", "tok_out", "sched_in", "admit", "launched", "ready", "emit",
        "detok_in", "detok_out", "api_in", "sent")
ENABLED: bool = env.TRACE_REQUESTS


def now() -> float:
    return time.monotonic()


def stamp(trace: dict[str, float] | None, hop: str, at: float | None = None, first: bool = False) -> None:
    """Records `hop` (now, or at `at`) in `trace` (None: untraced). `first`: keep an earlier stamp."""
    if trace is not None and not (first and hop in trace):
        trace[hop] = now() if at is None else at


def start(received: float | None) -> dict[str, float] | None:
    """A new request's trace (None when tracing is off), from when the server received it."""
    if not ENABLED:
        return None
    trace = {"submit": now()}
    trace["http"] = trace["submit"] if received is None else received
    return trace


def request_line(trace: dict[str, float], info: dict[str, object]) -> str:
    """`trace key=value ... http=+0.000 submit=+0.412 ... total=9.3` (ms since the previous hop;
    a hop the request did not pass is left out)."""
    head = " ".join(f"{k}={v}" for k, v in info.items())
    parts, prev = [], None
    for hop in HOPS:
        t = trace.get(hop)
        if t is None:
            continue
        parts.append(f"{hop}=+{0.0 if prev is None else (t - prev) * 1e3:.3f}")
        prev = t
    first = min(trace[h] for h in HOPS if h in trace)
    total = (max(trace[h] for h in HOPS if h in trace) - first) * 1e3
    extra = " ".join(f"{k}={v}" for k, v in trace.items() if k not in HOPS)
    extra += f" t0={first:.6f}"  # CLOCK_MONOTONIC seconds: to line up with a client's own clock
    return f"trace {head} {' '.join(parts)} total={total:.3f} {extra.strip()}"


def parse_request_line(line: str) -> dict[str, str] | None:
    """The key=value fields of a request trace line (deltas keep their '+'), or None."""
    at = line.find("trace ")
    if at < 0:
        return None
    fields = dict(p.split("=", 1) for p in line[at + 6 :].split() if "=" in p)
    return fields if "total" in fields else None
