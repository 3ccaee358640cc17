"""The `minisgl` logger, a log-once helper for fallbacks (a fallback is said, once), and the
startup phases: one line per phase of each process, `startup: WHAT S s (at T s)`, S the seconds
it took and T when it ended, counted from the launch (benchmarks/startup.py reads them)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

from minisgl import env

_logged: set[str] = set()


def get_logger(name: str = "minisgl") -> logging.Logger:
    root = logging.getLogger("minisgl")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s %(name)s] %(message)s"))
        root.addHandler(handler)
        root.setLevel(env.LOG_LEVEL)
        root.propagate = False
    return logging.getLogger(name)


def log_once(key: str, message: str, level: int = logging.WARNING) -> None:
    if key not in _logged:
        _logged.add(key)
        get_logger("minisgl.ops").log(level, message)


def process_start_time() -> float:
    """When this process started, in CLOCK_BOOTTIME seconds (the clock /proc counts in), so
    that a launch's T0 includes the interpreter's own start and imports."""
    with open(f"/proc/{os.getpid()}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, after the name
    return ticks / os.sysconf("SC_CLK_TCK")


def since_launch() -> float:
    """Seconds since the server's launch began (or, outside a server, since this process began)."""
    t0 = env.LAUNCH_T0
    if t0 is None:
        try:
            t0 = process_start_time()
        except OSError:  # no /proc: count from the first call
            t0 = _FIRST_CALL.setdefault("t0", time.clock_gettime(time.CLOCK_BOOTTIME))
    return time.clock_gettime(time.CLOCK_BOOTTIME) - t0


_FIRST_CALL: dict[str, float] = {}


def log_phase(what: str, seconds: float) -> None:
    get_logger("minisgl.startup").info("startup: %s %.2f s (at %.2f s)", what, seconds, since_launch())


@contextlib.contextmanager
def startup_phase(what: str) -> Iterator[None]:
    """Logs the block's duration as one startup phase (nothing when it raises)."""
    t0 = time.perf_counter()
    yield
    log_phase(what, time.perf_counter() - t0)
