"""Which implementation an op uses: minisgl._C (CUDA), Triton, or the torch reference.

The choice is per call, from the tensors' device and what was built; every fallback from a
fast path is logged once, so a broken build never hides behind a silent slow path.
"""

from __future__ import annotations

import functools
import logging

import torch

from minisgl import env
from minisgl.logging_setup import log_once


@functools.cache
def compiled():
    """The compiled extension, or None if it failed to import (logged once)."""
    try:
        from minisgl import _C
    except ImportError as e:  # pragma: no cover - a broken install
        log_once("import _C", f"minisgl._C failed to import ({e}); using Triton/torch ops")
        return None
    return _C


def use_cuda_kernel(op: str, t: torch.Tensor) -> bool:
    """True when `t` is on a GPU and minisgl._C has CUDA kernels."""
    if t.device.type != "cuda" or env.DISABLE_KERNELS:
        return False
    ext = compiled()
    if ext is None or not ext.has_cuda:
        log_once(f"no-cuda:{op}", f"minisgl._C was built without CUDA: {op} uses its fallback")
        return False
    return True


def use_triton(op: str, t: torch.Tensor) -> bool:
    """True when a Triton kernel can run on `t`: on a GPU, or on the CPU under TRITON_INTERPRET."""
    if env.DISABLE_KERNELS:
        return False
    if t.device.type != "cuda" and not env.TRITON_INTERPRET:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        log_once(f"no-triton:{op}", f"triton is not installed: {op} uses the torch reference")
        return False
    return True


def current_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def log_cpu_reference_once(op: str) -> None:
    log_once(f"cpu:{op}", f"{op}: running the torch reference on the CPU", logging.DEBUG)
