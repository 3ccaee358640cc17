"""The fp32 references of the GEMM of every weight format: dequantize the weight to fp32, one
fp32 matmul (+ bias, then SiLU-and-mul from the unrounded gate and up), rounded once to x's
dtype. The CPU runs these (so a quantized checkpoint matches transformers on its dequantized
weights); the kernels' tests compare against them.

Layouts: 16-bit [N, K]; FP8 ops/gemm/fp8.py; INT4 and MXFP4 kernels/quant4.py (the two 4-bit
layouts every 4-bit checkpoint is repacked into at load).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernels.quant4 import dequant_int4_reference, dequant_mxfp4_reference
from minisgl.ops.gemm.fp8 import dequantize


def skinny_gemm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu: bool = False
) -> torch.Tensor:
    """fp32 math, rounded once to x's dtype. silu: weight is (gate | up) [2I, K] and the
    result silu(gate) * up [M, I], from the unrounded fp32 gate and up."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    if silu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y.to(x.dtype)


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
    bias: torch.Tensor | None = None, silu: bool = False,
) -> torch.Tensor:
    """x [T, K] @ dequantize(weight e4m3 [N, K], scale [N, KB])^T (+ bias) in fp32."""
    return skinny_gemm_reference(x, dequantize(weight, scale, block_k), bias, silu)


def int4_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    bias: torch.Tensor | None = None, silu: bool = False,
) -> torch.Tensor:
    """x [T, K] @ W^T, W [N, K] from the INT4 layout (qweight int32 [N, K / 8], scales and zeros
    [N, K / group])."""
    return skinny_gemm_reference(x, dequant_int4_reference(qweight, scales, zeros), bias, silu)


def mxfp4_linear_reference(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, silu: bool = False
) -> torch.Tensor:
    """x [T, K] @ W^T, W [N, K] from the MXFP4 layout (blocks uint8 [N, K / 2], e8m0 scales [N, K / 32])."""
    return skinny_gemm_reference(x, dequant_mxfp4_reference(blocks, scales), bias, silu)
