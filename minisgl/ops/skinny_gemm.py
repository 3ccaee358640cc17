"""Skinny GEMM: y = x W^T (+ bias) for 1..32 rows of x, the linear layers of a low-batch
decode step (csrc/skinny_gemm.cuh streams W once with 16-byte loads into tensor cores).

`skinny_gemm` is the checked op; `minisgl.ops.linear` decides per shape whether a layer uses
it or cuBLAS. A launch configuration is (tile, warps, splits): `tile` indexes the compiled
tile shapes (`tile_shapes()`: row tiles of 16 W rows per block, 32-element chunks per warp
group, the largest M it takes), `warps` per block split K inside the block, and `splits`
blocks per row tile split K across blocks (reduced in the kernel through an fp32 workspace).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.ops._backend import compiled, current_stream, use_cuda_kernel
from minisgl.ops._checks import check_inner_contiguous, check_same_device, check_shape, check_tensor
from minisgl.ops.activation import silu_and_mul

MAX_M = 32
MAX_WARPS = 8
# Launch as a programmatic dependent of the previous kernel (sm_90+): the launch and the first
# loads of W overlap that kernel's tail. Timings for the dispatch table are taken without it
# (the conservative figure: in the model most GEMMs follow a kernel that is not ours).
PDL = True
MAX_SPLITS = 64
_KERNEL_DTYPES = {torch.float16: 0, torch.bfloat16: 1}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Split-K counters, one per row tile of a launch (zero between launches: the kernel's last
# block of each tile resets its own). One set per device, allocated zeroed outside any graph
# capture; so two launches with splits > 1 must not run at once on two streams of one device
# (the engine runs each rank on one stream).
_NUM_COUNTERS = 1 << 16
_counters: dict[int, torch.Tensor] = {}


@dataclass(frozen=True)
class SkinnyConfig:
    tile: int  # index into tile_shapes()
    warps: int  # per block, 1..8
    splits: int  # K splits across blocks, 1..64

    def __str__(self) -> str:
        return f"t{self.tile}w{self.warps}s{self.splits}"

    @classmethod
    def parse(cls, text: str) -> SkinnyConfig:
        """The inverse of str(): 't1w4s2'."""
        try:
            t, rest = text.removeprefix("t").split("w")
            w, s = rest.split("s")
            return cls(int(t), int(w), int(s))
        except ValueError as e:
            raise ValueError(f"not a skinny GEMM config: {text!r} (expected e.g. 't1w4s2')") from e


@functools.cache
def tile_shapes() -> tuple[tuple[int, int, int], ...]:
    """(row tiles per block, chunks per warp group, largest M) of each compiled tile, by id."""
    ext = compiled()
    if ext is None or not ext.has_cuda:
        return ()
    return tuple(tuple(t) for t in ext.skinny_gemm_configs())


def num_tiles(n_out: int, silu: bool, tile: int, shapes: tuple[tuple[int, int, int], ...] | None = None) -> int:
    """Blocks per K split: a block covers 16 W rows per row tile, 8 (gate, up) row pairs in SiLU mode.
    `shapes`: the tile table (default tile_shapes(); the FP8 kernel passes its own)."""
    rows = (shapes or tile_shapes())[tile][0] * (8 if silu else 16)
    return -(-n_out // rows)


def default_config(
    m: int, n_out: int, k: int, silu: bool, num_sms: int, shapes: tuple[tuple[int, int, int], ...] | None = None
) -> SkinnyConfig:
    """A config for shapes no measured table covers (direct calls to the op): tile 1 (RT 1,
    U 4) or, past its M, tile 0; 4 warps; enough K splits for ~2 blocks per SM, keeping
    every warp at least 2 groups of K. The dispatch never uses this: it measures."""
    shapes = shapes or tile_shapes()
    tile = 1 if m <= shapes[1][2] else 0
    warps = 4
    group = shapes[tile][1] * 32
    blocks = num_tiles(n_out, silu, tile, shapes)
    splits = 1
    while splits * 2 <= MAX_SPLITS and blocks * splits < 2 * num_sms and k // (splits * 2) >= warps * group * 2:
        splits *= 2
    return SkinnyConfig(tile, warps, splits)


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


def _check(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool, out: torch.Tensor | None
) -> int:
    """Checks every argument; returns the output width."""
    check_tensor("x", x, dtype=_DTYPES, ndim=2)
    check_tensor("weight", weight, dtype=x.dtype, ndim=2)
    k = x.size(1)
    check_shape("weight", weight, (None, k))
    if x.size(0) > MAX_M:
        raise ValueError(f"x must have at most {MAX_M} rows (a skinny GEMM), got shape {tuple(x.shape)}")
    n_w = weight.size(0)
    if silu and n_w % 2:
        raise ValueError(f"weight must have an even number of rows (gate | up) with silu, got {tuple(weight.shape)}")
    n_out = n_w // 2 if silu else n_w
    tensors = {"x": x, "weight": weight}
    if bias is not None:
        check_tensor("bias", bias, dtype=x.dtype, ndim=1)
        check_shape("bias", bias, (n_w,))
        tensors["bias"] = bias
    if out is not None:
        check_tensor("out", out, dtype=x.dtype, ndim=2)
        check_shape("out", out, (x.size(0), n_out))
        tensors["out"] = out
    check_same_device(**tensors)
    check_inner_contiguous("x", x)
    check_inner_contiguous("weight", weight)
    if bias is not None:
        check_inner_contiguous("bias", bias)
    if out is not None:
        check_inner_contiguous("out", out)
    return n_out


def _check_config(cfg: SkinnyConfig, m: int) -> None:
    shapes = tile_shapes()
    if not 0 <= cfg.tile < len(shapes):
        raise ValueError(f"config tile must be in 0..{len(shapes) - 1}, got {cfg.tile}")
    if m > shapes[cfg.tile][2]:
        raise ValueError(f"config tile {cfg.tile} takes at most {shapes[cfg.tile][2]} rows of x, got {m}")
    if not 1 <= cfg.warps <= MAX_WARPS:
        raise ValueError(f"config warps must be in 1..{MAX_WARPS}, got {cfg.warps}")
    if not 1 <= cfg.splits <= MAX_SPLITS:
        raise ValueError(f"config splits must be in 1..{MAX_SPLITS}, got {cfg.splits}")


def vector_aligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel's 16-byte loads need 16-byte aligned bases and row strides (K % 8 == 0 too)."""
    return (
        x.size(1) % 8 == 0
        and x.data_ptr() % 16 == 0
        and (x.size(0) == 1 or x.stride(0) % 8 == 0)
        and weight.data_ptr() % 16 == 0
        and (weight.size(0) == 1 or weight.stride(0) % 8 == 0)
    )


def cublas_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool, out: torch.Tensor | None
) -> torch.Tensor:
    """The same op through torch (cuBLAS on CUDA), SiLU-and-mul as its own kernel."""
    y = F.linear(x, weight, bias)
    if silu:
        y = silu_and_mul(y)
    if out is None:
        return y
    return out.copy_(y)


def counters(device: torch.device) -> torch.Tensor:
    index = device.index if device.index is not None else torch.cuda.current_device()
    buf = _counters.get(index)
    if buf is None:
        if torch.cuda.is_current_stream_capturing():
            # A zero fill recorded into a graph would run only on replay, never for eager calls.
            raise ValueError("skinny_gemm: call it once outside CUDA-graph capture before capturing split-K launches")
        buf = _counters[index] = torch.zeros(_NUM_COUNTERS, dtype=torch.int32, device=device)
    return buf


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu: bool = False,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= 32; row stride free) @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's
    dtype (into `out` if given; its row stride is free). silu: weight is (gate | up) [2I, K]
    and the result silu(gate) * up [M, I]. On the CPU: the fp32 reference. On CUDA with
    16-bit dtypes: our kernel, with `config` or default_config(); where the layout does not
    allow 16-byte loads (or for float32) cuBLAS instead, said once in the log."""
    from minisgl.logging_setup import log_once

    n_out = _check(x, weight, bias, silu, out)
    m, k = x.shape
    if not use_cuda_kernel("skinny_gemm", x):
        y = skinny_gemm_reference(x, weight, bias, silu)
        return y if out is None else out.copy_(y)
    if x.dtype not in _KERNEL_DTYPES:
        log_once("skinny:dtype", f"skinny_gemm: {x.dtype} runs through cuBLAS (the kernel takes fp16/bf16)")
        return cublas_linear(x, weight, bias, silu, out)
    if not vector_aligned(x, weight):
        log_once(
            f"skinny:align:{k}",
            f"skinny_gemm: x/weight (K {k}, strides {x.stride()} / {weight.stride()}) do not allow 16-byte "
            "loads: cuBLAS instead",
        )
        return cublas_linear(x, weight, bias, silu, out)
    if out is None:
        out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if config is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        config = default_config(m, n_out, k, silu, sms)
    _check_config(config, m)
    launch(x, weight, bias, out, silu, config)
    return out


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    silu: bool,
    cfg: SkinnyConfig,
    pdl: bool = PDL,
) -> None:
    """The launch alone, for callers that checked the arguments (the dispatch in ops.linear)."""
    m, k = x.shape
    n_out = out.size(1)
    # A single row's stride is never used, and may be anything in a view: pass the packed one.
    x_stride = x.stride(0) if m > 1 else k
    w_stride = weight.stride(0) if weight.size(0) > 1 else k
    y_stride = out.stride(0) if m > 1 else n_out
    splits = cfg.splits
    ws = ctr = None
    ws_bytes = 0
    if splits > 1:
        tiles = num_tiles(n_out, silu, cfg.tile)
        if tiles > _NUM_COUNTERS:  # more row tiles than counters (N > 500k): no split needed there
            splits = 1
        else:
            ctr = counters(x.device)
            rt = tile_shapes()[cfg.tile][0]
            items = tiles * splits * rt * (-(-m // 8)) * 2 * 32  # float2 per (tile, split, pair)
            ws = torch.empty(2 * items, dtype=torch.float32, device=x.device)
            ws_bytes = ws.numel() * 4
    # fmt: off
    compiled().skinny_gemm(
        x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
        0 if ws is None else ws.data_ptr(), ws_bytes, 0 if ctr is None else ctr.data_ptr(),
        0 if ctr is None else ctr.numel(), m, n_out, k, x_stride, w_stride, y_stride,
        silu, _KERNEL_DTYPES[x.dtype], cfg.tile, cfg.warps, splits, pdl, current_stream(x.device),
    )
    # fmt: on
