"""The GEMM of the linear layers and the LM head: y = x W^T (+ bias) [then SiLU-and-mul],
through our skinny kernel where the measured table says it beats cuBLAS for that (shape, M),
else through torch (cuBLAS on CUDA, the CPU's matmul elsewhere).

The table is per device, filled at engine start by minisgl.ops.gemm_tuning (M of the CUDA
graph ladder up to 32); a shape or M it does not hold goes to cuBLAS. The choice happens
per call from the shapes alone, so a CUDA graph captured at batch size b keeps the kernel
chosen for M = b. MINISGL_DISABLE_SKINNY_GEMM=1 turns our kernel off. In deterministic mode
(minisgl.ops.deterministic) neither runs: one batch-invariant GEMM takes every M.
"""

from __future__ import annotations

import torch

from minisgl import env
from minisgl.logging_setup import log_once
from minisgl.ops.activation import silu_and_mul
from minisgl.ops.deterministic import batch_invariant_linear, is_deterministic
from minisgl.ops.fp8 import fp8_linear_reference
from minisgl.ops.fp8_gemm import fp8_gemm
from minisgl.ops.gemm_table import GemmShape, GemmTable
from minisgl.ops.skinny_fp8 import fp8_skinny_linear
from minisgl.ops.skinny_gemm import MAX_M, counters, cublas_linear, launch, vector_aligned

_tables: dict[int, GemmTable] = {}


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
    """Later calls on `device` follow `table`. Call it outside CUDA-graph capture: it also
    allocates the split-K counters (a start that reads the table from the cache times nothing)."""
    if device.type == "cuda" and table.choices:
        counters(device)
    _tables[_index(device)] = table


def table_for(device: torch.device) -> GemmTable | None:
    return _tables.get(_index(device)) if device.type == "cuda" else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias [N]) -> [T, N]; with silu, weight is (gate | up)
    [2I, K] and the result silu(gate) * up [T, I]. The layers' arguments are valid by
    construction (shapes from the config, dtypes from the engine), so the only checks here are
    the kernel's layout needs; anything else the torch path reports as it always did."""
    if is_deterministic(x.device):
        return batch_invariant_linear(x, weight, bias, silu)
    m = x.shape[0]
    if x.dim() != 2 or not 0 < m <= MAX_M or x.device.type != "cuda":
        return cublas_linear(x, weight, bias, silu, None)
    table = _tables.get(_index(x.device))
    if table is None:
        return cublas_linear(x, weight, bias, silu, None)
    cfg = table.lookup(GemmShape(str(x.dtype).removeprefix("torch."), weight.size(0), weight.size(1), silu), m)
    if cfg is None:
        return cublas_linear(x, weight, bias, silu, None)
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return cublas_linear(x, weight, bias, silu, None)  # torch reports (or handles) the mix
    if x.stride(1) != 1 or weight.stride(1) != 1 or not vector_aligned(x, weight):
        log_once(
            f"linear:align:{weight.shape}",
            f"linear: x {tuple(x.shape)} (strides {x.stride()}) with weight {tuple(weight.shape)} does not allow "
            "16-byte loads: cuBLAS instead of the skinny kernel",
        )
        return cublas_linear(x, weight, bias, silu, None)
    out = torch.empty((m, weight.size(0) // 2 if silu else weight.size(0)), dtype=x.dtype, device=x.device)
    launch(x, weight, bias, out, silu, cfg)
    return out


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
    bias: torch.Tensor | None = None, silu: bool = False,
) -> torch.Tensor:
    """The linear op of an FP8 layer; arguments valid by construction (the layer's own)."""
    if x.device.type != "cuda" or x.shape[0] == 0:
        return fp8_linear_reference(x, weight, scale, block_k, bias, silu)
    y = fp8_skinny_linear(x, weight, scale, block_k, bias, silu)  # M <= 32 where the table chose it
    if y is not None:
        return y
    y = fp8_gemm(x, weight, scale, block_k, bias)
    return silu_and_mul(y) if silu else y
