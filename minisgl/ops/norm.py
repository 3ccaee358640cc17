"""RMSNorm and fused residual-add + RMSNorm: Triton where it can run, else the torch reference."""

from __future__ import annotations

import torch

from minisgl.kernels import norm as _k
from minisgl.ops import _checks
from minisgl.ops._backend import log_cpu_reference_once, use_triton
from minisgl.ops._checks import check_inner_contiguous, check_same_device, check_shape, check_tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_x_weight(x: object, weight: object) -> None:
    check_tensor("x", x, dtype=_DTYPES, ndim=2)
    check_inner_contiguous("x", x)
    check_tensor("weight", weight, dtype=(x.dtype, torch.float32), ndim=1)
    check_shape("weight", weight, (x.shape[1],))
    check_inner_contiguous("weight", weight)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (row stride free), weight [H] (x's dtype or fp32) -> new [T, H], x's dtype.
    HF LlamaRMSNorm math: fp32 normalize, round to x's dtype, times weight, round."""
    if _checks.enabled():
        _check_x_weight(x, weight)
        check_same_device(x=x, weight=weight)
    if use_triton("rmsnorm", x):
        return _k.rmsnorm(x, weight, eps)
    log_cpu_reference_once("rmsnorm")
    return _k.rmsnorm_reference(x, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual), x + residual). The sum (rounded to x's dtype) is written
    IN PLACE into `residual`, which is returned as the new residual; x is left untouched and
    the normed output is a new tensor. x, residual: [T, H], same dtype (row strides free)."""
    if _checks.enabled():
        _check_x_weight(x, weight)
        check_tensor("residual", residual, dtype=x.dtype, ndim=2)
        check_shape("residual", residual, tuple(x.shape))
        check_inner_contiguous("residual", residual)
        check_same_device(x=x, residual=residual, weight=weight)
    if use_triton("fused_add_rmsnorm", x):
        return _k.fused_add_rmsnorm(x, residual, weight, eps)
    log_cpu_reference_once("fused_add_rmsnorm")
    normed, s = _k.fused_add_rmsnorm_reference(x, residual, weight, eps)
    residual.copy_(s)
    return normed, residual
