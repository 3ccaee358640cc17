"""SiLU-and-mul and GELU(tanh)-and-mul: Triton where it can run, else the torch reference."""

from __future__ import annotations

import torch

from minisgl.kernels import activation as _k
from minisgl.ops import _checks
from minisgl.ops._backend import log_cpu_reference_once, use_triton
from minisgl.ops._checks import check_inner_contiguous, check_tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(x: object) -> None:
    if _checks.enabled():
        check_tensor("x", x, dtype=_DTYPES, ndim=2)
        if x.shape[1] % 2:
            raise ValueError(f"x must have an even last dimension (gate | up), got shape {tuple(x.shape)}")
        check_inner_contiguous("x", x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = (gate | up), last dim packed, row stride free -> new [T, I]:
    silu(gate) * up in fp32, rounded to x's dtype."""
    _check(x)
    if use_triton("silu_and_mul", x):
        return _k.silu_and_mul(x)
    log_cpu_reference_once("silu_and_mul")
    return _k.silu_and_mul_reference(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """As silu_and_mul with gelu(gate, approximate="tanh") (Gemma's GeGLU)."""
    _check(x)
    if use_triton("gelu_tanh_and_mul", x):
        return _k.gelu_tanh_and_mul(x)
    log_cpu_reference_once("gelu_tanh_and_mul")
    return _k.gelu_tanh_and_mul_reference(x)
