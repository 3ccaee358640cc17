"""Rotary embedding (neox style, in place): Triton where it can run, else the torch reference."""

from __future__ import annotations

import torch

from minisgl.kernels import rope as _k
from minisgl.ops import _checks
from minisgl.ops._backend import log_cpu_reference_once, use_triton
from minisgl.ops._checks import check_contiguous, check_inner_contiguous, check_same_device, check_shape, check_tensor
from minisgl.ops.store import check_store, store_kv

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    check_tensor("q", q, dtype=_DTYPES, ndim=3)
    check_tensor("k", k, dtype=q.dtype, ndim=3)
    check_shape("k", k, (q.shape[0], None, q.shape[2]))
    check_tensor("positions", positions, dtype=torch.int64, ndim=1)
    check_shape("positions", positions, (q.shape[0],))
    check_contiguous("positions", positions)  # the kernel reads positions[t] at offset t
    check_tensor("cos_sin_cache", cos_sin_cache, dtype=torch.float32, ndim=2)
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > q.shape[2] or rot == 0:
        raise ValueError(f"cos_sin_cache width must be even and in [2, head_dim={q.shape[2]}], got {rot}")
    check_same_device(q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_inner_contiguous(name, t)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (each head's last dim packed; row and
    head strides free, e.g. views of a fused qkv output). positions: int64 [T], each in
    [0, max_pos); cos_sin_cache: fp32 [max_pos, R], R even and <= D (cos | sin halves)."""
    if _checks.enabled():
        _check(q, k, positions, cos_sin_cache)
    if use_triton("apply_rope", q):
        _k.apply_rope(q, k, positions, cos_sin_cache)
        return
    log_cpu_reference_once("apply_rope")
    _k.apply_rope_reference(q, k, positions, cos_sin_cache)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> None:
    """Qwen3's attention input: RMSNorm of every q and k head (weights [D], q's dtype or fp32),
    then RoPE, in place; arguments as `apply_rope`, but the rotation must cover the whole head
    (cos_sin_cache [max_pos, D])."""
    if _checks.enabled():
        _check(q, k, positions, cos_sin_cache)
        if cos_sin_cache.shape[1] != q.shape[2]:
            raise ValueError(
                f"qk_norm_rope needs full rotary: cos_sin_cache width {cos_sin_cache.shape[1]} != head_dim"
            )
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            check_tensor(name, w, dtype=(q.dtype, torch.float32), ndim=1)
            check_shape(name, w, (q.shape[2],))
            check_inner_contiguous(name, w)
        check_same_device(q=q, q_weight=q_weight, k_weight=k_weight)
    if use_triton("qk_norm_rope", q):
        _k.qk_norm_rope(q, k, positions, cos_sin_cache, q_weight, k_weight, float(eps))
        return
    log_cpu_reference_once("qk_norm_rope")
    _k.qk_norm_rope_reference(q, k, positions, cos_sin_cache, q_weight, k_weight, eps)


def apply_rope_and_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """apply_rope(q, k, ...) then store_kv(k_cache, v_cache, k, v, slots, k_scale, v_scale) (arguments
    as theirs). A 16-bit cache of k's dtype under full rotary (R = D) takes one Triton kernel for
    both; anything else (FP8 caches, partial rotary, no Triton) the two ops."""
    fused = (k_cache.dtype == k.dtype and k.dtype in (torch.float16, torch.bfloat16) and k.dim() == 3
             and cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == k.shape[2] and use_triton("apply_rope", q))
    if not fused:  # each op checks its own arguments
        apply_rope(q, k, positions, cos_sin_cache)
        store_kv(k_cache, v_cache, k, v, slots, k_scale, v_scale)
        return
    if _checks.enabled():
        _check(q, k, positions, cos_sin_cache)
        check_store(k_cache, v_cache, k, v, slots)
    _k.apply_rope_and_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slots)
