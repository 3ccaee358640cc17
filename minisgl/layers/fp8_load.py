"""Loading FP8 linear weights: checkpoint scales -> our layout (ops/gemm/fp8.py), and the choice of
which fused layers are FP8 (a fused layer's parts must all be, or none)."""

from __future__ import annotations

import torch

from minisgl.core.quant_config import BLOCK, QuantConfig
from minisgl.ops.gemm.fp8 import FP8, expand_block_scale


def experts_quant(cfg: QuantConfig | None, module: str) -> QuantConfig | None:
    """The quantization of a MoE block's stacked experts: MXFP4 checkpoints quantize exactly these."""
    if cfg is not None and cfg.fmt == "mxfp4":
        return cfg if cfg.quantizes(module) else None
    return layer_quant(cfg, [module])


def layer_quant(cfg: QuantConfig | None, modules: list[str]) -> QuantConfig | None:
    """The quantization of the layer fusing the HF modules `modules` (None: 16-bit)."""
    if cfg is None or cfg.fmt == "mxfp4":  # MXFP4 checkpoints (GPT-OSS) quantize MoE experts only
        return None
    quantized = [cfg.quantizes(m) for m in modules]
    if all(quantized):
        return cfg
    if not any(quantized):
        return None
    fp8 = [m for m, q in zip(modules, quantized, strict=True) if q]
    kept = [m for m, q in zip(modules, quantized, strict=True) if not q]
    raise ValueError(
        f"{', '.join(fp8)} would be quantized but {', '.join(kept)} not (the quantization_config's ignore list): "
        "minisgl fuses them into one layer, which must be all quantized or all 16-bit"
    )


def scale_rows(name: str, scale: torch.Tensor, cfg: QuantConfig, n: int, k: int) -> torch.Tensor:
    """A checkpoint's scale tensor for a [n, k] weight -> fp32 [n, KB]: KB = ceil(k / 128) for
    block scales (each block row repeated for its 128 weight rows), else 1."""
    if not scale.is_floating_point() or scale.dtype == FP8:
        raise ValueError(f"tensor {name} has dtype {scale.dtype}; a weight scale must be float32/bf16/fp16")
    if cfg.weights == "tensor":
        if scale.numel() != 1:
            raise ValueError(f"tensor {name} has shape {tuple(scale.shape)}; a per-tensor scale holds one value")
        return scale.float().reshape(1, 1).expand(n, 1)
    if cfg.weights == "channel":
        if tuple(scale.shape) not in ((n, 1), (n,)):
            raise ValueError(f"tensor {name} has shape {tuple(scale.shape)}, expected ({n}, 1): a scale per channel")
        return scale.float().reshape(n, 1)
    want = (-(-n // BLOCK), -(-k // BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"tensor {name} has shape {tuple(scale.shape)}, expected {want}: one scale per 128 x 128 block "
            f"of a [{n}, {k}] weight"
        )
    return expand_block_scale(scale.float(), n, BLOCK)


def check_weight_dtype(name: str, tensor: torch.Tensor, quant: QuantConfig | None) -> None:
    """An FP8 tensor only into an FP8 layer (it has no meaning without its scale); a 16-bit one
    into an FP8 layer only when quantizing on load."""
    if quant is None:
        if tensor.dtype == FP8:
            raise ValueError(f"tensor {name} is FP8, but its module is not FP8 here (ignored, or a kind minisgl "
                             "loads in 16 bits only)")
        return
    if tensor.dtype != FP8 and not quant.online:
        raise ValueError(f"tensor {name} is {tensor.dtype}, but the quantization_config makes its module FP8")
    if tensor.dtype == FP8 and quant.online:
        raise ValueError(f"tensor {name} is FP8 in a checkpoint without a quantization_config")
