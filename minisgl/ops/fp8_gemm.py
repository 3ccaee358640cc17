"""The GPU path of an FP8 linear layer: activations quantized per token by our Triton kernel
(per token and 128-wide K group for block-scaled weights), then the FP8 x FP8 GEMM:
- per-channel (and per-tensor, stored as per-channel) weights: torch._scaled_mm with row-wise
  scales (cuBLASLt) where its layout rules hold (K, N multiples of 16), else our Triton GEMM;
- 128 x 128 block-scaled weights: our Triton GEMM (kernels/fp8_gemm.py).
benchmarks/kernels/fp8_gemm.py measures both against bf16 cuBLAS in one run.
"""

from __future__ import annotations

import torch

from minisgl.logging_setup import log_once

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (M, N, K) that torch._scaled_mm refused on this torch build (its shape rules vary by version):
# they take the Triton GEMM, said once in the log.
_refused: set[tuple[int, int, int]] = set()


def scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """torch._scaled_mm with row-wise scales: one scale per weight row, K and N multiples of 16,
    bf16 output (the only output type it takes with row-wise scales)."""
    n, k = weight.shape
    return scale.size(1) == 1 and k % 16 == 0 and n % 16 == 0 and x.dtype == torch.bfloat16


def fp8_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int, bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """x [M, K] (16/32-bit, CUDA) @ dequantize(weight e4m3 [N, K], scale [N, KB])^T (+ bias)
    -> [M, N] in x's dtype. backend: "auto", "scaled_mm" or "triton" (benchmarks pick one)."""
    from minisgl.kernels.fp8_gemm import fp8_scaled_mm, quantize_tokens

    if x.dtype not in _OUT_DTYPES:
        raise ValueError(f"fp8_gemm: x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    k = x.size(1)
    group = block_k if scale.size(1) > 1 else k
    xq, xs = quantize_tokens(x, group)
    key = (x.size(0), weight.size(0), k)
    use_scaled_mm = backend == "scaled_mm" or (backend == "auto" and scaled_mm_fits(x, weight, scale))
    if use_scaled_mm and key not in _refused:
        try:
            y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=x.dtype)
        except RuntimeError as e:  # a shape rule of this torch build (checked before any launch)
            if backend == "scaled_mm":
                raise
            _refused.add(key)
            log_once(f"fp8:scaled_mm:{key}", f"torch._scaled_mm refused (M, N, K) = {key} ({e}); Triton GEMM instead")
        else:
            return y if bias is None else y + bias
    if backend == "auto" and scale.size(1) == 1 and not use_scaled_mm:
        log_once(f"fp8:scaled_mm:{tuple(weight.shape)}:{x.dtype}",
                 f"fp8 linear {tuple(weight.shape)} in {x.dtype}: outside torch._scaled_mm's row-wise rules "
                 "(bf16, K and N multiples of 16), Triton GEMM instead")
    return fp8_scaled_mm(xq, xs, weight, scale, block_k, x.dtype, bias)
