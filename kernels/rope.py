"""Rotary position embedding, neox style, applied in place to q and k (Triton + reference).

The cos/sin table `[max_pos, R]` (fp32; first R/2 columns cos, last R/2 sin) is built by the
layer (minisgl/layers/rotary.py, llama3 scaling included); R <= head_dim and only the first R
dims of each head rotate. For i < R/2: x1 = x[i], x2 = x[i + R/2];
    x[i] = x1*cos - x2*sin,   x[i + R/2] = x2*cos + x1*sin      (fp32 math, one rounding).

One program rotates every q and k head of one token: the token's cos/sin row is read once.
`apply_rope_and_store` also writes the rotated k and v into the KV cache (the store kernel's job:
a decode step's layer saves a launch).
Traffic per token: read + write of (Hq + Hkv) * R elements, plus one R-float table row.
`qk_norm_rope` is the same kernel with Qwen3's per-head RMSNorm of q and k first (QK_NORM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import dependent_launch, gdc_launch_dependents, gdc_wait, pdl_launch


@triton.jit
def _rotate_heads(Base, stride_h, n_heads, W, eps, cos, sin, offs_d, mask_d, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, QK_NORM: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < n_heads)[:, None] & mask_d[None, :]
    p1 = Base + offs_h[:, None] * stride_h + offs_d[None, :]
    dt = Base.dtype.element_ty
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        # RMSNorm over each whole head (both halves; full rotary), rounded as ops.rmsnorm rounds.
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(W + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * rstd[:, None]).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * rstd[:, None]).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(dt)
    y2 = (x2 * cos + x1 * sin).to(dt)
    tl.store(p1, y1, mask=mask)
    tl.store(p1 + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _rope_kernel(
    Q, K, Pos, Cache, WQ, WK, stride_qt, stride_qh, stride_kt, stride_kh, stride_c, HQ, HKV, eps,
    V, KC, VC, Slots, stride_vt, stride_vh, stride_kvc,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    QK_NORM: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        # The paged decode attention after this kernel (launched with programmatic dependent launch)
        # may start now and read the request's table; it waits for this grid before it reads q or K/V.
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    cos = tl.load(Cache + pos * stride_c + offs_d, mask=mask_d, other=0.0)[None, :]
    sin = tl.load(Cache + pos * stride_c + HALF + offs_d, mask=mask_d, other=0.0)[None, :]
    if STORE:
        slot = tl.load(Slots + t).to(tl.int64)
    if PDL:
        # Launched with PDL after the QKV GEMM: the positions, the cos/sin table and the slots (the
        # step's metadata and a constant, no kernel's output) were read while it may still run; q,
        # k and v, and every write, come after the wait.
        gdc_wait()
    _rotate_heads(Q + t * stride_qt, stride_qh, HQ, WQ, eps, cos, sin, offs_d, mask_d, HALF, BLOCK_HQ, QK_NORM)
    k1, k2 = _rotate_heads(K + t * stride_kt, stride_kh, HKV, WK, eps, cos, sin, offs_d, mask_d, HALF, BLOCK_HK,
                           QK_NORM)
    if STORE:  # the rotated k and v into the cache row of the token's slot (full rotary: D = 2 * HALF)
        offs_h = tl.arange(0, BLOCK_HK)
        mask = (offs_h < HKV)[:, None] & mask_d[None, :]
        row = slot * stride_kvc + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
        tl.store(KC + row, k1, mask=mask)
        tl.store(KC + row + HALF, k2, mask=mask)
        vp = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        tl.store(VC + row, tl.load(vp, mask=mask, other=0.0), mask=mask)
        tl.store(VC + row + HALF, tl.load(vp + HALF, mask=mask, other=0.0), mask=mask)


def _launch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
            q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
            store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    t, hq, _ = q.shape
    if t == 0:
        return
    hkv = k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    block_hq, block_hk = triton.next_power_of_2(hq), triton.next_power_of_2(hkv)
    block_d = triton.next_power_of_2(half)
    num_warps = 4 if block_hq * block_d <= 2048 else 8
    norm = q_weight is not None
    v, k_cache, v_cache, slots = store if store is not None else (k, k, k, positions)
    pdl = dependent_launch(q)
    _rope_kernel[(t,)](
        q, k, positions, cos_sin_cache, q_weight if norm else q, k_weight if norm else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), hq, hkv, eps,
        v, k_cache, v_cache, slots, v.stride(0), v.stride(1), k_cache.stride(0),
        HALF=half, BLOCK_D=block_d, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, QK_NORM=norm, STORE=store is not None,
        PDL=pdl, num_warps=num_warps, **pdl_launch(pdl),
    )


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> None:
    """q [T, Hq, D], k [T, Hkv, D] (last dim packed, any head/row strides), positions [T],
    cos_sin_cache [max_pos, R] fp32 with R even, R <= D. Rotates q and k in place."""
    _launch(q, k, positions, cos_sin_cache, None, None, 0.0)


def apply_rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor) -> None:
    """apply_rope, then the rotated k and v [T, Hkv, D] stored at cache rows `slots` of k_cache /
    v_cache [num_slots, Hkv, D] (k's dtype, heads packed) in the same kernel: one launch, k read
    once. Full rotary only (R = D)."""
    _launch(q, k, positions, cos_sin_cache, None, None, 0.0, (v, k_cache, v_cache, slots))


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> None:
    """Qwen3's per-head q/k RMSNorm followed by RoPE, in place, in one launch (instead of two
    norms on copies of q and k, then the rotation). Full rotary only: cos_sin_cache [max_pos, D]."""
    _launch(q, k, positions, cos_sin_cache, q_weight, k_weight, eps)


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                           q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> None:
    """The unfused math: rmsnorm_reference per head (rounded to the dtype), then the rotation."""
    from minisgl.kernels.norm import rmsnorm_reference

    for x, w in ((q, q_weight), (k, k_weight)):
        x.copy_(rmsnorm_reference(x.reshape(-1, x.shape[-1]), w, eps).view(x.shape))
    apply_rope_reference(q, k, positions, cos_sin_cache)


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> None:
    """fp32 math, rounded once to each tensor's dtype, written back in place."""
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        x[..., :half] = o1.to(x.dtype)
        x[..., half : 2 * half] = o2.to(x.dtype)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, 2 * len(inv_freq)] fp32: cos | sin of position * inv_freq (tests and
    benchmarks; the model layer builds its own table, with its frequency scaling)."""
    t = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
