"""SiLU-and-mul (Llama-family MLPs) and GELU(tanh)-and-mul (Gemma's GeGLU), Triton + fp32
references.

x [T, 2I] holds (gate | up) per row; out [T, I] = act(gate) * up, computed in fp32 and
rounded once. gelu_tanh(g) = 0.5 g (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3).
Traffic: read 2I, write I elements per row. Grid: (rows, column blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import dependent_launch, gdc_launch_dependents


@triton.jit
def _act_and_mul_kernel(X, Out, stride_x, stride_o, I, BLOCK: tl.constexpr, GELU: tl.constexpr,
                        PDL: tl.constexpr):
    if PDL:  # the down projection's skinny GEMM may launch now (it waits before reading Out)
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        u2 = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)  # 2 sqrt(2/pi) (...)
        out = gate / (1.0 + tl.exp(-u2)) * up
    else:
        out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (last dim packed) -> new [T, I] in x's dtype."""
    return _act_and_mul(x, False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (last dim packed) -> new [T, I] in x's dtype."""
    return _act_and_mul(x, True)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    t, two_i = x.shape
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t == 0 or inter == 0:
        return out
    block = min(4096, triton.next_power_of_2(inter))
    num_warps = max(1, min(8, block // 512))
    grid = (t, triton.cdiv(inter, block))
    _act_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), inter, BLOCK=block, GELU=gelu,
                              PDL=dependent_launch(x), num_warps=num_warps)
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[:, :inter]) * xf[:, inter:]).to(x.dtype)


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.gelu(xf[:, :inter], approximate="tanh") * xf[:, inter:]).to(x.dtype)
