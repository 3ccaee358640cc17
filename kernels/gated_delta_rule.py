"""Gated DeltaNet (the linear attention of Qwen3-Next / Qwen3.5): chunked prefill and one-token
decode in Triton, beside the per-token recurrent torch reference they are tested against.

Maths (transformers' torch_recurrent_gated_delta_rule; per v-head, state S [d_k, d_v] fp32):
    q, k <- l2norm(q), l2norm(k) (optional, eps 1e-6 inside the rsqrt); q <- q / sqrt(d_k)
    S <- S * exp(g_t);  delta = (v_t - k_t S) * beta_t;  S <- S + k_t^T delta;  o_t = q_t S
GQA-style heads: v-head h reads q/k head h // (Hv / Hk) (transformers' repeat_interleave).

Layouts: q, k [T, Hk, Dk], v [T, Hv, Dv] (last dim packed, token/head strides free: they are
views of the conv output), g [T, Hv] fp32 (log decay, <= 0), beta [T, Hv]; the state pool
states [S, Hv, Dk, Dv] fp32; slots [N] int32 (negative: zeros in, nothing written: padding
rows); has_state [N] (False: the sequence starts fresh and its slot is not read); prefill
sequences are packed by cu_seqlens [N+1] int32; tokens past cu_seqlens[N] (a CUDA graph's token
bucket beyond the step's tokens) belong to no sequence and get zero outputs. Outputs o [T, Hv, Dv]
in v's dtype.

The chunked prefill (chunks of 64 tokens, the WY / UT-transform form) is in
kernels/gated_delta_prefill.py; this file holds the decode step and the reference both are
tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdr_decode_kernel(
    Q, K, V, G, Beta, S, Slots, O,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, so_t, so_h, ss_s, ss_h, scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr,
):
    n, h, pv = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    hk = h // GROUP
    offs_k = tl.arange(0, BK)
    offs_v = pv * BV + tl.arange(0, BV)
    mk, mv = offs_k < DK, offs_v < DV
    q = tl.load(Q + n * sq_t + hk * sq_h + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(K + n * sk_t + hk * sk_h + offs_k, mask=mk, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    v = tl.load(V + n * sv_t + h * sv_h + offs_v, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(G + n * sg_t + h).to(tl.float32)
    beta = tl.load(Beta + n * sb_t + h).to(tl.float32)
    slot = tl.load(Slots + n).to(tl.int64)
    live = slot >= 0
    ptrs = S + slot * ss_s + h * ss_h + offs_k[:, None] * DV + offs_v[None, :]
    # a padding row (negative slot) masks every state element: its limit drops to 0
    m2 = (offs_k < tl.where(live, DK, 0))[:, None] & mv[None, :]
    s = tl.load(ptrs, mask=m2, other=0.0) * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s += k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(O + n * so_t + h * so_h + offs_v, o.to(O.dtype.element_ty), mask=mv)
    tl.store(ptrs, s, mask=m2)


def _shape(q, v):
    hk, dk = q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    return hk, dk, hv, dv, triton.next_power_of_2(max(dk, 32))  # >= 32: the walk halves it for tl.dot


def gated_delta_rule_decode(q, k, v, g, beta, states, slots, l2norm: bool = True):
    """One token per request: q, k [N, Hk, Dk], v [N, Hv, Dv], g/beta [N, Hv]; each live slot of
    `states` is updated in place; returns o [N, Hv, Dv]."""
    n = q.shape[0]
    hk, dk, hv, dv, bk = _shape(q, v)
    o = torch.empty((n, hv, dv), dtype=v.dtype, device=v.device)
    if n == 0:
        return o
    bv = min(64, triton.next_power_of_2(max(dv, 16)))
    _gdr_decode_kernel[(n, hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, states, slots, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1), states.stride(0), states.stride(1), dk ** -0.5,
        GROUP=hv // hk, DK=dk, DV=dv, BK=bk, BV=bv, L2NORM=l2norm, num_warps=4,
    )
    return o


def gated_delta_rule_reference(q, k, v, g, beta, states, slots, cu_seqlens, has_state, l2norm: bool = True,
                               store_state: bool = True):
    """fp32 per-token recurrence (transformers' order and scaling) over packed sequences;
    updates each live slot of `states` in place like the kernels. Returns o [T, Hv, Dv]."""
    hk, dk, hv, dv = q.shape[1], q.shape[2], v.shape[1], v.shape[2]
    rep = hv // hk
    qf = q.float().repeat_interleave(rep, dim=1)
    kf = k.float().repeat_interleave(rep, dim=1)
    if l2norm:
        qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    qf = qf / dk ** 0.5
    vf, gf, bf = v.float(), g.float(), beta.float()
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)  # padding past cu_seqlens[-1]: zeros
    cu = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        fresh = slot < 0 or not bool(has_state[i])
        s = torch.zeros(hv, dk, dv, device=v.device) if fresh else states[slot].float().clone()
        for t in range(cu[i], cu[i + 1]):
            s = s * gf[t].exp()[:, None, None]
            kv_mem = (s * kf[t][:, :, None]).sum(-2)
            delta = (vf[t] - kv_mem) * bf[t][:, None]
            s = s + kf[t][:, :, None] * delta[:, None, :]
            o[t] = (s * qf[t][:, :, None]).sum(-2)
        if slot >= 0 and store_state:
            states[slot] = s
    return o.to(v.dtype)
