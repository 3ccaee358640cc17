"""Device facts the kernels' launch choices read."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: int | torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the property query is slow)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def dependent_launch(t: torch.Tensor) -> bool:
    """Whether a kernel on t's device may signal programmatic dependent launch (Hopper and later:
    griddepcontrol). False on the CPU (and so in the Triton interpreter)."""
    return t.is_cuda and _major(t.device.index or 0) >= 9
