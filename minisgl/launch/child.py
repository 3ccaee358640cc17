"""What every child process of the server does first: die with its parent, leave Ctrl-C and
SIGTERM to the parent, exit 0 when the parent stops it, and report ready (or why it could not
start) through its pipe."""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from minisgl.logging_setup import get_logger, log_phase, process_start_time
from minisgl.message import ReadyMsg, StartMsg, decode, encode

log = get_logger("minisgl.server")
_PR_SET_PDEATHSIG = 1
STOP_SIGNAL = signal.SIGUSR1  # how the launcher stops a child: it exits 0 (a stop, not a failure)


def _die_with_parent() -> None:
    # Linux: the kernel kills us when the launcher dies, however it dies (even SIGKILL), so no
    # orphan keeps a GPU or a socket.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _exit_on_stop_signal() -> None:
    # Not a Python handler: it would run only when the main thread next runs bytecode, and a
    # signal the kernel hands to another thread (zmq's, a tokenizer pool's) does not wake a
    # main thread blocked in a poll. So the signal is blocked in every thread (the mask, set
    # before any thread exists, is inherited by all of them) and one thread waits for it.
    # No cleanup on the way out: the launcher removes the sockets.
    signal.pthread_sigmask(signal.SIG_BLOCK, {STOP_SIGNAL})

    def wait() -> None:
        signal.sigwait({STOP_SIGNAL})
        os._exit(0)

    threading.Thread(target=wait, name="minisgl-stop", daemon=True).start()


def child_main(name: str, target: str, conn: Connection, *args: Any) -> None:
    """Entry point of every child (spawned, so it must be importable). `target` names the
    worker as "module:function", imported here, in the child, so that the launcher never loads
    a worker's modules. The worker runs as `function(ready, *args)`: it calls `ready(info)` once
    loaded, which reports to the launcher and returns the StartMsg (workers know nothing of the
    launcher but this callback)."""
    _die_with_parent()
    # Ctrl-C reaches the whole process group, and so may SIGTERM (systemd's stop, `kill -- -PGID`);
    # the launcher alone handles them and then stops us: SIGTERM starts its drain
    # (launch/drain.py), which needs every worker until the last request is done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_on_stop_signal()
    try:
        module, _, function = target.partition(":")
        run: Callable[..., None] = getattr(importlib.import_module(module), function)
        log_phase(
            f"{name}: process started, its modules imported",
            time.clock_gettime(time.CLOCK_BOOTTIME) - process_start_time(),
        )
        run(functools.partial(report_ready, conn, name), *args)
    except Exception as e:  # noqa: BLE001 - any failure must reach the launcher, then exit 1
        log.exception("%s failed", name)
        try:
            conn.send_bytes(encode(ReadyMsg(name, error=f"{type(e).__name__}: {e}")))
        except OSError:
            pass
        sys.exit(1)


def report_ready(conn: Connection, name: str, info: dict[str, Any] | None = None) -> StartMsg:
    """Tells the launcher we are loaded, then waits for the facts every child needs to serve."""
    conn.send_bytes(encode(ReadyMsg(name, info=info or {})))
    start = decode(conn.recv_bytes())
    if not isinstance(start, StartMsg):
        raise RuntimeError(f"{name}: expected StartMsg from the launcher, got {type(start).__name__}")
    return start
