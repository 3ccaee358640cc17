"""Paged decode attention: one new query token per request over its whole cached context.

K/V are read only through the request table `req_to_slot[row, position] -> slot`, so the
page size is invisible here. On CUDA the flash-decoding kernel of csrc/decode_attention.cuh
runs (CUDA-graph safe: lengths are read on the device and the launch shape depends only on
the batch size, the head layout and the `max_seq_len` bound); elsewhere the fp32 torch
reference below. The cache is q's dtype, or FP8 e4m3 holding K / k_scale and V / v_scale
(per-tensor scales; the kernel dequantizes in registers).
"""

from __future__ import annotations

import functools

import torch

from minisgl.ops import _checks
from minisgl.ops._backend import compiled, current_stream, use_cuda_kernel
from minisgl.ops._checks import (
    check_contiguous,
    check_inner_contiguous,
    check_same_device,
    check_shape,
    check_tensor,
    check_window_sinks,
)

_KERNEL_DTYPES = {torch.float16: 0, torch.bfloat16: 1}
_FP8 = torch.float8_e4m3fn
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIMS = (16, 32, 64, 128, 256)


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_slot: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 math, one request at a time over its gathered K/V (the reference beside the
    Triton decode kernel); returns q's dtype [B, Hq, D]. A length-0 row (padding) gives zeros.
    K is k_cache * k_scale and V v_cache * v_scale (the scales of an FP8 cache)."""
    from minisgl.kernels.decode_attention import decode_attention_reference

    ref = decode_attention_reference(q, k_cache, v_cache, req_to_slot, req_rows, seq_lens.clamp(min=0),
                                     scale * k_scale, window=window, sinks=sinks)
    return (ref * v_scale).to(q.dtype)


@functools.lru_cache(maxsize=1024)
def _num_splits(
    device: int, batch: int, kv_heads: int, group: int, dim: int, dtype: int, max_len: int, kv_fp8: bool
) -> int:
    return compiled().paged_decode_num_splits(device, batch, kv_heads, group, dim, dtype, max_len, kv_fp8)


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_slot: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    check_tensor("q", q, dtype=_DTYPES, ndim=3)
    batch, num_heads, dim = q.shape
    check_tensor("k_cache", k_cache, dtype=(q.dtype, _FP8), ndim=3)
    check_shape("k_cache", k_cache, (None, None, dim))
    kv_heads = k_cache.size(1)
    if kv_heads == 0 or num_heads % kv_heads != 0 or not 1 <= num_heads // kv_heads <= 8:
        raise ValueError(f"q has {num_heads} heads and k_cache {kv_heads}: q heads must be 1..8 times the KV heads")
    check_tensor("v_cache", v_cache, dtype=k_cache.dtype, ndim=3)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_tensor("req_to_slot", req_to_slot, dtype=torch.int32, ndim=2)
    check_tensor("req_rows", req_rows, dtype=torch.int32, ndim=1)
    check_shape("req_rows", req_rows, (batch,))
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1)
    check_shape("seq_lens", seq_lens, (batch,))
    tensors = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        req_to_slot=req_to_slot,
        req_rows=req_rows,
        seq_lens=seq_lens,
    )
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, ndim=3)
        check_shape("out", out, tuple(q.shape))
        tensors["out"] = out
    check_same_device(**tensors)
    check_inner_contiguous("q", q, inner_dims=2)
    check_inner_contiguous("k_cache", k_cache, inner_dims=2)
    check_inner_contiguous("v_cache", v_cache, inner_dims=2)
    check_inner_contiguous("req_to_slot", req_to_slot, inner_dims=1)
    check_contiguous("req_rows", req_rows)
    check_contiguous("seq_lens", seq_lens)
    if out is not None:
        check_inner_contiguous("out", out, inner_dims=2)
    if k_cache.stride(0) != v_cache.stride(0):
        raise ValueError("v_cache must have the same slot stride as k_cache")


def _check_kernel_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    """The kernel reads and writes 16-byte vectors (8-byte ones of an FP8 cache): every base and
    row stride must allow it (a multiple of 8 elements either way)."""
    if q.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"q must have dtype float16 or bfloat16 on CUDA, got {str(q.dtype).removeprefix('torch.')}")
    if q.size(2) not in _HEAD_DIMS:
        raise ValueError(f"q must have head_dim in {_HEAD_DIMS} on CUDA, got {q.size(2)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.data_ptr() % 16 != 0 or (t.size(0) > 1 and t.stride(0) % 8 != 0):
            raise ValueError(
                f"{name} must start on a 16-byte boundary with a row stride that is a "
                f"multiple of 8 elements, got strides {t.stride()}"
            )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_slot: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (heads packed, batch stride free); k_cache, v_cache [S, Hkv, D];
    req_to_slot int32 [R, L]; req_rows, seq_lens int32 [B] (0 < seq_lens <= L, on the device);
    `max_seq_len` bounds seq_lens: it only picks the split count, so a captured CUDA graph
    should pass the same bound (e.g. the context length) on every replay.
    Returns out [B, Hq, D] in q's dtype (written into `out` if given). `num_splits`
    overrides the split policy (1..256; for tuning and tests). k_cache/v_cache may be FP8 e4m3
    holding K / k_scale and V / v_scale (scales positive and finite). `window` W > 0: only the
    last W keys are read (older slots may be freed); `sinks` fp32 [Hq] on the device: a raw
    logit per head joining every softmax denominator."""
    if _checks.enabled():
        _check(q, k_cache, v_cache, req_to_slot, req_rows, seq_lens, out)
        check_window_sinks(q, window, sinks)
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1 (a bound on seq_lens), got {max_seq_len}")
        for name, v in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not 0.0 < float(v) < float("inf"):
                raise ValueError(f"{name} must be positive and finite, got {v}")
    if not use_cuda_kernel("paged_decode_attention", q):
        ref = paged_decode_attention_reference(q, k_cache, v_cache, req_to_slot, req_rows, seq_lens, scale,
                                               k_scale, v_scale, window, sinks)
        if out is None:
            return ref
        out.copy_(ref)
        return out
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if _checks.enabled():
        _check_kernel_layout(q, k_cache, v_cache, out)
    batch, num_heads, dim = q.shape
    kv_heads = k_cache.size(1)
    group = num_heads // kv_heads
    if batch == 0:
        return out
    dtype = _KERNEL_DTYPES[q.dtype]
    kv_fp8 = k_cache.dtype == _FP8
    if num_splits is None:
        # A sliding layer's splits cover its last W keys only: size them by the window.
        bound = min(int(max_seq_len), window) if window else int(max_seq_len)
        splits = _num_splits(q.device.index or 0, batch, kv_heads, group, dim, dtype, bound, kv_fp8)
    elif not 1 <= num_splits <= 256:
        raise ValueError(f"num_splits must be in 1..256, got {num_splits}")
    else:
        splits = num_splits
    part_o = part_lse = None
    if splits > 1:
        # fp32 scratch for the per-split partials: B * Hq * splits * (D + 1) * 4 bytes.
        part_o = torch.empty((batch, num_heads, splits, dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    # fmt: off
    compiled().paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), req_to_slot.data_ptr(),
        req_rows.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
        0 if part_o is None else part_o.data_ptr(), 0 if part_lse is None else part_lse.data_ptr(),
        batch, kv_heads, group, dim, dtype, q.stride(0), out.stride(0), k_cache.stride(0),
        req_to_slot.stride(0), req_to_slot.size(1), splits, float(scale), q.device.index or 0,
        current_stream(q.device), kv_fp8, float(k_scale), float(v_scale), int(window),
        0 if sinks is None else sinks.data_ptr(),
    )
    # fmt: on
    return out
