"""Deterministic mode's FP8 GEMM above the skinny kernel's rows (Triton): y = x dequant(W)^T (+ bias)
with W e4m3 [N, K] and fp32 scales [N, KB] (ops/gemm/fp8.py's layout: per channel, KB = 1, or per
row and 128-K block), x 16-bit and not quantized (W8A16). Reference: ops/gemm/reference.py
fp8_linear_reference.

Up to 32 rows deterministic mode runs the skinny CUDA kernel's FP8 loader (csrc/skinny_weights.cuh
Fp8W) with warp ranges; this kernel sums in that loader's order, so that a row's bits are the same
at every M (issue 39) while batch 1 keeps the skinny kernel's speed:
- K is cut into splits_for(K) splits (kernels/batch_invariant_gemm.py; the skinny block's warps),
  each a chain from zero; the splits are added in order to a zero total.
- A split is 128-K spans in order. A span's dot starts from zero (8 tensor-core k16 steps) and joins
  the split's chain as fma(span, the span's block scale, chain); per-channel weights with a scale of 1
  (their scale comes at the end).
- Inside a span, the loader's thread q of a quad loads 16 contiguous K elements of a 64-element
  chunk c and feeds its elements 4i..4i+3 to MMA i, so k16 step i of chunk c holds the products of
  K elements 64c + 16q + 4i + t (q, t in 0..3). This kernel loads K in that permuted order (`_span`),
  so its k16 steps hold the same products. A k16 step's result depends on which products it holds,
  not on their k slots (sm_90, mma.sync and wgmma: tests/test_deterministic_gpu.py), so the bits
  are the same in both kernels, and in any tile shape here (the launch picks tiles by M freely).
- The end: per channel fma(total, scale, bias or 0), with block scales total + (bias or 0); rounded
  once to x's dtype.
- e4m3 becomes bf16 exactly by moving bits, as the skinny loader does (csrc/fp8_convert.cuh;
  `_e4m3_to`): Triton's own conversion goes through fp16 and then one F2F.BF16.F16 an element (64 a
  thread a span); the bit moves are PRMT, LOP3 and HMUL2 (H200, 4096x4096: 40 -> 32 us at M 64, 7-17%
  above 512 rows). fp16 keeps Triton's, one instruction a pair, which was faster there (4096^3: 503
  against 570 us).
  Above a few hundred rows the time goes to the conversion's round trip, not its instructions: the
  same loop with bf16 weights (no conversion, the same spans, plain loads) takes 327 against 559 us
  at 4096^3; loading K in plain order would save 5-10%, chaining the spans' dots 11% (H200, a probe
  of this kernel with parts swapped out: RESULTS.md, twenty-second session). Each span's W goes from
  shared memory through registers back to shared memory, the wgmma waits for it, and the next span
  for the wgmma, so conversion and MMA never overlap.
Traffic: x once per N tile, W (1 byte an element) once per M tile, y once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.tile_order import clamped_tile

SPAN = 128  # one scale block; the skinny FP8 loader's warp group (two 64-element chunks)
GROUP_M = 8
INTERPRETER_TILES = (16, 16, 1, 1)  # (BLOCK_M, BLOCK_N, warps, stages): small, for the CPU interpreter


@triton.jit
def _span():
    """K offsets of one span in the skinny FP8 loader's k16 steps (the module docstring)."""
    p = tl.arange(0, 128)
    kp = (p // 64) * 64 + (p % 16) // 4 * 16 + (p % 64) // 16 * 4 + p % 4
    # Runs of 4 contiguous offsets from multiples of 4: said, so that the loads are vectors (the
    # compiler's analysis saw runs of 1: byte loads, not pipelined, 6.3x slower at M 4096, H200).
    return tl.max_contiguous(tl.multiple_of(kp, 4), 4)


# Four e4m3 bytes (element 0 lowest) -> two bf16 pairs, csrc/fp8_convert.cuh's e4m3x4_to_pairs: each
# byte spread to the top of a half ([b1 00 b0 00]), its 7 value bits moved down 4 onto bf16's
# exponent/mantissa boundary (value * 2^-120; e4m3 denormals stay exact as bf16 denormals), and one
# exact multiply by 2^120 (an FMA adding -0, so zeros keep their sign).
_E4M3_BF16 = tl.constexpr("""{
.reg .b32 h<2>, u, z;
mov.b32 u, 0x7B807B80;
mov.b32 z, 0x80008000;
prmt.b32 h0, $2, 0, 0x1404;
prmt.b32 h1, $2, 0, 0x3424;
and.b32 $0, h0, 0x7F007F00;
and.b32 $1, h1, 0x7F007F00;
shr.b32 $0, $0, 4;
shr.b32 $1, $1, 4;
and.b32 h0, h0, 0x80008000;
and.b32 h1, h1, 0x80008000;
or.b32 $0, $0, h0;
or.b32 $1, $1, h1;
fma.rn.bf16x2 $0, $0, u, z;
fma.rn.bf16x2 $1, $1, u, z;
}""")


@triton.jit
def _e4m3_to(w, DTYPE: tl.constexpr, BITS: tl.constexpr):
    """e4m3 `w` as DTYPE, exact for every finite value: bf16 by moving bits where BITS says so (the PTX
    above), else Triton's conversion (fp16, fp32, and the CPU interpreter, which runs no PTX)."""
    if BITS:
        return tl.inline_asm_elementwise(_E4M3_BF16, "=r,=r,r", [w.to(tl.uint8, bitcast=True)],
                                         dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        return w.to(DTYPE)


@triton.jit
def _fp8_kernel(X, W, S, Bias, Y, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym, SPANS_PER_SPLIT,
                BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, DOT_PREC: tl.constexpr,
                BITS_CONVERT: tl.constexpr):
    offs_m, offs_n, rows, cols = clamped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP)
    kp = _span()
    x_base = X + rows[:, None] * stride_xm + kp[None, :]
    w_base = W + cols[None, :] * stride_wn + kp[:, None]
    s_row = S + cols * stride_sn
    one = tl.full([BLOCK_N], 1.0, tl.float32)
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    chain = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(0, tl.cdiv(K, 128)):
        k0 = i * 128
        if EVEN_K:
            x = tl.load(x_base + k0)
            w = tl.load(w_base + k0)
        else:  # the K tail reads zeros, as the skinny kernel's predicated-off loads do
            x = tl.load(x_base + k0, mask=(k0 + kp)[None, :] < K, other=0.0)
            w = tl.load(w_base + k0, mask=(k0 + kp)[:, None] < K, other=0.0)
        span = tl.dot(x, _e4m3_to(w, x.dtype, BITS_CONVERT), input_precision=DOT_PREC)
        # An FMA, never `chain += span`: Triton would fold that add into the dot's accumulator.
        s = tl.load(s_row + i) if BLOCK_SCALES else one
        chain = tl.fma(span, s[None, :], chain)
        if (i + 1) % SPANS_PER_SPLIT == 0:  # a split ends: its chain joins the total, the next starts at 0
            total += chain
            chain = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    b = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        b = tl.load(Bias + cols).to(tl.float32)
    if BLOCK_SCALES:
        y = total + b[None, :]
    else:
        y = tl.fma(total, tl.load(s_row)[None, :], b[None, :])
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty), mask=mask)


def splits_for(n: int, k: int) -> int:
    """The fixed K splits of an FP8 weight [N, K] in deterministic mode, for every M (the skinny block's
    warps up to 32 rows): the 16-bit rule (batch_invariant_gemm.splits_for), halved for weights of
    6,144 rows or more, whose launches have blocks enough to fill the GPU with 4-warp blocks (H200,
    Llama-3.1-8B at batch 1: qkv_proj 12.5 -> 8.9 us, gate_up 41.9 -> 35.9 us; o_proj and down_proj,
    4,096 rows, are fastest at 8)."""
    from minisgl.kernels.batch_invariant_gemm import splits_for as splits_16bit

    s = splits_16bit(k)
    return s // 2 if n >= 6144 and s > 1 else s


def tiles_for(m: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) by M: any tile gives the same bits (the module docstring)."""
    if device.type != "cuda":
        return INTERPRETER_TILES
    if dtype == torch.float32:  # ieee dots on FMA units
        return (32, 64, 4, 2)
    return (64, 64, 4, 4) if m <= 256 else (128, 128, 8, 3)


def bits_convert(x: torch.Tensor) -> bool:
    """Whether the kernel turns e4m3 into x's dtype by moving bits (PTX): bf16 x on a GPU."""
    return x.dtype == torch.bfloat16 and x.device.type == "cuda"


def gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, splits: int,
         bias: torch.Tensor | None = None, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (unit column stride; 16-bit, or fp32 in ieee dots) @ (weight e4m3 [N, K] * scale [N, 1 or
    ceil(K / 128)])^T (+ bias [N]) -> [M, N] in x's dtype, K in `splits` chains (the skinny block's warps)."""
    m, k = x.shape
    n = weight.shape[0]
    kb = scale.size(1)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"deterministic FP8 GEMM: x must be float16, bfloat16 or float32 and the weight e4m3, "
                         f"got {x.dtype} and {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or (kb > 1 and scale.stride(1) != 1) or scale.size(0) != n:
        raise ValueError(f"deterministic FP8 GEMM: x {tuple(x.shape)}, weight {tuple(weight.shape)} and scale "
                         f"{tuple(scale.shape)} must be packed in K with one scale row per weight row")
    if kb not in (1, -(-k // SPAN)):
        raise ValueError(f"deterministic FP8 GEMM: scale {tuple(scale.shape)} must hold 1 or ceil(K / {SPAN}) "
                         f"= {-(-k // SPAN)} columns")
    if splits < 1 or (splits > 1 and k % (splits * SPAN)):
        raise ValueError(f"deterministic FP8 GEMM: K {k} in {splits} splits needs K a multiple of {splits * SPAN}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    bm, bn, warps, stages = tiles or tiles_for(m, x.dtype, x.device)
    grid = (triton.cdiv(n, bn) * triton.cdiv(m, bm),)
    _fp8_kernel[grid](
        x, weight, scale, bias if bias is not None else y, y, m, n, k, x.stride(0), weight.stride(0),
        scale.stride(0), y.stride(0), triton.cdiv(k, SPAN) // splits, BLOCK_SCALES=kb > 1,
        HAS_BIAS=bias is not None, EVEN_K=k % SPAN == 0, BLOCK_M=bm, BLOCK_N=bn, GROUP=GROUP_M,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", BITS_CONVERT=bits_convert(x),
        num_warps=warps, num_stages=stages,
    )
    return y

