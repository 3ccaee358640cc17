"""The `minisgl` logger and a log-once helper for fallbacks (a fallback is said, once)."""

from __future__ import annotations

import logging

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
