"""Weight-only FP8 skinny GEMM: y = x dequantize(W, S)^T (+ bias) for 1..32 rows of x, W e4m3
and S its fp32 scales in the layer layout of ops/fp8.py ([N, 1] per channel, or [N, ceil(K/128)]:
128 x 128 block scales expanded to rows). csrc/skinny_weights.cuh (Fp8W) reads W once (half the bytes of
bf16) and dequantizes in registers; x stays 16-bit (no activation quantization).

`skinny_gemm_fp8` is the checked op (tests, benchmarks); `fp8_skinny_linear` is the layers'
dispatch: our kernel where the measured table (ops/fp8_tuning.py) says it beats the FP8
large-batch path (ops/fp8_gemm.py) for that (shape, M), else None (the caller takes that path).
Launch configurations are SkinnyConfig over `fp8_tile_shapes()`, whose chunk counts are in
32-element units like the bf16 table's (the kernel's 64-element chunks x 2), so the bf16
candidate and split rules apply unchanged.
"""

from __future__ import annotations

import functools

import torch

from minisgl.ops._backend import compiled, current_stream, use_cuda_kernel
from minisgl.ops._checks import check_inner_contiguous, check_same_device, check_shape, check_tensor
from minisgl.ops.fp8 import FP8, fp8_linear_reference
from minisgl.ops.gemm_table import GemmShape, GemmTable
from minisgl.ops.skinny_gemm import (
    _KERNEL_DTYPES,
    _NUM_COUNTERS,
    MAX_M,
    MAX_SPLITS,
    MAX_WARPS,
    PDL,
    SkinnyConfig,
    counters,
    default_config,
    num_tiles,
)

BLOCK = 128  # the only block size of block scales (the kernel applies one scale per 128-K span)
_tables: dict[int, GemmTable] = {}


@functools.cache
def fp8_tile_shapes() -> tuple[tuple[int, int, int], ...]:
    """(row tiles per block, 32-element chunks per warp group, largest M) of each FP8 tile, by id."""
    ext = compiled()
    if ext is None or not ext.has_cuda:
        return ()
    return tuple((rt, 2 * u, max_m) for rt, u, max_m in ext.skinny_gemm_configs(fp8=True))


def table_dtype(x_dtype: torch.dtype, block: bool) -> str:
    """The dtype field of an FP8 layer's GemmShape: activations and scale kind, e.g. 'bfloat16-fp8block'."""
    return f"{str(x_dtype).removeprefix('torch.')}-fp8{'block' if block else 'chan'}"


def is_block(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    return scale.size(1) > 1


def kernel_fits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> bool:
    """The kernel's layout needs: 16-bit x, K % 16 == 0, 16-byte aligned bases and W rows, x rows
    of a multiple of 8 elements, scales one row per weight row, per channel or per 128-K block."""
    n, k = weight.shape
    kb = scale.size(1)
    return (
        x.dtype in _KERNEL_DTYPES
        and k % 16 == 0
        and x.stride(1) == 1 and weight.stride(1) == 1 and scale.stride(1) == 1
        and x.data_ptr() % 16 == 0 and (x.size(0) == 1 or x.stride(0) % 8 == 0)
        and weight.data_ptr() % 16 == 0 and (n == 1 or weight.stride(0) % 16 == 0)
        and scale.size(0) == n and (kb == 1 or (block_k == BLOCK and kb == -(-k // BLOCK)))
    )


def _check(x, weight, scale, block_k, bias, silu, out) -> int:
    """Checks every argument of the op; returns the output width."""
    check_tensor("x", x, dtype=(torch.float16, torch.bfloat16, torch.float32), ndim=2)
    check_tensor("weight", weight, dtype=FP8, ndim=2)
    check_tensor("scale", scale, dtype=torch.float32, ndim=2)
    n_w, k = weight.shape
    check_shape("weight", weight, (None, x.size(1)))
    check_shape("scale", scale, (n_w, None))
    if x.size(0) > MAX_M:
        raise ValueError(f"x must have at most {MAX_M} rows (a skinny GEMM), got shape {tuple(x.shape)}")
    if scale.size(1) != 1 and (block_k != BLOCK or scale.size(1) != -(-k // BLOCK)):
        raise ValueError(f"scale must be [N, 1] or [N, ceil(K / 128)] with block_k 128, got {tuple(scale.shape)} "
                         f"with block_k {block_k}")
    if silu and n_w % 2:
        raise ValueError(f"weight must have an even number of rows (gate | up) with silu, got {tuple(weight.shape)}")
    n_out = n_w // 2 if silu else n_w
    tensors = {"x": x, "weight": weight, "scale": scale}
    if bias is not None:
        check_tensor("bias", bias, dtype=x.dtype, ndim=1)
        check_shape("bias", bias, (n_w,))
        check_inner_contiguous("bias", bias)
        tensors["bias"] = bias
    if out is not None:
        check_tensor("out", out, dtype=x.dtype, ndim=2)
        check_shape("out", out, (x.size(0), n_out))
        check_inner_contiguous("out", out)
        tensors["out"] = out
    check_same_device(**tensors)
    return n_out


def skinny_gemm_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int, bias: torch.Tensor | None = None,
    *, silu: bool = False, out: torch.Tensor | None = None, config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= 32) @ dequantize(weight e4m3 [N, K], scale [N, KB], block_k)^T (+ bias)
    -> [M, N] in x's dtype (silu: silu(gate) * up [M, N / 2]). On the CPU the fp32 reference
    (ops.fp8.fp8_linear_reference); on CUDA our kernel with `config` (or a default), and a
    ValueError where the layout does not allow its 16-byte loads (no silent fallback here:
    the dispatch checks kernel_fits first)."""
    n_out = _check(x, weight, scale, block_k, bias, silu, out)
    if not use_cuda_kernel("skinny_gemm_fp8", x):
        y = fp8_linear_reference(x, weight, scale, block_k, bias, silu)
        return y if out is None else out.copy_(y)
    if not kernel_fits(x, weight, scale, block_k):
        raise ValueError(
            f"skinny_gemm_fp8: x {x.dtype} {tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)} "
            f"strides {weight.stride()}: the kernel needs 16-bit x, K % 16 == 0 and 16-byte aligned rows"
        )
    m, k = x.shape
    if out is None:
        out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    shapes = fp8_tile_shapes()
    if config is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        config = default_config(m, n_out, k, silu, sms, shapes)
    if not 0 <= config.tile < len(shapes) or m > shapes[config.tile][2]:
        raise ValueError(f"config {config} does not take {m} rows (FP8 tiles {shapes})")
    if not (1 <= config.warps <= MAX_WARPS and 1 <= config.splits <= MAX_SPLITS):
        raise ValueError(f"config {config}: warps must be in 1..{MAX_WARPS}, splits in 1..{MAX_SPLITS}")
    launch_fp8(x, weight, scale, bias, out, silu, config)
    return out


def launch_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
    silu: bool, cfg: SkinnyConfig, pdl: bool = PDL,
) -> None:
    """The launch alone, for callers that checked the arguments (kernel_fits)."""
    m, k = x.shape
    n_out = out.size(1)
    shapes = fp8_tile_shapes()
    x_stride = x.stride(0) if m > 1 else k
    w_stride = weight.stride(0) if weight.size(0) > 1 else k
    y_stride = out.stride(0) if m > 1 else n_out
    s_stride = scale.stride(0) if scale.size(0) > 1 else scale.size(1)
    splits = cfg.splits
    ws = ctr = None
    ws_bytes = 0
    if splits > 1:
        tiles = num_tiles(n_out, silu, cfg.tile, shapes)
        if tiles > _NUM_COUNTERS:
            splits = 1
        else:
            ctr = counters(x.device)
            items = tiles * splits * shapes[cfg.tile][0] * (-(-m // 8)) * 2 * 32  # float2 per (tile, split, pair)
            ws = torch.empty(2 * items, dtype=torch.float32, device=x.device)
            ws_bytes = ws.numel() * 4
    # fmt: off
    compiled().skinny_gemm_fp8(
        x.data_ptr(), weight.data_ptr(), scale.data_ptr(), s_stride, scale.size(1) > 1,
        0 if bias is None else bias.data_ptr(), out.data_ptr(), 0 if ws is None else ws.data_ptr(), ws_bytes,
        0 if ctr is None else ctr.data_ptr(), 0 if ctr is None else ctr.numel(), m, n_out, k,
        x_stride, w_stride, y_stride, silu, _KERNEL_DTYPES[x.dtype], cfg.tile, cfg.warps, splits, pdl,
        current_stream(x.device),
    )
    # fmt: on


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def install_fp8_table(device: torch.device, table: GemmTable) -> None:
    """Later FP8 calls on `device` follow `table` (outside graph capture: allocates the counters)."""
    if table.choices:
        counters(device)
    _tables[_index(device)] = table


def fp8_skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int, bias: torch.Tensor | None, silu: bool
) -> torch.Tensor | None:
    """The FP8 layer's low-batch path: our kernel's output where the device's table chose it for
    (shape, M), else None. Arguments are the layer's own (valid by construction)."""
    m = x.shape[0]
    if not 0 < m <= MAX_M or x.dim() != 2 or x.device.type != "cuda":
        return None
    table = _tables.get(_index(x.device))
    if table is None:
        return None
    shape = GemmShape(table_dtype(x.dtype, is_block(weight, scale)), weight.size(0), weight.size(1), silu)
    cfg = table.lookup(shape, m)
    if cfg is None or (bias is not None and bias.dtype != x.dtype):
        return None
    if not kernel_fits(x, weight, scale, block_k):
        from minisgl.logging_setup import log_once

        log_once(f"skinny_fp8:layout:{tuple(weight.shape)}",
                 f"fp8 linear: x {tuple(x.shape)} (strides {x.stride()}) with weight {tuple(weight.shape)} does not "
                 "allow the skinny kernel's 16-byte loads: the FP8 GEMM instead")
        return None
    out = torch.empty((m, weight.size(0) // 2 if silu else weight.size(0)), dtype=x.dtype, device=x.device)
    launch_fp8(x, weight, scale, bias, out, silu, cfg)
    return out
