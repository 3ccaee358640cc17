"""Device facts the kernels' launch choices read."""

from __future__ import annotations

import functools

import torch
import triton

try:  # griddepcontrol from Triton kernels (Triton 3.4 and later); without it no Triton kernel signals
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def num_sms(device: int | torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the property query is slow)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def name(device: torch.device) -> str | None:
    """The CUDA device's name (the key of the tuned-tile tables; cached: the MoE layers ask it per
    call), None off CUDA."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


@functools.cache
def shared_memory_per_block(device: int | torch.device) -> int:
    """The shared memory one block may opt into, in bytes (227 KB on Hopper; 99 KB assumed where
    torch does not report it)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024)


@functools.cache
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    return bool(knobs.runtime.interpret) if knobs is not None else False


def dependent_launch(t: torch.Tensor) -> bool:
    """Whether a Triton kernel on t's device may signal programmatic dependent launch
    (`gdc_launch_dependents`: Hopper and later, compiled kernels only). False on the CPU, in the
    Triton interpreter (which cannot run it, on CUDA tensors too) and with a Triton without it."""
    return (gdc_launch_dependents is not None and t.is_cuda and not _interpreting()
            and _major(t.device.index or 0) >= 9)


def pdl_launch(pdl: bool) -> dict[str, bool]:
    """The launch option of a Triton kernel launched with programmatic dependent launch (`pdl`, from
    `dependent_launch`). Such a kernel may start while the kernel before it still runs: it must
    `gdc_wait()` before it reads anything that kernel writes and before it writes anything that
    kernel may still read. Empty when off: a Triton before 3.4 (which pyproject allows) has no
    `launch_pdl` option and refuses the keyword."""
    return {"launch_pdl": True} if pdl else {}
