"""FP8 (e4m3) weights: quantize, dequantize, and the large-batch GEMM over them (the op that
dispatches an FP8 layer's GEMM is ops/gemm/dispatch.py's `linear`; its fp32 reference is
ops/gemm/reference.py's).

Layout of a quantized linear layer (layers/linear.py): weight e4m3 [N, K] and fp32
weight_scale [N, KB] with one scale per row and K block of `block_k` elements
(KB = ceil(K / block_k)): block_k = 128 for block-quantized checkpoints (their 128 x 128 block
scales expanded to rows on load, so fused q/k/v parts need not be 128-row aligned), block_k = K
(KB = 1) for per-channel and per-tensor scales. The dequantized weight is
W[n, k] = weight[n, k] * weight_scale[n, k // block_k].

On the CPU an FP8 layer runs the reference: dequantize, matmul in fp32 (activations stay
unquantized, so an FP8 checkpoint matches transformers on its dequantized weights). On CUDA the
activations are quantized per token (per token and 128-wide K group with block scales) by our
Triton kernel and the FP8 x FP8 GEMM runs on tensor cores (`fp8_gemm` below):
- per-channel (and per-tensor, stored as per-channel) weights: torch._scaled_mm with row-wise
  scales (cuBLASLt) where its layout rules hold (K, N multiples of 16), else our Triton GEMM;
- 128 x 128 block-scaled weights: our Triton GEMM (kernels/fp8_gemm.py).
At M <= 32, where the measured table says so, the skinny template's FP8 loader instead
(ops/gemm/skinny.py). benchmarks/kernels/fp8_gemm.py measures them against bf16 cuBLAS.
"""

from __future__ import annotations

import torch

from minisgl.logging_setup import log_once

FP8 = torch.float8_e4m3fn
BLOCK = 128  # the only block size of block scales (one scale per 128 x 128 weights)
FP8_MAX = 448.0  # largest finite e4m3fn value
# Scales never go below this: an all-zero row quantizes to zeros with a finite scale.
MIN_SCALE = 1e-12


def check_fp8_device(device: torch.device) -> None:
    """FP8 tensor cores start at sm_89 (Ada, Hopper); the CPU runs the reference path."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"FP8 weights need a GPU with FP8 support (compute capability 8.9 or newer); {name} is {major}.{minor}"
        )


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per output channel) e4m3 quantization of a 16/32-bit [N, K] weight:
    (weight e4m3 [N, K], scale fp32 [N, 1]) with |w / scale| <= 448. Computed in fp32 on the
    weight's device, one tensor at a time (the loader streams)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return (wf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """128 x 128 block quantization (the Qwen3/DeepSeek FP8 format): (weight e4m3 [N, K],
    weight_scale_inv fp32 [ceil(N/128), ceil(K/128)]). Tests and tools write checkpoints with it."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, block, kb, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).view(nb * block, kb * block)[:n, :k]
    return q.to(FP8).contiguous(), scale


def expand_block_scale(scale: torch.Tensor, n: int, block: int = 128) -> torch.Tensor:
    """[ceil(N/block), KB] block scales -> [N, KB], one row per weight row."""
    return scale.repeat_interleave(block, dim=0)[:n]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> torch.Tensor:
    """fp32 [N, K] from e4m3 [N, K] and [N, ceil(K / block_k)] scales."""
    k = weight.size(1)
    s = scale.float() if scale.size(1) == 1 else scale.float().repeat_interleave(block_k, dim=1)[:, :k]
    return weight.float() * s


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of our per-token quant kernel: x [M, K] -> (e4m3 [M, K], fp32 scales
    [M, ceil(K / group)]), one scale per row and `group` columns (group >= K: per token)."""
    m, k = x.shape
    g = min(group, k)
    kb = -(-k // g)
    padded = torch.zeros(m, kb * g, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    tiles = padded.view(m, kb, g)
    scale = (tiles.abs().amax(dim=2) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (tiles / scale[:, :, None]).clamp_(-FP8_MAX, FP8_MAX).view(m, kb * g)[:, :k]
    return q.to(FP8), scale


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
    backend: str = "auto", tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (16/32-bit, CUDA) @ dequantize(weight e4m3 [N, K], scale [N, KB])^T (+ bias)
    -> [M, N] in x's dtype. backend: "auto", "scaled_mm" or "triton" (benchmarks pick one);
    tiles: the Triton GEMM's launch (kernels/fp8_gemm.py default_tiles by M otherwise)."""
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
    return fp8_scaled_mm(xq, xs, weight, scale, block_k, x.dtype, bias, tiles)
