"""RMSNorm and fused residual-add + RMSNorm (Triton), beside their fp32 torch references.

Semantics follow HF LlamaRMSNorm: normalize in fp32, cast to the input dtype, then multiply
by the weight in the input dtype (`weight * hidden.to(input_dtype)`). The fused variant first
forms `s = x + residual` rounded to the input dtype (what HF holds as the new residual) and
normalizes that rounded sum, so both paths see the same numbers.

Memory traffic per row of H elements: rmsnorm reads x and writes out (2H); the fused kernel
reads x and residual and writes out and the new residual (4H). One program handles one row
(H <= 16k fits in registers), so each row is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import dependent_launch, gdc_launch_dependents, gdc_wait, pdl_launch


@triton.jit
def _rmsnorm_kernel(
    X, R, W, Out, ROut, stride_x, stride_r, stride_o, stride_ro, H, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        # The next kernel (a skinny GEMM launched with programmatic dependent launch) may start
        # now and stream its weights; it waits for this grid's completion before reading Out.
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    # The weight is no kernel's output: it is read while the previous kernel (this grid is launched
    # with PDL after it, often the GEMM that writes X) may still run; X and R after the wait.
    w = tl.load(W + offs, mask=mask, other=0.0)
    if PDL:
        gdc_wait()
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        # Round the sum to the storage dtype first: that is the residual HF carries forward.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(ROut + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    h = (xf * rstd).to(x.dtype)
    # weight * hidden in the input dtype: an fp32 product rounded once, as torch does it.
    out = (h.to(tl.float32) * w.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_o + offs, out, mask=mask)


def _launch(x: torch.Tensor, r: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, r_out: torch.Tensor | None) -> None:
    t, h = x.shape
    if t == 0:
        return
    block = triton.next_power_of_2(h)
    # ~8 elements per thread: enough bytes in flight per SM without spilling.
    num_warps = max(1, min(16, block // 256))
    has_r = r is not None
    pdl = dependent_launch(x)
    _rmsnorm_kernel[(t,)](
        x, r if has_r else x, weight, out, r_out if has_r else out,
        x.stride(0), r.stride(0) if has_r else 0, out.stride(0), r_out.stride(0) if has_r else 0,
        h, eps, HAS_RESIDUAL=has_r, BLOCK=block, PDL=pdl, num_warps=num_warps, **pdl_launch(pdl),
    )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (last dim packed), weight [H] -> new [T, H] in x's dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual). The sum is written in place into `residual`
    (which is returned as the new residual); the normed output is a new tensor."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, residual)
    return out, residual


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    # For a weight in x's dtype this equals torch's `weight * h` (fp32 product, one rounding).
    return (weight.float() * h.float()).to(x.dtype)


def fused_add_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place: (rmsnorm(x + residual), x + residual); inputs are left untouched."""
    s = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_reference(s, weight, eps), s
