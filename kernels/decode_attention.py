"""Decode attention over the paged KV cache: split-K flash decoding (Triton + fp32 reference).

q [B, Hq, D]: one new token per request, at position seq_lens[b] - 1, attending to positions
0 .. seq_lens[b] - 1 (its own K/V already stored) through slot = req_to_slot[req_rows[b], pos].

Stage 1, grid (B, kv_heads, NUM_SPLITS): each program takes all q heads of one KV group
(padded to BLOCK_H >= 16 rows so the scores are one tensor-core dot) and one contiguous
slice of the request's keys, so every K/V row is read once per group. It writes the slice's
normalized partial output and its log2-sum-exp to fp32 scratch.
With a sliding window W the splits cover positions max(0, seq - W) .. seq - 1 only (older slots
may be freed: never read); a sink logit per head joins stage 2's denominator.
Stage 2, grid (B, Hq): merges the splits (with one split, stage 1 writes the output itself and
there is no stage 2). NUM_SPLITS is a function of the host-side bound max_seq_len only (the
per-row slice length comes from seq_lens on the device), so a captured CUDA graph stays valid
for any lengths up to that bound.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minisgl.kernels.device import num_sms
from minisgl.kernels.extend_attention import dot_precision


@triton.jit
def _decode_split_kernel(
    Q, KCache, VCache, ReqToSlot, ReqRows, SeqLens, Mid, MidLse, qk_scale,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, window, Out, stride_ob, stride_oh, Sinks,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(SeqLens + b)
    row = tl.load(ReqRows + b).to(tl.int64)
    lo = tl.maximum(seq - window, 0)  # the first key the token sees (window: 2^30 for none)
    per_split = tl.cdiv(tl.cdiv(seq - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    slot_base = ReqToSlot + row * stride_rt
    k_base = KCache + kvh.to(tl.int64) * stride_kh
    v_base = VCache + kvh.to(tl.int64) * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(slot_base + offs_n, mask=mask_n, other=0).to(tl.int64)
        # [BLOCK_N, D], rows along the contiguous D (16-byte loads), transposed in the dot; FP8: exact
        k = tl.load(k_base + slots[:, None] * stride_kt + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slots[:, None] * stride_vt + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)  # [BLOCK_N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    if NUM_SPLITS == 1:  # the whole row in this program: the final output, no stage 2
        denom = l_i
        if HAS_SINKS:  # the sink's weight 2^(sink log2 e - m) joins the denominator
            sink = tl.load(Sinks + heads, mask=mask_h, other=0.0).to(tl.float32) * 1.4426950408889634
            denom += tl.where(l_i > 0, tl.exp2(sink - m_i), 0.0)
        final = tl.where((l_i > 0)[:, None], acc / tl.where(l_i > 0, denom, 1.0)[:, None], 0.0)
        tl.store(Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 final.to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
        return
    # An empty slice (short request) leaves l_i = 0: it gets lse = -inf and weight 0 in stage 2.
    nonempty = l_i > 0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    mid = (Mid + b.to(tl.int64) * stride_mb + heads[:, None] * stride_mh + split * stride_ms
           + offs_d[None, :])
    tl.store(mid, out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(MidLse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    Mid, MidLse, Out, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh, Sinks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    top = tl.max(lse, 0)
    if HAS_SINKS:  # a split of weight 2^(sink log2 e) and no value
        sink = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
        w = tl.where(lse > float("-inf"), tl.exp2(lse - top), 0.0)
        w = w / (tl.sum(w, 0) + tl.exp2(sink - top))
    else:
        w = tl.where(lse > float("-inf"), tl.exp2(lse - top), 0.0)
        w = w / tl.maximum(tl.sum(w, 0), 1e-30)
    part = tl.load(Mid + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
                   mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def num_splits_for(batch: int, kv_heads: int, max_seq_len: int, device: torch.device, head_dim: int = 128) -> int:
    """Enough (batch x kv-head x split) programs to fill the GPU twice, each slice >= 128 keys.
    Heads of 64 dims (GPT-OSS: 8 q heads per KV head) want four waves and up to 64 splits: the
    launch sweep (benchmarks/kernels/decode_attention.py --triton-sweep, H100) took 30.5 us at
    64 splits of 128-key blocks for a 32k context against 41 us for the CUDA kernel."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 4
    waves, cap = (4, 64) if head_dim <= 64 else (2, 32)
    want = triton.cdiv(waves * sms, max(1, batch * kv_heads))
    return max(1, min(cap, want, triton.cdiv(max_seq_len, 128)))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_slot: torch.Tensor,
    req_rows: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
    out: torch.Tensor | None = None, num_splits: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
    window: int = 0, sinks: torch.Tensor | None = None, launch: dict | None = None,
) -> torch.Tensor:
    """Shapes as in the module docstring; returns out [B, Hq, D] in q's dtype. An FP8 cache
    holds K / k_scale and V / v_scale (per-tensor scales: K's folds into the score scale).
    `window` > 0: a sliding window of that many keys; `sinks` fp32 [Hq]: sink logits.
    `launch` overrides block_n / num_warps / num_stages (the benchmark's sweep)."""
    b, hq, d = q.shape
    kv_heads = k_cache.shape[1]
    group = hq // kv_heads
    if out is None:
        out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    keys = min(max_seq_len, window) if window > 0 else max_seq_len  # the most keys a token reads
    splits = num_splits or num_splits_for(b, kv_heads, keys, q.device, d)
    block_d = triton.next_power_of_2(d)
    mid = torch.empty((b, hq, splits, block_d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    block_h = max(16, triton.next_power_of_2(group))
    block_n = 128 if d <= 64 else (64 if d <= 128 else 32)  # 128 at d 64: the sweep's best
    cfg = {"block_n": block_n, "num_warps": 4, "num_stages": 2} | (launch or {})
    _decode_split_kernel[(b, kv_heads, splits)](
        q, k_cache, v_cache, req_to_slot, req_rows, seq_lens, mid, lse, scale * k_scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), req_to_slot.stride(0), mid.stride(0), mid.stride(1), mid.stride(2),
        lse.stride(0), lse.stride(1), window if window > 0 else 1 << 30, out, out.stride(0), out.stride(1),
        lse if sinks is None else sinks,
        GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_N=cfg["block_n"],
        NUM_SPLITS=splits, DOT_PREC=dot_precision(q.dtype), HAS_SINKS=sinks is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if splits > 1:  # one split wrote the output itself (a sliding window's 128 keys: one launch)
        _decode_merge_kernel[(b, hq)](
            mid, lse, out, mid.stride(0), mid.stride(1), mid.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), lse if sinks is None else sinks, HEAD_DIM=d, BLOCK_D=block_d,
            NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), HAS_SINKS=sinks is not None, num_warps=4,
        )
    if v_scale != 1.0:
        out.mul_(v_scale)
    return out


def decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_slot: torch.Tensor,
    req_rows: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    compute_dtype: torch.dtype = torch.float32, window: int = 0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per request: softmax(q K^T * scale) V over its seq_len keys (the last `window` of them
    when > 0; a sink logit per head in the denominator), matmuls in compute_dtype, softmax in
    fp32 (fp64 for the gold answer). Returns [B, Hq, D] in compute_dtype."""
    b, hq, d = q.shape
    group = hq // k_cache.shape[1]
    out = torch.empty((b, hq, d), dtype=compute_dtype, device=q.device)
    soft_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    for i, (row, seq) in enumerate(zip(req_rows.tolist(), seq_lens.tolist())):
        slots = req_to_slot[row, max(0, seq - window) if window > 0 else 0 : seq].long()
        k = k_cache[slots].to(compute_dtype).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache[slots].to(compute_dtype).repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", q[i].to(compute_dtype), k) * scale
        s = s.to(soft_dtype)
        if sinks is not None:
            p = torch.softmax(torch.cat([s, sinks.to(soft_dtype)[:, None]], dim=-1), dim=-1)[:, :-1]
        else:
            p = torch.softmax(s, dim=-1)
        p = p.to(compute_dtype)
        out[i] = torch.einsum("hl,lhd->hd", p, v)
    return out
