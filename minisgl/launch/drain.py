"""Drain on SIGTERM: how a server leaves a cluster without cutting a request.

Kubernetes (and most supervisors) stop a process with SIGTERM and a grace period before
SIGKILL. On the first SIGTERM the server:
1. turns readiness off at once: /health answers 503 `draining`, so routers and the
   Kubernetes endpoints controller stop sending here; every new request gets 503 +
   Retry-After (server/admission.py), with `Connection: close`;
2. lets the requests in flight (queued ones too) run to completion, for up to
   --shutdown-timeout seconds;
3. ends the ones still running with an error (an error event on a stream, a 503 otherwise),
   closes the HTTP server, stops every process and exits 0 (the launcher removes the IPC
   sockets).
A second SIGTERM, or SIGINT at any time, stops at once. With --dp the drain is the API
server's, so every replica drains together: nothing reaches any of them after the SIGTERM.

uvicorn installs its own handlers for SIGTERM and SIGINT while it serves (signal.signal, so
the launcher's are restored after); its `handle_exit` is the hook for both. Its own graceful
stop (wait up to `timeout_graceful_shutdown` for open connections) still runs after the drain,
so the last error events are written before the sockets close.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from types import FrameType

import uvicorn

from minisgl.logging_setup import get_logger
from minisgl.server.frontend import Frontend

log = get_logger("minisgl.server")
DRAIN_POLL_S = 0.02


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, frontend: Frontend, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.frontend, self.shutdown_timeout = frontend, shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain: asyncio.Task | None = None
        self.drain_asked = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler (the main thread, between two bytecodes of the event loop): it only
        # sets flags and hands the work to the loop. Unlike uvicorn's, it does not record the
        # signal to raise again after serving: the launcher returns 0 either way.
        assert self.loop is not None
        if sig == signal.SIGTERM and not self.drain_asked and not self.should_exit:
            self.drain_asked = True
            self.loop.call_soon_threadsafe(self._start_drain)
            return
        self.should_exit = self.force_exit = True
        self.loop.call_soon_threadsafe(self._stop_now, signal.Signals(sig).name)

    def _start_drain(self) -> None:
        self.frontend.admission.start_drain()
        self.drain = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        fe, timeout = self.frontend, self.shutdown_timeout
        log.info(
            "SIGTERM: draining; %d generations in flight may finish within --shutdown-timeout %g s, "
            "new requests get 503 (a second SIGTERM or Ctrl-C stops at once)",
            fe.in_flight,
            timeout,
        )
        deadline = time.monotonic() + timeout
        while fe.in_flight and not self.should_exit and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if fe.in_flight and not self.should_exit:
            log.warning("drain: %d generations unfinished after %g s end with an error", fe.in_flight, timeout)
            fe.fail_all(
                f"the server is shutting down: the request did not finish within --shutdown-timeout {timeout:g} s"
            )
        elif not self.should_exit:
            log.info("drain: every request finished")
        self.should_exit = True

    def _stop_now(self, name: str) -> None:
        log.warning("%s: stopping at once; %d generations in flight end with an error", name, self.frontend.in_flight)
        self.frontend.admission.start_drain()
        self.frontend.fail_all(f"the server was stopped ({name})")
