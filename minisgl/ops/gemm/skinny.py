"""Skinny GEMM: y = x W^T (+ bias) for 1..32 rows of x, the linear layers of a low-batch
decode step. One kernel template (csrc/skinny_gemm.cuh) streams W once with 16-byte loads into
tensor cores; its weight loader is the format's: 16-bit W as it is, or FP8 (e4m3) W with fp32
scales (ops/gemm/fp8.py's layout) dequantized in registers while x stays 16-bit.

`skinny_gemm` / `skinny_gemm_fp8` are the checked ops (tests, benchmarks); ops/gemm/dispatch.py
decides per shape and M whether a layer uses the kernel. A launch configuration is (tile, warps,
splits): `tile` indexes the format's compiled tile shapes (`tile_shapes(fmt)`: row tiles of 16
W rows per block, 32-element chunks per warp group, the largest M it takes), `warps` per block
split K inside the block, and `splits` blocks per row tile split K across blocks (reduced in the
kernel through an fp32 workspace), the same rules for every format.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.kernels import device as _device
from minisgl.ops._backend import compiled, current_stream, use_cuda_kernel
from minisgl.ops._checks import check_inner_contiguous, check_same_device, check_shape, check_tensor
from minisgl.ops.activation import silu_and_mul
from minisgl.ops.gemm.fp8 import BLOCK, FP8
from minisgl.ops.gemm.reference import fp8_linear_reference, skinny_gemm_reference

MAX_M = 32
MAX_WARPS = 8
# Launch as a programmatic dependent of the previous kernel (sm_90+): the launch and the first
# loads of W overlap that kernel's tail. Timings for the dispatch table are taken without it
# (the conservative figure: in the model most GEMMs follow a kernel that is not ours).
PDL = True
MAX_SPLITS = 64
# The one tile built with deterministic mode's loader (warp_ranges: csrc/skinny_launch.h
# Tiles<Bf16DetW>, whose MMAs take K in contiguous 16-element steps); rt 1, u 4, up to 32 rows.
DETERMINISTIC_TILE = 1
_KERNEL_DTYPES = {torch.float16: 0, torch.bfloat16: 1}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Split-K counters, one per row tile of a launch (zero between launches: the kernel's last
# block of each tile resets its own). One set per device, allocated zeroed outside any graph
# capture; so two launches with splits > 1 must not run at once on two streams of one device
# (the engine runs each rank on one stream).
_NUM_COUNTERS = 1 << 16
_counters: dict[int, torch.Tensor] = {}
DENSE, FP8_FORMAT = "dense", "fp8"  # the weight formats the template is built for


@dataclass(frozen=True)
class SkinnyConfig:
    tile: int  # index into tile_shapes(fmt)
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
def tile_shapes(fmt: str = DENSE) -> tuple[tuple[int, int, int], ...]:
    """(row tiles per block, 32-element chunks per warp group, largest M) of each compiled tile of
    `fmt`, by id. The FP8 loader's chunks are 64 elements and the 4-bit loaders' 128: counted here
    as 2 x 32 and 4 x 32, so candidate and split rules are the same for every format."""
    ext = compiled()
    if ext is None or not ext.has_cuda:
        return ()
    if fmt == FP8_FORMAT:
        return tuple((rt, 2 * u, max_m) for rt, u, max_m in ext.skinny_gemm_configs(fp8=True))
    if fmt in ("int4", "mxfp4"):  # the 4-bit loaders' own tile table (ops/gemm/w4.py launches them)
        if not hasattr(ext, "skinny_gemm_w4"):
            return ()
        return tuple((rt, 4 * u, max_m) for rt, u, max_m in ext.skinny_gemm_w4_configs())
    return tuple(tuple(t) for t in ext.skinny_gemm_configs())


def num_tiles(n_out: int, silu: bool, tile: int, fmt: str = DENSE) -> int:
    """Blocks per K split: a block covers 16 W rows per row tile, 8 (gate, up) row pairs in SiLU mode."""
    rows = tile_shapes(fmt)[tile][0] * (8 if silu else 16)
    return -(-n_out // rows)


def default_config(m: int, n_out: int, k: int, silu: bool, num_sms: int, fmt: str = DENSE) -> SkinnyConfig:
    """A config for shapes no measured table covers (direct calls to the op): tile 1 (RT 1,
    U 4) or, past its M, tile 0; 4 warps; enough K splits for ~2 blocks per SM, keeping
    every warp at least 2 groups of K. The dispatch never uses this: it measures."""
    shapes = tile_shapes(fmt)
    tile = 1 if m <= shapes[1][2] else 0
    warps = 4
    splits = split_count(num_tiles(n_out, silu, tile, fmt), k, shapes[tile][1] * 32, warps, num_sms)
    return SkinnyConfig(tile, warps, splits)


def deterministic_fp8_tile(m: int, k: int, warps: int) -> int:
    """The FP8 tile of deterministic mode's skinny launch (warp_ranges with the FP8 loader as it is)
    for M rows and K in `warps` warp ranges. Every FP8 tile gives a row the same bits (a warp sums
    its share of K in 128-K spans in order, however many a group holds: kernels/batch_invariant_fp8.py),
    so this is speed alone, measured on Llama-3.1-8B's shapes (H200, RESULTS.md "twenty-first
    session"): up to 8 rows tile 2 (RT 1, four 64-element chunks a group) in blocks of 4 warps or
    fewer where each warp's share is whole groups of 256, else tile 0 (RT 1, two chunks); up to 16
    rows tile 0; above, tile 1 (RT 2, two chunks)."""
    share = -(-k // 128) * 128 // warps
    if m <= 8 and warps <= 4 and share % 256 == 0:
        return 2
    return 0 if m <= 16 else 1


def split_count(blocks: int, k: int, group: int, warps: int, num_sms: int, limit: int = MAX_SPLITS) -> int:
    """default_config's K splits: doubled while the launch has under ~2 blocks per SM, every warp
    keeps at least 2 groups of K, and the count stays <= limit."""
    splits = 1
    while splits * 2 <= limit and blocks * splits < 2 * num_sms and k // (splits * 2) >= warps * group * 2:
        splits *= 2
    return splits


def vector_aligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel's 16-byte loads need 16-byte aligned bases and row strides (K % 8 == 0 too)."""
    return (
        x.size(1) % 8 == 0
        and x.data_ptr() % 16 == 0
        and (x.size(0) == 1 or x.stride(0) % 8 == 0)
        and weight.data_ptr() % 16 == 0
        and (weight.size(0) == 1 or weight.stride(0) % 8 == 0)
    )


def fp8_fits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> bool:
    """The FP8 loader's layout needs: 16-bit x, K % 16 == 0, 16-byte aligned bases and W rows, x
    rows of a multiple of 8 elements, scales one row per weight row, per channel or per 128-K block."""
    n, k = weight.shape
    kb = scale.size(1)
    return (
        x.dtype in _KERNEL_DTYPES
        and k % 16 == 0
        and x.stride(1) == 1 and weight.stride(1) == 1 and scale.stride(1) == 1
        and x.data_ptr() % 16 == 0 and (x.size(0) == 1 or x.stride(0) % 8 == 0)
        and weight.data_ptr() % 16 == 0 and (n == 1 or weight.stride(0) % 16 == 0)
        and scale.size(0) == n and (n == 1 or scale.stride(0) >= 1)
        and (kb == 1 or (block_k == BLOCK and kb == -(-k // BLOCK)))
    )


def cublas_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool, out: torch.Tensor | None
) -> torch.Tensor:
    """The same op through torch (cuBLAS on CUDA), SiLU-and-mul as its own kernel. Without SiLU,
    cuBLAS writes `out` (row stride free, as a column slice of a wider output) in place: a fresh
    result copied into it cost a round trip of the output's bytes through HBM once a slice outgrew
    L2 (the 4-bit large-M path's LM-head slices)."""
    if out is not None and not silu:
        return torch.mm(x, weight.t(), out=out) if bias is None else torch.addmm(bias, x, weight.t(), out=out)
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


def split_buffers(device: torch.device, tiles: int, splits: int, row_tiles: int, x_tiles: int, op: str
                  ) -> tuple[torch.Tensor | None, tuple[int, int, int, int]]:
    """A launch's split-K buffers: (the fp32 workspace, kept alive by the caller until the launch is
    queued, and the launchers' (workspace, workspace_bytes, counters, num_counters) arguments). The
    workspace holds a float2 per (row tile, split, accumulator pair): row_tiles x x_tiles x 2 pairs of
    32 lanes a tile (csrc/skinny_launch.h launch_kernel's bound). One split: nothing, zeros."""
    if splits <= 1:
        return None, (0, 0, 0, 0)
    ctr = counters(device)
    if tiles > ctr.numel():
        raise ValueError(f"{op}: {tiles} row tiles exceed the {ctr.numel()} split-K counters")
    ws = torch.empty(2 * tiles * splits * row_tiles * x_tiles * 2 * 32, dtype=torch.float32, device=device)
    return ws, (ws.data_ptr(), ws.numel() * 4, ctr.data_ptr(), ctr.numel())


def _check(x, weight, scale, block_k, bias, silu, out) -> int:
    """Checks every argument of either op (scale None: a 16-bit weight); returns the output width."""
    check_tensor("x", x, dtype=_DTYPES, ndim=2)
    check_tensor("weight", weight, dtype=x.dtype if scale is None else FP8, ndim=2)
    n_w, k = weight.size(0), x.size(1)
    check_shape("weight", weight, (None, k))
    tensors = {"x": x, "weight": weight}
    if scale is not None:
        check_tensor("scale", scale, dtype=torch.float32, ndim=2)
        check_shape("scale", scale, (n_w, None))
        if scale.size(1) != 1 and (block_k != BLOCK or scale.size(1) != -(-k // BLOCK)):
            raise ValueError(f"scale must be [N, 1] or [N, ceil(K / 128)] with block_k 128, got "
                             f"{tuple(scale.shape)} with block_k {block_k}")
        tensors["scale"] = scale
    if x.size(0) > MAX_M:
        raise ValueError(f"x must have at most {MAX_M} rows (a skinny GEMM), got shape {tuple(x.shape)}")
    if silu and n_w % 2:
        raise ValueError(f"weight must have an even number of rows (gate | up) with silu, got {tuple(weight.shape)}")
    n_out = n_w // 2 if silu else n_w
    if bias is not None:
        check_tensor("bias", bias, dtype=x.dtype, ndim=1)
        check_shape("bias", bias, (n_w,))
        tensors["bias"] = bias
    if out is not None:
        check_tensor("out", out, dtype=x.dtype, ndim=2)
        check_shape("out", out, (x.size(0), n_out))
        tensors["out"] = out
    check_same_device(**tensors)
    for name, t in tensors.items():
        if name != "scale":
            check_inner_contiguous(name, t)
    return n_out


def check_config(cfg: SkinnyConfig, m: int, fmt: str = DENSE) -> None:
    shapes = tile_shapes(fmt)
    if not 0 <= cfg.tile < len(shapes):
        raise ValueError(f"config tile must be in 0..{len(shapes) - 1}, got {cfg.tile}")
    if m > shapes[cfg.tile][2]:
        raise ValueError(f"config tile {cfg.tile} takes at most {shapes[cfg.tile][2]} rows of x, got {m}")
    if not 1 <= cfg.warps <= MAX_WARPS:
        raise ValueError(f"config warps must be in 1..{MAX_WARPS}, got {cfg.warps}")
    if not 1 <= cfg.splits <= MAX_SPLITS:
        raise ValueError(f"config splits must be in 1..{MAX_SPLITS}, got {cfg.splits}")


def _run(x, weight, scale, bias, out, silu, config, n_out) -> torch.Tensor:
    """The checked ops' common tail: allocate, pick a default config, check it, launch."""
    fmt = DENSE if scale is None else FP8_FORMAT
    m, k = x.shape
    if out is None:
        out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if config is None:
        sms = _device.num_sms(x.device)
        config = default_config(m, n_out, k, silu, sms, fmt)
    check_config(config, m, fmt)
    launch(x, weight, bias, out, silu, config, scale=scale)
    return out


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

    n_out = _check(x, weight, None, 0, bias, silu, out)
    k = x.size(1)
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
    return _run(x, weight, None, bias, out, silu, config, n_out)


def skinny_gemm_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int, bias: torch.Tensor | None = None,
    *, silu: bool = False, out: torch.Tensor | None = None, config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= 32) @ dequantize(weight e4m3 [N, K], scale [N, KB], block_k)^T (+ bias)
    -> [M, N] in x's dtype (silu: silu(gate) * up [M, N / 2]). On the CPU the fp32 reference
    (ops.gemm.fp8.fp8_linear_reference); on CUDA our kernel with `config` (or a default), and a
    ValueError where the layout does not allow its 16-byte loads (no silent fallback here:
    the dispatch checks fp8_fits first)."""
    n_out = _check(x, weight, scale, block_k, bias, silu, out)
    if not use_cuda_kernel("skinny_gemm_fp8", x):
        y = fp8_linear_reference(x, weight, scale, block_k, bias, silu)
        return y if out is None else out.copy_(y)
    if not fp8_fits(x, weight, scale, block_k):
        raise ValueError(
            f"skinny_gemm_fp8: x {x.dtype} {tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)} "
            f"strides {weight.stride()}: the kernel needs 16-bit x, K % 16 == 0 and 16-byte aligned rows"
        )
    return _run(x, weight, scale, bias, out, silu, config, n_out)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    silu: bool,
    cfg: SkinnyConfig,
    pdl: bool = PDL,
    scale: torch.Tensor | None = None,
    warp_ranges: bool = False,
) -> None:
    """The launch alone, for callers that checked the arguments (the dispatch): a 16-bit weight,
    or with `scale` an FP8 one. The split-K workspace and counters are the same for both.
    warp_ranges (deterministic mode; one split; for 16-bit weights tile DETERMINISTIC_TILE, for FP8
    any tile): each warp sums a contiguous share of the block's K range, so a block of w warps gives
    the bits of the batch-invariant Triton GEMM in w splits (16-bit: kernels/batch_invariant_gemm.py,
    each k16 step contiguous K; FP8: batch_invariant_fp8.py, in the FP8 loader's steps). The share
    must be whole warp groups; the launch refuses it otherwise."""
    if warp_ranges and (cfg.splits != 1 or (scale is None and cfg.tile != DETERMINISTIC_TILE)):
        raise ValueError("skinny GEMM: warp_ranges takes one split (the warps are the splits)"
                         + (f" and tile {DETERMINISTIC_TILE}" if scale is None else "") + f", got {cfg}")
    fmt = DENSE if scale is None else FP8_FORMAT
    m, k = x.shape
    n_out = out.size(1)
    # A single row's stride is never used, and may be anything in a view: pass the packed one.
    x_stride = x.stride(0) if m > 1 else k
    w_stride = weight.stride(0) if weight.size(0) > 1 else k
    y_stride = out.stride(0) if m > 1 else n_out
    splits = cfg.splits
    tiles = num_tiles(n_out, silu, cfg.tile, fmt)
    if tiles > _NUM_COUNTERS:  # more row tiles than counters (N > 500k): no split needed there
        splits = 1
    ws, buffers = split_buffers(x.device, tiles, splits, tile_shapes(fmt)[cfg.tile][0], -(-m // 8), "skinny_gemm")
    split_args = (*buffers, m, n_out, k, x_stride, w_stride, y_stride, silu,
                  _KERNEL_DTYPES[x.dtype], cfg.tile, cfg.warps, splits, pdl, current_stream(x.device))
    b = 0 if bias is None else bias.data_ptr()
    if scale is None:
        compiled().skinny_gemm(x.data_ptr(), weight.data_ptr(), b, out.data_ptr(), *split_args, warp_ranges)
        return
    s_stride = scale.stride(0) if scale.size(0) > 1 else scale.size(1)
    compiled().skinny_gemm_fp8(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), s_stride, scale.size(1) > 1, b,
                               out.data_ptr(), *split_args, warp_ranges)
