"""Large-M 4-bit-weight GEMM (Triton): y[M, N] = x[M, K] W[N, K]^T (+ bias), W in one of the two
4-bit layouts of kernels/quant4.py, dequantised tile by tile in registers and fed to the 16-bit
tensor cores (fp32 accumulate); optional fused SiLU-and-mul over (gate | up) rows.

`dequant_tile` is the one 4-bit weight loader of the Triton kernels: this GEMM and the fused MoE
(kernels/fused_moe.py, W_FMT > 0) both call it, so a format is decoded in exactly one place.
It loads one 32-bit word per 8 columns and one scale (and zero) per row where the K tile lies in
one group, else per word where a word's columns share one (group % 8 == 0), else per column
(scale_span); any group size that divides K works and no tile has to align with a group.

FMT 1 = INT4: w = (q - zero) * scale per group (scales/zeros in x's dtype).
FMT 2 = MXFP4: w = e2m1(nibble) * 2 ** (e8m0 - 127), one scale per 32 columns.
(FMT 0 is the 16-bit weight of the callers that take both.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels import device as _device
from minisgl.kernels.quant4 import dequant_int4_reference, dequant_mxfp4_reference
from minisgl.kernels.tile_order import grouped_tile

INT4, MXFP4 = 1, 2
NAMES = {INT4: "int4", MXFP4: "mxfp4"}  # the format names ops/gemm uses


@triton.jit
def dequant_tile(W, S, Z, k0, offs_n, n_ok, K, stride_wn, stride_sn, group, FMT: tl.constexpr, OUT: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPAN: tl.constexpr):
    """Weight rows offs_n, columns k0 .. k0 + BLOCK_K (k0 and K multiples of 8) -> tile [BLOCK_K, BLOCK_N]
    in OUT, zero past K and where n_ok is off. One 32-bit load per 8 columns (an INT4 word; four
    MXFP4 bytes read as one little-endian word: byte i's low nibble is column 2i, its high 2i + 1);
    scales and zeros by scale_span's SPAN: one load per row (0: the tile's columns share a group,
    so it loads 1/16 of a 128-column tile's per-word scales and their addresses), per word (8) or
    per column (1). Loading per column cost 8x the load instructions (3x more with the
    scales and zeros): the decode kernel ran at a quarter of the HBM rate and this GEMM 5-11x slower
    (RESULTS.md, thirtieth session). The tile is built K-major ([BLOCK_K / 8, 8, BLOCK_N] reshaped):
    built N-major and transposed, the GEMM ran 16-19% slower and decode + cuBLAS 5-14% (same session)."""
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # word index along K
    n = offs_n[None, :].to(tl.int64)
    mask = (kw < K // 8)[:, None] & n_ok[None, :]  # [BLOCK_K / 8, BLOCK_N]
    p = tl.arange(0, 8)  # a column's place in its word
    if FMT == 1:
        word = tl.load(W + n * stride_wn + kw[:, None], mask=mask, other=0)
        shift = ((p >> 1) + 4 * (p & 1)) * 4  # quant4.NIBBLE_OF: column 2j in nibble j, 2j + 1 in j + 4
    else:
        word = tl.load(W.to(tl.pointer_type(tl.int32)) + n * (stride_wn // 4) + kw[:, None], mask=mask, other=0)
        shift = p * 4
    nib = (word[:, None, :] >> shift[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]
    if SPAN == 0:  # the tile's columns lie in one group: one scale (and zero) a row
        s_off = offs_n.to(tl.int64)[None, None, :] * stride_sn + k0 // group
        s_mask = n_ok[None, None, :]
    elif SPAN == 8:
        s_off = (n * stride_sn + (kw * 8 // group)[:, None])[:, None, :]
        s_mask = mask[:, None, :]
    else:
        s_off = n[:, None, :] * stride_sn + ((kw[:, None] * 8 + p[None, :]) // group)[:, :, None]
        s_mask = mask[:, None, :]
    if FMT == 1:
        s = tl.load(S + s_off, mask=s_mask, other=0.0).to(tl.float32)
        z = tl.load(Z + s_off, mask=s_mask, other=0.0).to(tl.float32)
        w = (nib.to(tl.float32) - z) * s
    else:
        # e2m1 placed in an fp16's sign, exponent and top mantissa bits is e2m1(nib) * 2^-14
        # exactly (e = 0, m = 1: the subnormal 2^-15), times 2^14 in fp16 e2m1(nib) exactly: no
        # table, branch or exp2 per element. The scale 2^(e8m0 - 127) is built as fp32 bits, the
        # exponent field (e8m0 0: the subnormal 2^-127; 255: +inf, as the reference's 2^128), exact
        # where exp2 is approximate and flushes 2^-127 to zero on the GPU (ex2.approx.ftz).
        h = (((nib & 8) << 12) | ((nib & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
        e8 = tl.load(S + s_off, mask=s_mask, other=127).to(tl.int32)
        sc = tl.where(e8 == 0, 0x00400000, e8 << 23).to(tl.float32, bitcast=True)
        w = (h * 16384.0).to(tl.float32) * sc
    return tl.reshape(w, (BLOCK_K, offs_n.shape[0])).to(OUT)


def scale_span(group: int, block_k: int) -> int:
    """dequant_tile's SPAN for a scale group and K tile: 0 where a tile's columns share a group
    (tiles start at multiples of BLOCK_K), else 8 where a word's do, else 1."""
    return 0 if group % block_k == 0 else 8 if group % 8 == 0 else 1


@triton.jit
def _w4_gemm_kernel(
    X, W, S, Z, Bias, Y, M, N, K, group,
    stride_xm, stride_wn, stride_sn, stride_ym,
    FMT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr, SPAN: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    out_ty = X.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = dequant_tile(W, S, Z, k0, offs_n, n_ok, K, stride_wn, stride_sn, group, FMT, out_ty, BLOCK_K, SPAN)
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        if GATED:  # the up rows sit N rows below the gate rows
            u = dequant_tile(W + N * stride_wn, S + N * stride_sn, Z + N * stride_sn, k0, offs_n, n_ok, K,
                             stride_wn, stride_sn, group, FMT, out_ty, BLOCK_K, SPAN)
            acc_up = tl.dot(a, u, acc_up, input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(Bias + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w4_dequant_kernel(W, S, Z, Out, N, K, group, stride_wn, stride_sn, stride_on, FMT: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr):
    """The weight rows of one [BLOCK_N, BLOCK_K] tile, decoded by dequant_tile, stored 16-bit."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    w = dequant_tile(W, S, Z, k0, offs_n, n_ok, K, stride_wn, stride_sn, group, FMT, Out.dtype.element_ty, BLOCK_K,
                     SPAN)
    # stored as [BLOCK_N, BLOCK_K] so consecutive lanes write consecutive columns of a row
    out = Out + offs_n.to(tl.int64)[:, None] * stride_on + offs_k[None, :]
    tl.store(out, tl.trans(w), mask=n_ok[:, None] & (offs_k < K)[None, :])


# (BLOCK_N, BLOCK_K, warps) of w4_dequant: the best of a sweep on an H200 (2.9-3.3 TB/s read + written, against
# 2.6-2.9 at (64, 128, 4); RESULTS.md thirtieth session)
DEQUANT_TILE = (16, 512, 4)


def w4_dequant(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, fmt: int,
               dtype: torch.dtype, out: torch.Tensor | None = None,
               tile: tuple[int, int, int] = DEQUANT_TILE) -> torch.Tensor:
    """The [N, K] weight of either layout in `dtype` (into `out`, rows K apart, when given),
    decoded on the device (the large-M path: ops/gemm/w4.py multiplies it with the 16-bit GEMM).
    The caller has checked the shapes."""
    n = w.shape[0]
    k = w.shape[1] * (8 if fmt == INT4 else 2)
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=w.device)
    if n == 0 or k == 0:
        return out
    group = k // scales.shape[1]  # MXFP4's scales are [N, K / 32]: 32
    bn, bk, warps = tile
    _w4_dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        w, scales, zeros if zeros is not None else scales, out, n, k, group, w.stride(0), scales.stride(0),
        out.stride(0), FMT=fmt, BLOCK_N=bn, BLOCK_K=bk, SPAN=scale_span(group, bk), num_warps=warps)
    return out


def _tile(m: int, dtype: torch.dtype = torch.bfloat16, smem: int = 0) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by M. fp32 (the exact "ieee" dots; tests):
    tiles whose pipelined shared memory fits an H100's 227 KiB (the 16-bit tiles asked for 344-632
    KiB in fp32 there). 16-bit, where a block may take `smem` >= 200 KB (Hopper): the best of a tile
    sweep on an H200 at 64, 256 and 2,048 rows (RESULTS.md, thirtieth session: 1.0-1.1x, 1.3-1.4x and
    1.8-1.9x faster than the tiles below there); elsewhere untuned tiles that fit ~100 KB. ops runs
    this GEMM only at M <= 32 where the skinny kernel's conditions fail (the benchmarks at every M)."""
    if dtype == torch.float32:
        return (16 if m <= 16 else 32), 32, 32, 4, 2
    if m <= 16:
        return 16, 64, 128, 4, 4
    if smem >= 200 * 1024:
        if m <= 64:
            return 64, 64, 128, 4, 3
        return (128, 128, 128, 8, 3) if m <= 256 else (256, 128, 128, 8, 2)
    if m <= 64:
        return 64, 64, 64, 4, 3
    return 128, 128, 64, 8, 3


def w4_gemm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, fmt: int,
            bias: torch.Tensor | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """x [M, K] (inner-contiguous), w / scales / zeros in the quant4 layout (contiguous rows),
    N_w rows -> y [M, N_w] or, gated, [M, N_w // 2]. The caller has checked the shapes."""
    m, k = x.shape
    n_w = scales.shape[0]
    n = n_w // 2 if silu_and_mul else n_w
    group = k // scales.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    smem = _device.shared_memory_per_block(x.device) if x.is_cuda else 0
    bm, bn, bk, warps, stages = _tile(m, x.dtype, smem)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _w4_gemm_kernel[grid](
        x, w, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        m, n, k, group, x.stride(0), w.stride(0), scales.stride(0), y.stride(0),
        FMT=fmt, GATED=silu_and_mul, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", SPAN=scale_span(group, bk),
        num_warps=warps, num_stages=stages,
    )
    return y


def dequant_reference(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, fmt: int) -> torch.Tensor:
    """fp32 [..., N, K] weight of either layout."""
    if fmt == INT4:
        return dequant_int4_reference(w, scales, zeros)
    return dequant_mxfp4_reference(w, scales)


def w4_gemm_reference(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      fmt: int, bias: torch.Tensor | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """Dequantise (fp32), matmul in fp32, epilogue in fp32, one rounding to x's dtype."""
    y = x.float() @ dequant_reference(w, scales, zeros, fmt).t()
    if bias is not None:
        y = y + bias.float()
    if silu_and_mul:
        n = y.shape[1] // 2
        y = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
    return y.to(x.dtype)
