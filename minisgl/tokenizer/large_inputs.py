"""Tokenizing large inputs in a short-lived forked child, so that a large request neither makes
small ones wait (the worker's loop keeps serving them) nor leaves its memory behind (the
tokenizer's working set for a 5 MB text is gigabytes; it dies with the child).

The child inherits the loaded tokenizer (fork, copy-on-write: nothing to load), tokenizes,
writes the ids (or only their count, when they cannot fit the context) to a pipe and exits
with os._exit: it never touches the parent's ZMQ sockets or runs its exit handlers, which is
what makes forking this multi-threaded process safe. The parent polls the pipe beside its
ZMQ inbox. Only MAX_CHILDREN run at once per worker; later large inputs queue behind them
(small inputs never do).
"""

from __future__ import annotations

import ctypes
import os
import signal
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

LARGE_INPUT_BYTES = 64 * 1024  # ~16k tokens: a few ms inline; above, a child's fork pays off
MAX_CHILDREN = 2
_READ_CHUNK = 1 << 20


def release_free_memory() -> None:
    """glibc keeps freed heap pages; hand them back to the OS after a large request."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim


@dataclass
class Job:
    key: Any  # the caller's handle (its TokenizeMsg)
    text: str
    add_special_tokens: bool
    keep_below: int  # return the ids only if fewer than this, else just their count
    pid: int = 0
    fd: int = -1
    data: bytearray = field(default_factory=bytearray)


def _child(tok: Any, job: Job, w: int) -> None:
    code = 1
    try:
        ids = tok(job.text, add_special_tokens=job.add_special_tokens).input_ids
        payload = msgpack.packb(ids if len(ids) < job.keep_below else len(ids))
        view = memoryview(payload)
        while view:
            view = view[os.write(w, view) :]
        code = 0
    finally:
        os._exit(code)


class LargeInputs:
    """Forked tokenization jobs of one worker. `done(key, ids | count | None)` is called
    from poll() when a job ends (None: the child failed, e.g. killed for memory)."""

    def __init__(self, tokenizer: Any, done: Callable[[Any, list[int] | int | None], None]) -> None:
        self.tok = tokenizer
        self.done = done
        self.running: dict[int, Job] = {}  # by pipe fd
        self.queued: deque[Job] = deque()

    @property
    def fds(self) -> list[int]:
        return list(self.running)

    def submit(self, job: Job) -> None:
        self.queued.append(job)
        self._start_queued()

    def _start_queued(self) -> None:
        while self.queued and len(self.running) < MAX_CHILDREN:
            job = self.queued.popleft()
            r, w = os.pipe()
            with warnings.catch_warnings():  # "fork() may lead to deadlocks": see the module docstring
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                os.close(r)
                _child(self.tok, job, w)
            os.close(w)
            job.pid, job.fd, job.text = pid, r, ""  # the child has the text now
            self.running[r] = job
            release_free_memory()

    def cancel(self, key: Any) -> bool:
        """Drops the job of `key` (its client went away); False when there is none."""
        for job in list(self.queued):
            if job.key is key:
                self.queued.remove(job)
                return True
        for fd, job in list(self.running.items()):
            if job.key is key:
                os.kill(job.pid, signal.SIGKILL)
                self._reap(fd)
                self._start_queued()
                return True
        return False

    def _reap(self, fd: int) -> tuple[Job, int]:
        job = self.running.pop(fd)
        os.close(fd)
        _, status = os.waitpid(job.pid, 0)
        return job, status

    def poll(self, readable: list[int]) -> None:
        """Reads what the children wrote; finishes the jobs whose pipe closed."""
        for fd in readable:
            job = self.running.get(fd)
            if job is None:
                continue
            chunk = os.read(fd, _READ_CHUNK)
            if chunk:
                job.data += chunk
                continue
            job, status = self._reap(fd)
            result = msgpack.unpackb(bytes(job.data)) if status == 0 and job.data else None
            job.data = bytearray()
            self.done(job.key, result)
            del result
            release_free_memory()
        self._start_queued()
