"""4-bit weight GEMMs and 4-bit-expert MoE: the checks and the dispatch by device and M.

Weights are in kernels/quant4.py's layouts (the loaders repack every checkpoint format into
them once). GPU: M <= 32 the skinny CUDA template with the Int4W / Mxfp4W loader
(csrc/skinny_w4.cuh) at the launch the measured table chose (ops/gemm/tuning.py; the dispatch
passes it as `choice`: a config, or "cublas" for the large-batch path below; default_config's
launch where the table has no entry, e.g. direct calls), or where its conditions fail (logged
once) the Triton GEMM of kernels/w4a16_gemm.py; from DEQUANT_MIN_M (33) rows the
weight decoded to 16 bits on the device (kernels/w4a16_gemm.py w4_dequant, in slices of output
columns of at most DEQUANT_BYTES) and the 16-bit GEMM (cuBLAS): the Triton GEMM ran 1.4-3.9x slower than that at
64-256 rows (faster only for the widest N at 64) and 2.2-2.8x at 2,048 (RESULTS.md, thirtieth
session, H200; 4-7x and 28-32x before its loader read a word per 8 columns), while decoding
costs one 16-bit write and read of the weight (vLLM runs AWQ the same way from 256 tokens).
4-bit MoE experts: a decode step's few tokens (ops/gemm/skinny_moe.py fits) on the skinny
template's MoE kernel with the same loaders, tens of tokens (ops/gemm/grouped_moe.py fits) on its
grouped form (an expert read once per aligned block), else the Triton fused MoE with the loader in
its loop. CPU: dequantise to fp32 through the reference and matmul in fp32 (the path the model tests
hold to transformers).
"""

from __future__ import annotations

import torch

from minisgl.kernels import device as _device
from minisgl.kernels import fused_moe as _moe
from minisgl.kernels import moe_align as _align
from minisgl.kernels import w4a16_gemm as _w4
from minisgl.kernels.fused_moe_config import get_config, weights_key
from minisgl.logging_setup import log_once
from minisgl.ops._backend import compiled, current_stream, log_cpu_reference_once, use_cuda_kernel, use_triton
from minisgl.ops._checks import check_contiguous, check_inner_contiguous, check_same_device, check_shape, check_tensor
from minisgl.ops.gemm import grouped_moe as _grouped_moe
from minisgl.ops.gemm import skinny as _sk
from minisgl.ops.gemm import skinny_moe as _skinny_moe
from minisgl.ops.gemm.table import CUBLAS
from minisgl.ops.moe import check_expert_biases, check_shared, check_topk

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FORMATS = {name: fmt for fmt, name in _w4.NAMES.items()}
SKINNY_MAX_M = 32
# Past the skinny kernel: benchmarks/kernels/w4_gemm.py's large-M table (RESULTS.md, thirtieth
# session, H200) has decode + cuBLAS faster than the Triton GEMM at most shapes from 64 rows
# (1.4-3.9x; the Triton GEMM wins only the widest N at 64 rows: 28,672 and 128,256) and 2.2-2.8x at
# 2,048 (vLLM switches AWQ at 256). The Triton GEMM remains for M <= 32 where the skinny kernel's
# conditions fail.
DEQUANT_MIN_M = SKINNY_MAX_M + 1
# The transient 16-bit weight of one slice of output columns: a byte budget, not a row count. At
# 4,096 rows a slice, Llama-3.1-8B's gate_up at 2,048 tokens ran 7 decodes and 7 cuBLAS calls of
# N = 4,096 (1.37x one bf16 cuBLAS call of N = 28,672; RESULTS.md, thirtieth session, H200). 256 MiB
# is one slice for each of an 8B model's layers at K = 4,096 but the LM head (4 slices), and bounds a
# 70B model's gate_up (K = 8,192; 940 MB in 16 bits) to 4 slices. The gated path's pre-activation
# rows follow the slice: at most the 16-bit model's own.
DEQUANT_BYTES = 256 << 20


def _check_x(x: object) -> None:
    check_tensor("x", x, dtype=_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (its last is K)")
    check_inner_contiguous("x", x)


def _check_weight(fmt: int, w: object, scales: object, zeros: object, k: int, dtype: torch.dtype,
                  lead: tuple[int, ...] = ()) -> tuple[int, int]:
    """The layout's tensors for K = k -> (rows N, group). `lead` is the expert dimension."""
    nd = len(lead) + 2
    if fmt == _w4.INT4:
        check_tensor("qweight", w, dtype=torch.int32, ndim=nd)
        if k % 8:
            raise ValueError(f"INT4 weights need K divisible by 8 (8 nibbles per int32), got K = {k}")
        n = w.shape[-2]
        check_shape("qweight", w, (*lead, n, k // 8))
        check_tensor("scales", scales, dtype=dtype, ndim=nd)
        groups = scales.shape[-1]
        if groups < 1 or k % groups:
            raise ValueError(f"scales' last dimension ({groups}) must divide K = {k} (K // group scale columns)")
        check_shape("scales", scales, (*lead, n, groups))
        check_tensor("zeros", zeros, dtype=dtype, ndim=nd)
        check_shape("zeros", zeros, (*lead, n, groups))
        check_contiguous("zeros", zeros)
        names = ("qweight", "scales")
    else:
        check_tensor("blocks", w, dtype=torch.uint8, ndim=nd)
        if k % 32:
            raise ValueError(f"MXFP4 weights need K divisible by 32 (one e8m0 scale per 32), got K = {k}")
        n = w.shape[-2]
        check_shape("blocks", w, (*lead, n, k // 2))
        if w.data_ptr() % 4:  # the Triton loader reads the bytes as 32-bit words
            raise ValueError(f"MXFP4 blocks must start at a 4-byte-aligned address (a view at byte offset "
                             f"{w.data_ptr() % 4} past one was given): pass blocks.clone()")
        check_tensor("scales", scales, dtype=torch.uint8, ndim=nd)
        check_shape("scales", scales, (*lead, n, k // 32))
        groups = k // 32
        names = ("blocks", "scales")
    check_contiguous(names[0], w)
    check_contiguous(names[1], scales)
    return n, k // groups


def _linear(fmt: int, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            bias: torch.Tensor | None, silu_and_mul: bool, choice: _sk.SkinnyConfig | str | None = None,
            ) -> torch.Tensor:
    _check_x(x)
    k = x.shape[-1]
    n, _ = _check_weight(fmt, w, scales, zeros, k, x.dtype if fmt == _w4.INT4 else torch.uint8)
    if silu_and_mul and n % 2:
        raise ValueError(f"silu_and_mul needs (gate | up) rows: an even N, got {n}")
    if bias is not None:
        check_tensor("bias", bias, dtype=x.dtype, ndim=1)
        check_shape("bias", bias, (n,))
        check_contiguous("bias", bias)
    check_same_device(x=x, weight=w, scales=scales, **({} if zeros is None else {"zeros": zeros}),
                      **({} if bias is None else {"bias": bias}))
    x2 = x.reshape(-1, k)
    large = choice == CUBLAS  # the table measured the large-batch path faster at this M
    if x2.shape[0] <= SKINNY_MAX_M and not large and _skinny_fits(x2, w, scales, fmt):
        y = skinny_linear(fmt, x2, w, scales, zeros, bias, silu_and_mul,
                          config=choice if isinstance(choice, _sk.SkinnyConfig) else None)
    elif use_triton("w4_linear", x) and (x2.shape[0] >= DEQUANT_MIN_M or large):
        y = dequant_linear(fmt, x2, w, scales, zeros, bias, silu_and_mul)
    elif use_triton("w4_linear", x):
        y = _w4.w4_gemm(x2, w, scales, zeros, fmt, bias, silu_and_mul)
    else:
        log_cpu_reference_once("w4_linear")
        y = _w4.w4_gemm_reference(x2, w, scales, zeros, fmt, bias, silu_and_mul)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def dequant_slices(n: int, row_bytes: int) -> range:
    """The first output column of each slice; every slice but the last holds range.step columns:
    as few equal slices as keep row_bytes * columns within about DEQUANT_BYTES (rounded up to a
    multiple of 8 columns, 16-byte aligned column offsets into the 16-bit output, so up to 8 rows'
    bytes over; a slice is 8 columns at least)."""
    count = max(1, -(-n * row_bytes // DEQUANT_BYTES))
    step = -(-n // count)
    return range(0, n, max(8, -(-step // 8) * 8))


def dequant_linear(fmt: int, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """Large M: output columns a slice at a time (dequant_slices; gated: their gate and up rows,
    decoded into one (gate | up) weight), the weight rows decoded to x's dtype and multiplied by
    the 16-bit large-batch GEMM (ops/gemm/skinny.py cublas_linear, SiLU-and-mul included)."""
    n = scales.shape[0] // 2 if silu else scales.shape[0]
    starts = dequant_slices(n, (2 if silu else 1) * x.shape[1] * x.element_size())
    out = None if len(starts) == 1 else torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for r0 in starts:
        r1 = min(n, r0 + starts.step)
        rows = [slice(r0, r1)] + ([slice(n + r0, n + r1)] if silu else [])
        w16 = torch.empty(len(rows) * (r1 - r0), x.shape[1], dtype=x.dtype, device=x.device)
        for i, r in enumerate(rows):
            _w4.w4_dequant(w[r], scales[r], None if zeros is None else zeros[r], fmt, x.dtype,
                           out=w16[i * (r1 - r0) : (i + 1) * (r1 - r0)])
        b = None if bias is None else torch.cat([bias[r] for r in rows])
        y = _sk.cublas_linear(x, w16, b, silu, None if out is None else out[:, r0:r1])
    return y if out is None else out


def skinny_w4_shapes() -> tuple[tuple[int, int, int], ...]:
    """The compiled 4-bit skinny tiles (both 4-bit formats share them): ops/gemm/skinny.tile_shapes."""
    return _sk.tile_shapes("int4")


def skinny_misfit(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, fmt: int) -> str | None:
    """Why the 4-bit skinny kernel's layout needs do not hold for these tensors, or None (also
    the tuner's test of a layer's weight, with a stand-in x)."""
    k = x.shape[1]
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"{x.dtype} activations (the kernel takes fp16/bf16)"
    if k % 32 or (fmt == _w4.INT4 and (k // scales.shape[1]) % 32):
        return f"K = {k}, group {k // scales.shape[1]} (the kernel needs multiples of 32)"
    if x.data_ptr() % 16 or (x.shape[0] > 1 and x.stride(0) % 8) or w.data_ptr() % 16:
        return "x / the weight not 16-byte aligned"
    # The kernel's 32-bit offsets (csrc/skinny_launch.h w4_args_ok and the launcher's x bound)
    if k > 1 << 22:
        return f"K = {k} (the kernel's group index is exact up to 2^22)"
    if scales.shape[0] * max(w.stride(0), 1) >= 1 << 31 or scales.shape[0] * scales.stride(0) >= 1 << 31:
        return f"a weight of {scales.shape[0]} rows too large for the kernel's 32-bit row offsets"
    if x.shape[0] * x.stride(0) >= 1 << 31:
        return f"x row stride {x.stride(0)} too large for the kernel's 32-bit offsets"
    return None


def _skinny_fits(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, fmt: int) -> bool:
    if x.shape[0] == 0 or not use_cuda_kernel("w4_linear", x):
        return False
    if not skinny_w4_shapes():
        why = "minisgl._C has no 4-bit skinny kernel (rebuild the extension)"
    else:
        why = skinny_misfit(x, w, scales, fmt)
    if why is not None:
        log_once(f"w4-skinny:{why}", f"4-bit linear at M <= {SKINNY_MAX_M}: {why}; the Triton GEMM instead")
        return False
    return True


def skinny_linear(fmt: int, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  bias: torch.Tensor | None, silu: bool, config: _sk.SkinnyConfig | None = None) -> torch.Tensor:
    """The skinny CUDA template's 4-bit launch (split-K workspace and counters as ops.skinny_gemm's),
    x 2-D with at most SKINNY_MAX_M rows (the caller checked _skinny_fits); `config` (tile index
    into skinny_w4_shapes(), warps, splits) overrides default_config: the benchmark's sweep."""
    m, k = x.shape
    n_w = scales.shape[0]
    n_out = n_w // 2 if silu else n_w
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    shapes = skinny_w4_shapes()
    name = _w4.NAMES[fmt]
    sms = _device.num_sms(x.device)
    cfg = _sk.default_config(m, n_out, k, silu, sms, name) if config is None else config
    if config is not None:
        _sk.check_config(config, m, name)
    splits = cfg.splits
    tiles = _sk.num_tiles(n_out, silu, cfg.tile, name)
    if tiles > _sk._NUM_COUNTERS:  # as ops.skinny_gemm: no split past the counters
        splits = 1
    ws, buffers = _sk.split_buffers(x.device, tiles, splits, shapes[cfg.tile][0], -(-m // 8), "skinny_gemm_w4")
    # fmt: off
    compiled().skinny_gemm_w4(
        x.data_ptr(), w.data_ptr(), scales.data_ptr(), 0 if zeros is None else zeros.data_ptr(), scales.stride(0),
        k // scales.shape[1], fmt, 0 if bias is None else bias.data_ptr(),
        out.data_ptr(), *buffers, m, n_out, k,
        x.stride(0) if m > 1 else k, w.stride(0), out.stride(0) if m > 1 else n_out, silu,
        _sk._KERNEL_DTYPES[x.dtype], cfg.tile, cfg.warps, splits, _sk.PDL, current_stream(x.device),
    )
    # fmt: on
    return out


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: torch.Tensor | None = None, silu_and_mul: bool = False,
                choice: _sk.SkinnyConfig | str | None = None) -> torch.Tensor:
    """x [..., K] @ W^T with W in the INT4 layout (qweight int32 [N, K/8], scales / zeros [N, K/group]
    in x's dtype) (+ bias [N]); silu_and_mul: W is (gate | up), y [..., N/2] = silu(gate) * up.
    `choice`: the dispatch table's entry for this call (module docstring)."""
    return _linear(_w4.INT4, x, qweight, scales, zeros, bias, silu_and_mul, choice)


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 silu_and_mul: bool = False, choice: _sk.SkinnyConfig | str | None = None) -> torch.Tensor:
    """x [..., K] @ W^T with W in the MXFP4 layout (blocks uint8 [N, K/2], e8m0 scales uint8 [N, K/32])."""
    return _linear(_w4.MXFP4, x, blocks, scales, None, bias, silu_and_mul, choice)


def fused_moe_w4(
    x: torch.Tensor, fmt: str, w13: torch.Tensor, w13_scales: torch.Tensor, w13_zeros: torch.Tensor | None,
    w2: torch.Tensor, w2_scales: torch.Tensor, w2_zeros: torch.Tensor | None,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, act: _moe.ExpertAct | None = None,
) -> torch.Tensor:
    """ops.fused_experts with 4-bit experts: fmt "int4" (w13 int32 [E, 2I, H/8], scales / zeros
    [E, 2I, H/group]; w2 [E, H, I/8], [E, H, I/group]) or "mxfp4" (w13 uint8 [E, 2I, H/2], scales
    [E, 2I, H/32]; zeros None). Same routing arguments and result as ops.fused_experts; b13
    [E, 2I], b2 [E, H] and act as ops.fused_moe's (GPT-OSS)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
    f = FORMATS[fmt]
    check_tensor("x", x, dtype=_DTYPES, ndim=2)
    check_inner_contiguous("x", x)
    sdt = x.dtype if f == _w4.INT4 else torch.uint8
    if f == _w4.MXFP4 and (w13_zeros is not None or w2_zeros is not None):
        raise ValueError("MXFP4 experts have no zero points: pass w13_zeros = w2_zeros = None")
    e = w13.shape[0] if isinstance(w13, torch.Tensor) and w13.dim() == 3 else 0
    two_i, _ = _check_weight(f, w13, w13_scales, w13_zeros, x.shape[1], sdt, (e,))
    if two_i % 2:
        raise ValueError(f"w13 must have (gate | up) rows: an even 2I, got {two_i}")
    h, _ = _check_weight(f, w2, w2_scales, w2_zeros, two_i // 2, sdt, (e,))
    if h != x.shape[1]:
        raise ValueError(f"w2 must have H = {x.shape[1]} rows (x's width), got {h}")
    check_topk(x, topk_weights, topk_ids)
    check_shared(x, shared, shared_gate)
    check_expert_biases(w13, x.dtype, (e, two_i), (e, h), b13, b2, act)
    # zeros too: the kernels read every pointer they are given on the device
    check_same_device(x=x, w13=w13, w13_scales=w13_scales, w2=w2, w2_scales=w2_scales,
                      **({} if w13_zeros is None else {"w13_zeros": w13_zeros}),
                      **({} if w2_zeros is None else {"w2_zeros": w2_zeros}))
    if not use_triton("fused_moe_w4", x):
        log_cpu_reference_once("fused_moe_w4")
        w13_d = _w4.dequant_reference(w13, w13_scales, w13_zeros, f).to(x.dtype)
        w2_d = _w4.dequant_reference(w2, w2_scales, w2_zeros, f).to(x.dtype)
        return _moe.fused_experts_reference(x, w13_d, w2_d, topk_weights, topk_ids, shared, shared_gate, b13, b2, act)
    top_k = topk_ids.shape[1]
    quant = _skinny_moe.Quant4(f, w13_scales, w13_zeros, w2_scales, w2_zeros)
    if _skinny_moe.fits(x, w13, w2, top_k, shared, quant):  # a decode step's few tokens
        return _skinny_moe.experts(x, w13, w2, topk_weights, topk_ids, b13, b2, act, quant=quant, shared=shared,
                                   shared_gate=shared_gate)
    if _grouped_moe.fits(x, w13, w2, top_k, shared, quant):  # tens of tokens: one read per expert block
        return _grouped_moe.experts(x, w13, w2, topk_weights, topk_ids, quant, b13, b2, act, shared=shared,
                                    shared_gate=shared_gate)
    # 4-bit experts have their own tuned entries (the 16-bit experts' deepest pipelines overflow
    # shared memory with the dequantisation in the loop: Qwen3-30B-A3B's asked 288 KB of an
    # H100's 227 KB); untuned, the default tiles (<= ~100 KB).
    cfg = get_config(e, top_k, two_i // 2, h, x.shape[0], x.dtype, _device.name(x.device),
                     weights=weights_key(fmt, x.shape[1] // w13_scales.shape[2]))
    sorted_ids, expert_ids = _align.align(topk_ids, e, cfg.block_m)
    inter = _moe.up_gemm(x, w13, sorted_ids, expert_ids, top_k, cfg.block_m, cfg.up,
                         _moe.W4(w13_scales, w13_zeros, f), b13, act)
    y = _moe.down_gemm(inter, w2, topk_weights, sorted_ids, expert_ids, cfg.block_m, cfg.down,
                       _moe.W4(w2_scales, w2_zeros, f), b2)
    return _moe.moe_sum(y, top_k, shared, shared_gate)
