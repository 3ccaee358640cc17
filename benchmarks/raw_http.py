"""A minimal HTTP/1.1 client for the load benchmarks (overload.py, soak.py): one connection per
request (`Connection: close`), asyncio streams, the status line and each Server-Sent Event
timed on arrival. It costs a fraction of httpx per request, so that hundreds of clients in one
process on a small machine measure the server, not the client. Any HTTP server will do.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Reply:
    status: int = 0  # 0: no status line came (connection error, or cancelled before it)
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""  # a stream's too, undecoded
    events: list[str] = field(default_factory=list)  # SSE `data:` payloads, in order
    t_status: float | None = None  # seconds from connecting to the status line
    t_first_event: float | None = None
    t_end: float = 0.0
    complete: bool = False  # the whole body was read
    cancelled: bool = False  # the client hung up on purpose (cancel_after / cancel_events)
    error: str = ""  # a connection error

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error_code(self) -> str | None:
        """`error.code` of an OpenAI error object (body, or an error event), if any."""
        for text in [self.body.decode(errors="replace")] if self.status != 200 else self.events:
            try:
                err = json.loads(text).get("error")
            except (ValueError, AttributeError):
                continue
            if isinstance(err, dict):
                return str(err.get("code") or err.get("type"))
        return None


def _request(method: str, url: str, path: str, body: dict[str, Any] | None, headers: dict[str, str]) -> bytes:
    u = urlsplit(url)
    data = b"" if body is None else json.dumps(body).encode()
    lines = [
        f"{method} {u.path.rstrip('/')}{path} HTTP/1.1",
        f"Host: {u.netloc}",
        "Connection: close",
        f"Content-Length: {len(data)}",
        "Content-Type: application/json",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str], on_data: Any) -> None:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            on_data(await reader.readexactly(size))
            await reader.readexactly(2)
    elif "content-length" in headers:
        on_data(await reader.readexactly(int(headers["content-length"])))
    else:
        while chunk := await reader.read(65536):
            on_data(chunk)


async def request(
    method: str,
    url: str,
    path: str,
    body: dict[str, Any] | None = None,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 600.0,
    cancel_after: float | None = None,
    cancel_events: int | None = None,
) -> Reply:
    """One request. `cancel_after` seconds, or after `cancel_events` SSE events, the client
    hangs up (a cancelled request, as a user closing a tab)."""
    reply, start = Reply(), time.monotonic()
    u = urlsplit(url)
    pending = b""

    def on_data(chunk: bytes) -> None:
        nonlocal pending
        reply.body += chunk
        if not reply.headers.get("content-type", "").startswith("text/event-stream"):
            return
        pending += chunk
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            for line in event.decode().splitlines():
                if line.startswith("data: "):
                    if reply.t_first_event is None:
                        reply.t_first_event = time.monotonic() - start
                    reply.events.append(line[6:])
            if cancel_events is not None and len(reply.events) >= cancel_events:
                raise _Hangup

    async def exchange() -> None:
        reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
        try:
            writer.write(_request(method, url, path, body, headers or {}))
            status = await reader.readline()
            if not status:
                raise ConnectionError("the server closed the connection without answering")
            reply.status, reply.t_status = int(status.split()[1]), time.monotonic() - start
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                reply.headers[name.strip().lower()] = value.strip()
            await _read_body(reader, reply.headers, on_data)
            reply.complete = True
        finally:
            writer.close()

    try:
        await asyncio.wait_for(exchange(), timeout=cancel_after if cancel_after is not None else timeout)
    except _Hangup:
        reply.cancelled = True
    except asyncio.TimeoutError:
        if cancel_after is not None:
            reply.cancelled = True
        else:
            reply.error = f"no full answer within {timeout} s"
    except (OSError, ValueError, asyncio.IncompleteReadError) as e:
        reply.error = f"{type(e).__name__}: {e}"
    reply.t_end = time.monotonic() - start
    return reply


class _Hangup(Exception):
    pass


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (nearest rank), NaN for no values."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def spread(xs: list[float]) -> dict[str, float]:
    """p50, p99 and max of `xs` (NaN for none)."""
    return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "max": max(xs, default=float("nan"))}


def tree_rss_mb(pid: int) -> float:
    """Resident memory (MB) of `pid` and every descendant, from /proc (Linux)."""
    from pathlib import Path

    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {pid}, {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - tree
        tree |= frontier
    total = 0
    for p in tree:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024
