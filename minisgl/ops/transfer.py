"""Small host-to-device copies of a step's inputs, from pinned memory.

Pinned matters: a copy from pageable memory may wait for the stream (the driver stages it),
which would make the host wait for step N before it can launch step N+1. Pinned blocks come
from torch's caching host allocator, which reuses a block only after the copies that read it
have run, so the next step can fill a new one while the GPU still works.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pinned_host(size: int, device: torch.device) -> torch.Tensor:
    """An int64 host buffer to fill and copy to `device`: pinned when that is a GPU."""
    return torch.empty(size, dtype=torch.int64, pin_memory=device.type == "cuda")


def host_to_device(values: Sequence[Sequence[float | int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small [rows, n] table to `device` from pinned memory (async; see the module doc)."""
    t = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)
