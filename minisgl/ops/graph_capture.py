"""Python's cyclic garbage collector must not run while a CUDA graph is being captured.

A collection during a capture can free objects of an earlier engine (its CUDA graphs, events,
streams) whose destruction calls the CUDA driver, which invalidates the capture
(cudaErrorStreamCaptureInvalidated: "operation failed due to a previous error during capture"
at the next launch). Seen on the H100 in tests that build several LLMs in one process; which
collection happened when depends on allocation counts, so it came and went between runs.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def no_gc(collect: bool = True) -> Iterator[None]:
    """Collect now (unless `collect` is False: a short capture repeated many times), then keep
    the collector off until the block ends (it is restored as it was)."""
    was_enabled = gc.isenabled()
    if collect:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
