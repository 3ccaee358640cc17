"""Third stage of a request: submit it to the tokenizer workers and await the detokenizer's
replies. Routes replies to whoever waits for them, aborts what nobody waits for any more,
and keeps the metrics. Knows nothing of HTTP bodies: it takes TokenizeMsg/DecodeMsg and
yields UserReply; errors leave as ApiError in the request's own field names."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from minisgl.logging_setup import get_logger
from minisgl.message import AbortMsg, DecodeMsg, ReplyBatch, StatsMsg, TokenizeMsg, UserReply, decode, encode, trace
from minisgl.message.addresses import Addresses
from minisgl.server.admission import Admission, QueueLimits
from minisgl.server.errors import ApiError
from minisgl.server.metrics import Metrics

log = get_logger("minisgl.server")
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The HTTP client disconnected while its request ran."""


class RequestHandle:
    """One API call: `len(uids)` generations (prompts x n), replies merged in one queue."""

    def __init__(self, uids: list[int], names: dict[str, str] | None = None, metered: bool = True) -> None:
        self.uids = uids
        self.names = names or {}  # engine field -> request field, for errors
        self.metered = metered  # a generation (counted in the metrics), not a /tokenize call
        self.index = {u: i for i, u in enumerate(uids)}
        self.queue: asyncio.Queue[UserReply] = asyncio.Queue()
        self.unfinished = set(uids)
        self.checked = time.monotonic()  # when the client's connection was last checked

    @property
    def done(self) -> bool:
        return not self.unfinished


class _Timing:
    __slots__ = ("start", "last")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last: float | None = None


class Frontend:
    def __init__(
        self, addrs: Addresses, num_tokenizers: int, metrics: Metrics, limits: QueueLimits | None = None
    ) -> None:
        self.addrs = addrs
        self.metrics = metrics
        self.queued: set[int] = set()  # generations without a reply yet: not yet generating
        self.admission = Admission(limits or QueueLimits(), metrics.registry, lambda: len(self.queued))
        self.stats: StatsMsg | None = None
        self.dead: str | None = None  # why the backend can no longer serve
        self._targets = addrs.tokenizers if num_tokenizers > 0 else [addrs.detokenizer]
        self._next_uid = itertools.count()
        self._rr = itertools.count()
        self._handles: dict[int, RequestHandle] = {}
        self._route: dict[int, int] = {}  # uid -> tokenizer index (aborts follow the request)
        self._timing: dict[int, _Timing] = {}
        # Other messages for the API server (an admin call's replies), by type: see server/gateway.py.
        self.handlers: dict[type, Any] = {}

    def open(self) -> None:
        """Call inside the running event loop."""
        self._sync_ctx = zmq.Context()
        self._push = []
        for addr in self._targets:
            sock = self._sync_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a busy tokenizer
            sock.connect(addr)
            self._push.append(sock)
        self._async_ctx = zmq.asyncio.Context()
        self._pull = self._async_ctx.socket(zmq.PULL)
        self._pull.bind(self.addrs.api)

    def close(self) -> None:
        for sock in self._push:
            sock.close(0)
        self._pull.close(0)

    def submit(
        self,
        msgs: list[TokenizeMsg | DecodeMsg],
        names: dict[str, str] | None = None,
        metered: bool = True,
        received: float | None = None,
    ) -> RequestHandle:
        """Numbers the messages' generations (TokenizeMsg: one uid per choice) and sends each
        to a tokenizer worker, round robin (workers tokenize large inputs off their loop, so
        any worker serves small requests at once). `received`: when the HTTP request came in
        (the start of its hop trace, when tracing is on, and of its wait for admission).
        Raises Overloaded when admission refuses it (server/admission.py)."""
        self.admission.check(sum(len(uids) for uids in _uids_of(msgs)), metered)
        for m in msgs:
            if isinstance(m, TokenizeMsg):
                m.uids = [next(self._next_uid) for _ in m.uids]
                m.trace = trace.start(received)
                if metered:
                    m.admit_by = self.admission.admit_by(received)
            else:
                m.uid = next(self._next_uid)
        handle = RequestHandle([u for uids in _uids_of(msgs) for u in uids], names, metered)
        if self.dead:
            for uid in handle.uids:
                handle.queue.put_nowait(UserReply(uid, error=self.dead))
            return handle
        for m, uids in zip(msgs, _uids_of(msgs)):
            target = next(self._rr) % len(self._push)
            if metered:
                self.queued.update(uids)
            for uid in uids:
                self._handles[uid] = handle
                self._route[uid] = target
                self._timing[uid] = _Timing()
            self._push[target].send(encode(m))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Ends every unfinished generation of `handle` and frees its KV slots."""
        for uid in list(handle.unfinished):
            target = self._route.get(uid)
            if target is not None and not self.dead:
                self._push[target].send(encode(AbortMsg(uid, "abort")))
            if handle.metered:
                self.metrics.requests.labels("abort").inc()
            self._forget(handle, uid)

    def _forget(self, handle: RequestHandle, uid: int) -> None:
        self.queued.discard(uid)
        handle.unfinished.discard(uid)
        self._handles.pop(uid, None)
        self._route.pop(uid, None)
        self._timing.pop(uid, None)

    async def next_reply(self, handle: RequestHandle, request: Any = None) -> UserReply:
        """The next reply of `handle`; raises ClientGone when `request`'s client left. The
        client is checked every DISCONNECT_POLL_S, whether or not replies keep coming."""
        while True:
            now = time.monotonic()
            if request is not None and now - handle.checked >= DISCONNECT_POLL_S:
                handle.checked = now
                if await request.is_disconnected():
                    raise ClientGone()
            if not handle.queue.empty():
                return handle.queue.get_nowait()
            try:
                return await asyncio.wait_for(handle.queue.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass

    def error_of(self, handle: RequestHandle, reply: UserReply) -> ApiError:
        if self.dead:
            return ApiError(reply.error or "server error", None, 503, kind="server_error")
        if reply.error_code is not None:  # refused for load by the scheduler: 503 + Retry-After
            return self.admission.refuse(reply.error_code, reply.error or "the server is overloaded")
        param, message = reply.error_param, reply.error or "bad request"
        if param in handle.names:
            name = handle.names[param]
            param, message = name, (name + message[len(param) :] if message.startswith(param) else message)
        return ApiError(message, param)

    async def first_reply(self, handle: RequestHandle, request: Any) -> UserReply:
        """Waits for the request's first reply before any HTTP status is sent, so that a prompt
        the tokenizer or scheduler refuses still gets its 400."""
        try:
            reply = await self.next_reply(handle, request)
        except BaseException:
            self.abort(handle)
            raise
        if reply.error is not None:
            self.abort(handle)
            raise self.error_of(handle, reply)
        return reply

    async def replies(self, handle: RequestHandle, first: UserReply | None, request: Any) -> AsyncIterator[UserReply]:
        """Every reply of `handle` (starting with `first`); whoever stops early (client gone,
        error, cancellation) aborts what is still running, freeing its KV slots."""
        try:
            if first is not None:
                yield first
            while not handle.done or not handle.queue.empty():
                reply = await self.next_reply(handle, request)
                if reply.error is not None:
                    raise self.error_of(handle, reply)
                yield reply
        finally:
            if not handle.done:
                self.abort(handle)

    async def run(self) -> None:
        while True:
            msg = decode(await self._pull.recv())
            if isinstance(msg, ReplyBatch):
                at = trace.now()
                for reply in msg.replies:
                    trace.stamp(reply.trace, "api_in", at)
                    self._dispatch(reply)
            elif isinstance(msg, StatsMsg):
                self.stats = msg
                self.metrics.on_stats(msg)
            elif type(msg) in self.handlers:
                self.handlers[type(msg)](msg)
            else:
                log.warning("api server: ignoring unexpected %s", type(msg).__name__)

    def _dispatch(self, reply: UserReply) -> None:
        handle = self._handles.get(reply.uid)
        if handle is None:
            return  # aborted: late replies are dropped
        self.queued.discard(reply.uid)  # generating now (or failed)
        if handle.metered:
            self._observe(reply)
        if reply.error is not None or reply.finish_reason is not None:
            self._forget(handle, reply.uid)
        handle.queue.put_nowait(reply)

    def _observe(self, reply: UserReply) -> None:
        now, t, m = time.perf_counter(), self._timing[reply.uid], self.metrics
        n = len(reply.token_ids)
        if n:
            if t.last is None:
                m.ttft.observe(now - t.start)
            else:
                for _ in range(n):
                    m.itl.observe((now - t.last) / n)
            t.last = now
            m.generation_tokens.inc(n)
        if reply.error is not None:
            if reply.error_code is None:  # refusals for load have their own counter (admission.py)
                m.requests.labels("error").inc()
        elif reply.finish_reason is not None:
            m.requests.labels(reply.finish_reason).inc()
            m.prompt_tokens.inc(reply.prompt_tokens)
            m.e2e.observe(now - t.start)

    @property
    def in_flight(self) -> int:
        """Generations not finished yet (a drain waits for them)."""
        return len(self._handles)

    def fail_all(self, why: str) -> None:
        """The backend died, or a drain ran out of time (launch/drain.py): every waiter gets an
        error now instead of hanging, and later requests are refused."""
        self.dead = why
        for uid, handle in list(self._handles.items()):
            self._forget(handle, uid)
            handle.queue.put_nowait(UserReply(uid, error=why))


def _uids_of(msgs: list[TokenizeMsg | DecodeMsg]) -> list[list[int]]:
    return [m.uids if isinstance(m, TokenizeMsg) else [m.uid] for m in msgs]
