"""KV-cache store: write new tokens' K and V rows into their cache slots."""

from __future__ import annotations

import torch

from minisgl.ops import _checks
from minisgl.ops._backend import compiled, current_stream, use_cuda_kernel
from minisgl.ops._checks import check_inner_contiguous, check_same_device, check_shape, check_tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = torch.float8_e4m3fn


def store_kv_reference(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    k_cache[slots.long()] = k
    v_cache[slots.long()] = v


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """K or V [T, H, D] -> e4m3 x / scale (saturated at +-448), packed."""
    return (x.float() / scale).clamp_(-448.0, 448.0).to(_FP8)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """k_cache, v_cache: [num_slots, kv_heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim]
    (row stride free, heads packed); slots: int32 [num_tokens], each in [0, num_slots).
    An FP8 e4m3 cache stores k / k_scale and v / v_scale (quantized first, then the same copy)."""
    if isinstance(k_cache, torch.Tensor) and k_cache.dtype == _FP8 and isinstance(k, torch.Tensor) and (
        k.dtype in _DTYPES
    ):
        k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    if _checks.enabled():
        check_store(k_cache, v_cache, k, v, slots)
    n, heads, dim = k.shape
    if not use_cuda_kernel("store_kv", k):
        store_kv_reference(k_cache, v_cache, k, v, slots)
        return
    esize = k.element_size()
    compiled().store_kv(
        k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(),
        n, heads * dim * esize, k_cache.stride(0) * esize, k.stride(0) * esize,
        v.stride(0) * esize, current_stream(k.device),
    )


def check_store(k_cache: object, v_cache: object, k: object, v: object, slots: object) -> None:
    """store_kv's arguments (and ops/rope.py's fused rope and store)."""
    check_tensor("k_cache", k_cache, dtype=(*_DTYPES, _FP8), ndim=3)
    check_tensor("v_cache", v_cache, dtype=k_cache.dtype, ndim=3)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_tensor("k", k, dtype=k_cache.dtype, ndim=3)
    check_shape("k", k, (None, k_cache.size(1), k_cache.size(2)))
    n, heads, dim = k.shape
    check_tensor("v", v, dtype=k_cache.dtype, ndim=3)
    check_shape("v", v, (n, heads, dim))
    check_tensor("slots", slots, dtype=torch.int32, ndim=1)
    check_shape("slots", slots, (n,))
    check_same_device(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slots=slots)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        check_inner_contiguous(name, t, inner_dims=2)
    if k_cache.stride(0) != v_cache.stride(0):
        raise ValueError("v_cache must have the same row stride as k_cache")
