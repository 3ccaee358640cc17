"""The one GEMM entry of the linear layers and the LM head, for every weight format:
y = x W^T (+ bias) [then SiLU-and-mul], W in the layer's format:

- "dense" (16-bit W [N, K]): our skinny kernel where the measured table says it beats cuBLAS for
  that (shape, M), else torch (cuBLAS on CUDA, the CPU's matmul elsewhere). In deterministic mode
  (ops/deterministic.py) one batch-invariant GEMM takes every M.
- "fp8" (e4m3 W + fp32 scale [N, KB], ops/gemm/fp8.py): the skinny template's FP8 loader where
  the table chose it, else the FP8 GEMM (activation quant + FP8 tensor cores); CPU: the reference.
- "int4" (kernels/quant4.py: qweight [N, K/8] + scales and zeros [N, K/group]) and "mxfp4"
  (blocks [N, K/2] + e8m0 scales [N, K/32]): the 4-bit kernels' wrappers (ops/gemm/w4.py) on
  CUDA; the fp32 dequantize-then-matmul reference (ops/gemm/reference.py) on the CPU.

The table (ops/gemm/table.py, one for every format, keyed by the activations' dtype and the
weight format) is per device, filled at engine start by ops/gemm/tuning.py (M of the CUDA graph
ladder up to 32); a shape or M it does not hold takes the large-batch path (4-bit: the skinny
kernel at default_config's launch up to M 32, as ops/gemm/w4.py did before the table held them). The choice happens
per call from the shapes alone, so a CUDA graph captured at batch size b keeps the kernel chosen
for M = b. MINISGL_DISABLE_SKINNY_GEMM=1 turns our skinny kernel off.
"""

from __future__ import annotations

import torch

from minisgl import env
from minisgl.kernels.batch_invariant_gemm import splits_for, uses_skinny
from minisgl.logging_setup import log_once
from minisgl.ops.activation import silu_and_mul
from minisgl.ops.deterministic import batch_invariant_linear, is_deterministic
from minisgl.ops.gemm import w4 as _w4
from minisgl.ops.gemm.fp8 import dequantize, fp8_gemm
from minisgl.ops.gemm.reference import fp8_linear_reference, int4_linear_reference, mxfp4_linear_reference
from minisgl.ops.gemm.skinny import (
    DENSE,
    DETERMINISTIC_TILE,
    FP8_FORMAT,
    MAX_M,
    SkinnyConfig,
    counters,
    cublas_linear,
    deterministic_fp8_tile,
    fp8_fits,
    launch,
    vector_aligned,
)
from minisgl.ops.gemm.table import CUBLAS, INT4, MXFP4, GemmShape, GemmTable, parse_choice, table_dtype, w4_shape

FORMATS = (DENSE, FP8_FORMAT, INT4, MXFP4)
_tables: dict[int, GemmTable] = {}
# Deterministic mode (issue 39): a 16-bit GEMM of up to DETERMINISTIC_SKINNY_M rows may run the skinny
# kernel in the order the batch-invariant Triton GEMM takes for every M: the shape's fixed splits
# (kernels/batch_invariant_gemm.splits_for) as the warps of one block, each warp a contiguous
# split in contiguous k16 steps (warp_ranges, skinny.DETERMINISTIC_TILE: the one tile built so),
# summed in warp order; one split, so no split-K counters. Which M take it is the Triton GEMM's
# measured table (batch_invariant_gemm.uses_skinny: its entries name "skinny" where that is faster,
# a few rows; the skinny tile re-reads x per 16 W rows, so more rows go to Triton tiles). 0 rows
# sends every M to the Triton GEMM (the GPU test compares the two).
DETERMINISTIC_SKINNY_M = MAX_M


def skinny_enabled(device: torch.device) -> bool:
    """Our kernel may run on `device`: CUDA, built with CUDA kernels, not switched off."""
    if device.type != "cuda" or env.DISABLE_KERNELS or env.DISABLE_SKINNY_GEMM:
        return False
    from minisgl.ops._backend import compiled

    ext = compiled()
    return ext is not None and ext.has_cuda


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def install_table(device: torch.device, table: GemmTable) -> None:
    """Later calls on `device` follow `table` (every format's entries). Call it outside CUDA-graph
    capture: it also allocates the split-K counters (a start that reads the table from the cache
    times nothing)."""
    if device.type == "cuda" and table.choices:
        counters(device)
    _tables[_index(device)] = table


def table_for(device: torch.device) -> GemmTable | None:
    return _tables.get(_index(device)) if device.type == "cuda" else None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu: bool = False, *,
    fmt: str = DENSE, scale: torch.Tensor | None = None, zeros: torch.Tensor | None = None, block_k: int = 0,
) -> torch.Tensor:
    """x [T, K] @ W^T (+ bias [N]) -> [T, N]; with silu, W is (gate | up) [2I, K] and the result
    silu(gate) * up [T, I]. `weight`, `scale`, `zeros`, `block_k` are the layer's tensors of
    format `fmt` (the module docstring). The layers' arguments are valid by construction (shapes
    from the config, dtypes from the engine), so the only checks here are the kernels' layout
    needs; anything else the torch path reports as it always did."""
    if fmt == DENSE:
        return _dense(x, weight, bias, silu)
    if fmt == FP8_FORMAT:
        return _fp8(x, weight, scale, block_k, bias, silu)
    if fmt == INT4:
        if x.device.type != "cuda":
            return int4_linear_reference(x, weight, scale, zeros, bias, silu)
        shape = w4_shape(x.dtype, INT4, weight.size(0), weight.size(1), scale.size(1), silu)
        return _w4.int4_linear(x, weight, scale, zeros, bias=bias, silu_and_mul=silu, choice=_choice(x, shape))
    if fmt == MXFP4:
        if x.device.type != "cuda":
            return mxfp4_linear_reference(x, weight, scale, bias, silu)
        shape = w4_shape(x.dtype, MXFP4, weight.size(0), weight.size(1), scale.size(1), silu)
        return _w4.mxfp4_linear(x, weight, scale, bias=bias, silu_and_mul=silu, choice=_choice(x, shape))
    raise ValueError(f"linear: weight format {fmt!r} is not one of {FORMATS}")


def _choice(x: torch.Tensor, shape: GemmShape) -> SkinnyConfig | str | None:
    """The table's measured choice for this call (x's rows as M): our config, CUBLAS (the
    large-batch path), or None where it has none (a 4-bit call then takes default_config's
    launch in ops/gemm/w4.py, as before the table held 4-bit shapes)."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    table = _tables.get(_index(x.device)) if x.device.type == "cuda" else None
    choice = None if table is None or not 0 < m <= MAX_M else table.entry(shape, m)
    return choice if choice is None or choice == CUBLAS else parse_choice(choice)


def _lookup(x: torch.Tensor, shape: GemmShape) -> SkinnyConfig | None:
    """The table's config for this 2-D call, or None (the large-batch path)."""
    choice = _choice(x, shape) if x.dim() == 2 else None
    return choice if isinstance(choice, SkinnyConfig) else None


def _deterministic(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """A 16-bit GEMM in deterministic mode: the skinny kernel in the batch-invariant order where
    the measured table names it for this shape and M (up to DETERMINISTIC_SKINNY_M rows) and its
    16-byte loads fit, else the batch-invariant GEMM (the same bits by construction:
    kernels/batch_invariant_gemm.py). SiLU-and-mul is always its own kernel on the rounded GEMM
    output, as the Triton path has it."""
    m = x.shape[0] if x.dim() == 2 else 0
    if (
        0 < m <= DETERMINISTIC_SKINNY_M
        and x.dtype in (torch.float16, torch.bfloat16)
        and skinny_enabled(x.device)
        and uses_skinny(*weight.shape, m)
        and _skinny_misfit(x, weight, bias) is None
    ):
        y = deterministic_skinny(x, weight, bias, torch.empty((m, weight.shape[0]), dtype=x.dtype, device=x.device))
        return silu_and_mul(y) if silu else y
    return batch_invariant_linear(x, weight, bias, silu)


def deterministic_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         out: torch.Tensor) -> torch.Tensor:
    """out = x weight^T (+ bias) by the skinny kernel in the batch-invariant GEMM's order (a 16-bit
    weight, up to 32 rows, checked by the caller): the shape's fixed K splits as one block's warps."""
    launch(x, weight, bias, out, False, SkinnyConfig(DETERMINISTIC_TILE, splits_for(weight.shape[1]), 1),
           warp_ranges=True)
    return out


def _skinny_misfit(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why a 16-bit call cannot take the skinny kernel ("dtype": mixed dtypes, which torch reports
    or handles; "align": no 16-byte loads), or None."""
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return "dtype"
    if x.stride(1) != 1 or weight.stride(1) != 1 or not vector_aligned(x, weight):
        return "align"
    return None


def _dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    if is_deterministic(x.device):
        return _deterministic(x, weight, bias, silu)
    cfg = _lookup(x, GemmShape(table_dtype(x.dtype, DENSE), weight.size(0), weight.size(-1), silu))
    if cfg is None:
        return cublas_linear(x, weight, bias, silu, None)
    why = _skinny_misfit(x, weight, bias)
    if why == "dtype":
        return cublas_linear(x, weight, bias, silu, None)
    if why == "align":
        log_once(
            f"linear:align:{weight.shape}",
            f"linear: x {tuple(x.shape)} (strides {x.stride()}) with weight {tuple(weight.shape)} does not allow "
            "16-byte loads: cuBLAS instead of the skinny kernel",
        )
        return cublas_linear(x, weight, bias, silu, None)
    out = torch.empty((x.shape[0], weight.size(0) // 2 if silu else weight.size(0)), dtype=x.dtype, device=x.device)
    launch(x, weight, bias, out, silu, cfg)
    return out


def fp8_large_batch(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int, bias: torch.Tensor | None, silu: bool
) -> torch.Tensor:
    """The FP8 layer's path without the skinny kernel (the tuner's baseline for FP8 shapes)."""
    y = fp8_gemm(x, weight, scale, block_k, bias)
    return silu_and_mul(y) if silu else y


def _fp8_deterministic(x, weight, scale, block_k, bias, silu) -> torch.Tensor:
    """An FP8 GEMM in deterministic mode, W8A16 (x is not quantized): up to DETERMINISTIC_SKINNY_M
    rows the skinny kernel's FP8 loader with the shape's fixed splits (batch_invariant_fp8.splits_for)
    as one block's warps (warp_ranges, in the tile skinny.deterministic_fp8_tile picks by M: any gives
    the same bits), else kernels/batch_invariant_fp8.py, which sums in that loader's order (the same
    bits by construction). SiLU-and-mul is its own kernel, as in `_deterministic`."""
    if x.device.type != "cuda":
        # CPU: the reference's math (fp32, rounded once to x's dtype), one row at a time.
        w = dequantize(weight, scale, block_k)
        y = batch_invariant_linear(x.float(), w, None if bias is None else bias.float(), silu)
        return y.to(x.dtype)
    from minisgl.kernels import batch_invariant_fp8

    if x.stride(-1) != 1:
        x = x.contiguous()
    m, (n, k) = x.shape[0], weight.shape
    splits = batch_invariant_fp8.splits_for(n, k)
    if (
        0 < m <= DETERMINISTIC_SKINNY_M
        and skinny_enabled(x.device)
        and fp8_fits(x, weight, scale, block_k)
        and (bias is None or (bias.dtype == x.dtype and bias.stride(0) == 1))
    ):
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        launch(x, weight, bias, y, False, SkinnyConfig(deterministic_fp8_tile(m, k, splits), splits, 1), scale=scale,
               warp_ranges=True)
    else:
        y = batch_invariant_fp8.gemm(x, weight, scale, splits, bias)
    return silu_and_mul(y) if silu else y


def _fp8(x, weight, scale, block_k, bias, silu) -> torch.Tensor:
    if is_deterministic(x.device):
        return _fp8_deterministic(x, weight, scale, block_k, bias, silu)
    if x.device.type != "cuda" or x.shape[0] == 0:
        return fp8_linear_reference(x, weight, scale, block_k, bias, silu)
    shape = GemmShape(table_dtype(x.dtype, FP8_FORMAT, scale.size(1) > 1), weight.size(0), weight.size(1), silu)
    cfg = _lookup(x, shape)
    if cfg is None or (bias is not None and bias.dtype != x.dtype):
        return fp8_large_batch(x, weight, scale, block_k, bias, silu)
    if not fp8_fits(x, weight, scale, block_k):
        log_once(f"skinny_fp8:layout:{tuple(weight.shape)}",
                 f"fp8 linear: x {tuple(x.shape)} (strides {x.stride()}) with weight {tuple(weight.shape)} does not "
                 "allow the skinny kernel's 16-byte loads: the FP8 GEMM instead")
        return fp8_large_batch(x, weight, scale, block_k, bias, silu)
    out = torch.empty((x.shape[0], weight.size(0) // 2 if silu else weight.size(0)), dtype=x.dtype, device=x.device)
    launch(x, weight, bias, out, silu, cfg, scale=scale)
    return out
