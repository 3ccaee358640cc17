"""Device facts the kernels' launch choices read."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: int | torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the property query is slow)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
