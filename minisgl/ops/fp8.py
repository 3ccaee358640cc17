"""FP8 (e4m3) weights: quantize, dequantize, and the reference linear over them (the op that
dispatches an FP8 layer's GEMM is minisgl.ops.linear.fp8_linear).

Layout of a quantized linear layer (layers/linear.py): weight e4m3 [N, K] and fp32
weight_scale [N, KB] with one scale per row and K block of `block_k` elements
(KB = ceil(K / block_k)): block_k = 128 for block-quantized checkpoints (their 128 x 128 block
scales expanded to rows on load, so fused q/k/v parts need not be 128-row aligned), block_k = K
(KB = 1) for per-channel and per-tensor scales. The dequantized weight is
W[n, k] = weight[n, k] * weight_scale[n, k // block_k].

`fp8_linear` on the CPU is the reference: dequantize, matmul in fp32 (activations stay
unquantized, so an FP8 checkpoint matches transformers on its dequantized weights). On CUDA the
activations are quantized per token (per token and 128-wide K group with block scales) by our
Triton kernel and the FP8 x FP8 GEMM runs on tensor cores (ops/fp8_gemm.py); at M <= 32, where
the measured table says so, the weight-only FP8 skinny kernel instead (ops/skinny_fp8.py).
"""

from __future__ import annotations

import torch

from minisgl.ops.skinny_gemm import skinny_gemm_reference

FP8 = torch.float8_e4m3fn
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


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
    bias: torch.Tensor | None = None, silu: bool = False,
) -> torch.Tensor:
    """x [T, K] @ dequantize(weight, scale)^T (+ bias) in fp32, rounded once to x's dtype;
    silu: the weight is (gate | up) and the result silu(gate) * up."""
    return skinny_gemm_reference(x, dequantize(weight, scale, block_k), bias, silu)
