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

Chunked prefill (chunks of 64 tokens, the WY / UT-transform form). Within a chunk with
cumulative log decay c_i, L = strictly_lower(beta_i (k_i.k_j) exp(c_i - c_j)); with
X = (I + L)^-1 (forward substitution, in fp32), W = X (beta k exp(c)) and U = X (beta v) hold
the chunk's delta-rule corrections, so per chunk:  v' = U - W S;  o = (q exp(c)) S +
lower_incl_diag((q k^T) exp(c_i - c_j)) v';  S <- S exp(c_last) + (k exp(c_last - c))^T v'.
Kernel 1 builds c, W, U for every chunk in parallel; kernel 2 walks each sequence's chunks in
order with S in registers and writes the outputs and the final state. Nothing reads host
values (the chunk table is built on the device from an upper bound), so it is capturable.
Dots run in fp32 ("ieee") for fp32 inputs; with 16-bit inputs kernel 2 feeds the tensor cores
16-bit operands (fp32 accumulation), as flash-linear-attention does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK = 64


@triton.jit
def _l2norm_rows(x, ENABLE: tl.constexpr):
    if ENABLE:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


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


# The prep kernel inverts (I + L) in 16-row blocks: forward substitution on each 16 x 16
# diagonal block (cheap: 15 steps over 256 elements), then the off-diagonal blocks by
# X_ij = -X_ii sum_{j<=m<i} L_im X_mj (tensor-core dots). A 64-step substitution over the
# whole 64 x 64 tile costs ~4x more serial reductions; a product-of-powers inverse would be
# all dots but loses accuracy when keys repeat (the powers of L grow and cancel).
@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _sub_load(K, G, Beta, tok0, end, hk, h, sk_t, sk_h, sg_t, sb_t, carry,
              DK: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr):
    """One 16-token block: l2-normed keys, cumulative log decay (continuing `carry`), beta."""
    tok = tok0 + tl.arange(0, 16)
    mt = tok < end
    tok64 = tok.to(tl.int64)
    offs_k = tl.arange(0, BK)
    k = tl.load(K + tok64[:, None] * sk_t + hk * sk_h + offs_k[None, :], mask=mt[:, None] & (offs_k < DK)[None, :],
                other=0.0).to(tl.float32)
    k = _l2norm_rows(k, L2NORM)
    g = tl.load(G + tok64 * sg_t + h, mask=mt, other=0.0).to(tl.float32)
    beta = tl.load(Beta + tok64 * sb_t + h, mask=mt, other=0.0).to(tl.float32)
    return k, tl.cumsum(g, axis=0) + carry, beta, carry + tl.sum(g, axis=0)


@triton.jit
def _lblock(ki, gi, bi, kj, gj, DIAG: tl.constexpr):
    """Block (i, j) of L = beta_i (k_i . k_j) exp(c_i - c_j), strictly lower on the diagonal."""
    r, c = tl.arange(0, 16)[:, None], tl.arange(0, 16)[None, :]
    if DIAG:
        m = r > c
    else:
        m = (r >= 0) & (c >= 0)
    # exp only where the row is after the column (c_i - c_j <= 0): elsewhere it could overflow
    d = tl.exp(tl.where(m, gi[:, None] - gj[None, :], float("-inf")))
    return tl.where(m, bi[:, None] * _mm(ki, tl.trans(kj)) * d, 0.0)


@triton.jit
def _inv16(L):
    """(I + L)^-1 for a strictly lower 16 x 16 L: row i is e_i - sum_{j<i} L_ij X_j."""
    r, c = tl.arange(0, 16)[:, None], tl.arange(0, 16)[None, :]
    X = tl.where(r == c, 1.0, 0.0)
    for i in range(1, 16):
        l_i = tl.sum(tl.where(r == i, L, 0.0), axis=0)  # row i of L, laid out along the columns
        X = X - tl.where(r == i, tl.sum(l_i[:, None] * X, axis=0)[None, :], 0.0)
    return X


@triton.jit
def _store_rows(P, x, tok0, end, h, HV, DIM: tl.constexpr, BD: tl.constexpr):
    tok = tok0 + tl.arange(0, 16)
    offs = tl.arange(0, BD)
    tl.store(P + (tok.to(tl.int64) * HV + h)[:, None] * DIM + offs[None, :], x,
             mask=(tok < end)[:, None] & (offs < DIM)[None, :])


@triton.jit
def _store_gc(GC, gc, tok0, end, h, HV):
    tok = tok0 + tl.arange(0, 16)
    tl.store(GC + tok.to(tl.int64) * HV + h, gc, mask=tok < end)


@triton.jit
def _load_vb(V, tok0, end, h, sv_t, sv_h, beta, DV: tl.constexpr, BVF: tl.constexpr):
    tok = tok0 + tl.arange(0, 16)
    offs = tl.arange(0, BVF)
    v = tl.load(V + tok.to(tl.int64)[:, None] * sv_t + h * sv_h + offs[None, :],
                mask=(tok < end)[:, None] & (offs < DV)[None, :], other=0.0).to(tl.float32)
    return v * beta[:, None]


@triton.jit
def _gdr_prep_kernel(
    K, V, G, Beta, Cu, ChunkSeq, ChunkStart, GC, W, U,
    sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, HV,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """Per (chunk of 64, v-head): the cumulative decays c, and W = X (beta k exp(c)), U = X (beta v)."""
    c, h = tl.program_id(0), tl.program_id(1)
    seq = tl.load(ChunkSeq + c)
    if seq < 0:
        return
    s0 = tl.load(ChunkStart + c)
    end = tl.load(Cu + seq + 1)
    hk = h // GROUP
    s1, s2, s3 = s0 + 16, s0 + 32, s0 + 48
    k0, g0, b0, cy = _sub_load(K, G, Beta, s0, end, hk, h, sk_t, sk_h, sg_t, sb_t, 0.0, DK, BK, L2NORM)
    k1, g1, b1, cy = _sub_load(K, G, Beta, s1, end, hk, h, sk_t, sk_h, sg_t, sb_t, cy, DK, BK, L2NORM)
    k2, g2, b2, cy = _sub_load(K, G, Beta, s2, end, hk, h, sk_t, sk_h, sg_t, sb_t, cy, DK, BK, L2NORM)
    k3, g3, b3, cy = _sub_load(K, G, Beta, s3, end, hk, h, sk_t, sk_h, sg_t, sb_t, cy, DK, BK, L2NORM)
    _store_gc(GC, g0, s0, end, h, HV)
    _store_gc(GC, g1, s1, end, h, HV)
    _store_gc(GC, g2, s2, end, h, HV)
    _store_gc(GC, g3, s3, end, h, HV)
    X00 = _inv16(_lblock(k0, g0, b0, k0, g0, True))
    X11 = _inv16(_lblock(k1, g1, b1, k1, g1, True))
    X22 = _inv16(_lblock(k2, g2, b2, k2, g2, True))
    X33 = _inv16(_lblock(k3, g3, b3, k3, g3, True))
    L10 = _lblock(k1, g1, b1, k0, g0, False)
    L20, L21 = _lblock(k2, g2, b2, k0, g0, False), _lblock(k2, g2, b2, k1, g1, False)
    L30, L31 = _lblock(k3, g3, b3, k0, g0, False), _lblock(k3, g3, b3, k1, g1, False)
    L32 = _lblock(k3, g3, b3, k2, g2, False)
    X10 = -_mm(X11, _mm(L10, X00))
    X21 = -_mm(X22, _mm(L21, X11))
    X20 = -_mm(X22, _mm(L20, X00) + _mm(L21, X10))
    X32 = -_mm(X33, _mm(L32, X22))
    X31 = -_mm(X33, _mm(L31, X11) + _mm(L32, X21))
    X30 = -_mm(X33, _mm(L30, X00) + _mm(L31, X10) + _mm(L32, X20))
    kb0, kb1 = k0 * (b0 * tl.exp(g0))[:, None], k1 * (b1 * tl.exp(g1))[:, None]
    kb2, kb3 = k2 * (b2 * tl.exp(g2))[:, None], k3 * (b3 * tl.exp(g3))[:, None]
    _store_rows(W, _mm(X00, kb0), s0, end, h, HV, DK, BK)
    _store_rows(W, _mm(X10, kb0) + _mm(X11, kb1), s1, end, h, HV, DK, BK)
    _store_rows(W, _mm(X20, kb0) + _mm(X21, kb1) + _mm(X22, kb2), s2, end, h, HV, DK, BK)
    _store_rows(W, _mm(X30, kb0) + _mm(X31, kb1) + _mm(X32, kb2) + _mm(X33, kb3), s3, end, h, HV, DK, BK)
    # v is loaded only now, so the keys' and the values' tiles are not all live at once
    vb0 = _load_vb(V, s0, end, h, sv_t, sv_h, b0, DV, BVF)
    vb1 = _load_vb(V, s1, end, h, sv_t, sv_h, b1, DV, BVF)
    vb2 = _load_vb(V, s2, end, h, sv_t, sv_h, b2, DV, BVF)
    vb3 = _load_vb(V, s3, end, h, sv_t, sv_h, b3, DV, BVF)
    _store_rows(U, _mm(X00, vb0), s0, end, h, HV, DV, BVF)
    _store_rows(U, _mm(X10, vb0) + _mm(X11, vb1), s1, end, h, HV, DV, BVF)
    _store_rows(U, _mm(X20, vb0) + _mm(X21, vb1) + _mm(X22, vb2), s2, end, h, HV, DV, BVF)
    _store_rows(U, _mm(X30, vb0) + _mm(X31, vb1) + _mm(X32, vb2) + _mm(X33, vb3), s3, end, h, HV, DV, BVF)


@triton.jit
def _dot(a, b, HALF: tl.constexpr, DT: tl.constexpr):
    if HALF:
        return tl.dot(a.to(DT), b.to(DT))
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _gdr_scan_kernel(
    Q, K, GC, W, U, S, Slots, HasState, Cu, O,
    sq_t, sq_h, sk_t, sk_h, so_t, so_h, ss_s, ss_h, HV, scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, L2NORM: tl.constexpr, HALF: tl.constexpr, STORE: tl.constexpr,
):
    n, h, pv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // GROUP
    DT = Q.dtype.element_ty
    start, end = tl.load(Cu + n), tl.load(Cu + n + 1)
    slot = tl.load(Slots + n).to(tl.int64)
    read = (slot >= 0) & (tl.load(HasState + n) != 0)
    offs_k, offs_v = tl.arange(0, BK), pv * BV + tl.arange(0, BV)
    mk, mv = offs_k < DK, offs_v < DV
    sptr = S + slot * ss_s + h * ss_h + offs_k[:, None] * DV + offs_v[None, :]
    s = tl.load(sptr, mask=(offs_k < tl.where(read, DK, 0))[:, None] & mv[None, :], other=0.0)
    rows, cols = tl.arange(0, BT)[:, None], tl.arange(0, BT)[None, :]
    for cs in range(start, end, BT):
        tok = cs + tl.arange(0, BT)
        mt = tok < end
        tok64 = tok.to(tl.int64)
        mtk = mt[:, None] & mk[None, :]
        q = tl.load(Q + tok64[:, None] * sq_t + hk * sq_h + offs_k[None, :], mask=mtk, other=0.0).to(tl.float32)
        k = tl.load(K + tok64[:, None] * sk_t + hk * sk_h + offs_k[None, :], mask=mtk, other=0.0).to(tl.float32)
        q = _l2norm_rows(q, L2NORM) * scale
        k = _l2norm_rows(k, L2NORM)
        gc = tl.load(GC + tok64 * HV + h, mask=mt, other=0.0)
        glast = tl.load(GC + (tl.minimum(end, cs + BT) - 1).to(tl.int64) * HV + h)
        w = tl.load(W + (tok64 * HV + h)[:, None] * DK + offs_k[None, :], mask=mtk, other=0.0)
        u = tl.load(U + (tok64 * HV + h)[:, None] * DV + offs_v[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        v_new = u - _dot(w, s, HALF, DT)
        qk = _dot(q, tl.trans(k), HALF, DT)
        attn = tl.where(rows >= cols, qk * tl.exp(tl.where(rows >= cols, gc[:, None] - gc[None, :], 0.0)), 0.0)
        o = _dot(q * tl.exp(gc)[:, None], s, HALF, DT) + _dot(attn, v_new, HALF, DT)
        tl.store(O + tok64[:, None] * so_t + h * so_h + offs_v[None, :], o.to(O.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])
        kd = k * tl.exp(glast - gc)[:, None]
        s = s * tl.exp(glast) + _dot(tl.trans(kd), v_new, HALF, DT)
    if STORE:
        tl.store(sptr, s, mask=(offs_k < tl.where(slot >= 0, DK, 0))[:, None] & mv[None, :])


def _shape(q, v):
    hk, dk = q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    return hk, dk, hv, dv, triton.next_power_of_2(max(dk, 16))


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


PREP_LAUNCH_OPTIONS = {"num_warps": 8}


def scan_launch_options(half: bool) -> dict:
    # Pipelining the chunk loop's loads 3 deep (Triton's default) needs 149 KB of shared memory
    # with 16-bit inputs and 329 KB with fp32, over the H100's 227 KB (sm_90 compile, d 128);
    # 2 and 1 deep need 99 KB and 102 KB. tests/test_gated_delta_rule.py compiles them to check.
    return {"num_warps": 4, "num_stages": 2 if half else 1}


@functools.cache
def _sm_count(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _chunk_table(cu_seqlens: torch.Tensor, t: int, bt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first token) of every chunk, -1 past the last; sized by an upper bound
    (sum of ceil(len / bt) <= t // bt + N) so no host value is read."""
    n = cu_seqlens.shape[0] - 1
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    ccu = torch.cumsum((lens + bt - 1) // bt, 0)
    c = torch.arange(t // bt + n, device=cu_seqlens.device, dtype=ccu.dtype)
    seq = torch.searchsorted(ccu, c, right=True)
    active = seq < n
    seq = seq.clamp(max=n - 1)
    first = ccu[seq] - (lens[seq] + bt - 1) // bt  # the sequence's first chunk number
    start = cu_seqlens[seq] + (c - first) * bt
    return torch.where(active, seq, -1).to(torch.int32), start.to(torch.int32)


def gated_delta_rule_prefill(q, k, v, g, beta, states, slots, cu_seqlens, has_state, l2norm: bool = True,
                             store_state: bool = True):
    """Chunked prefill over packed sequences; reads each sequence's initial state from its slot
    (unless fresh) and writes its final state there (not with store_state False: a speculative
    verify step). Returns o [T, Hv, Dv]."""
    t = q.shape[0]
    n = slots.shape[0]
    hk, dk, hv, dv, bk = _shape(q, v)
    # zeros: the kernels write the sequences' tokens only, not a graph bucket's padding past them
    o = torch.zeros((t, hv, dv), dtype=v.dtype, device=v.device)
    if n == 0:
        return o
    dev = q.device
    gc = torch.empty((t, hv), dtype=torch.float32, device=dev)
    w = torch.empty((t, hv, dk), dtype=torch.float32, device=dev)
    u = torch.empty((t, hv, dv), dtype=torch.float32, device=dev)
    chunk_seq, chunk_start = _chunk_table(cu_seqlens, t, CHUNK)
    group = hv // hk
    half = q.dtype != torch.float32
    if chunk_seq.numel():
        _gdr_prep_kernel[(chunk_seq.numel(), hv)](
            k, v, g, beta, cu_seqlens, chunk_seq, chunk_start, gc, w, u,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), hv,
            GROUP=group, DK=dk, DV=dv, BK=bk, BVF=triton.next_power_of_2(max(dv, 16)), L2NORM=l2norm,
            **PREP_LAUNCH_OPTIONS,
        )
    bv = min(64, triton.next_power_of_2(max(dv, 16)))
    # The scan is serial over chunks: split the v columns finer when (sequences x heads) alone
    # would leave SMs idle (one long prompt); each split recomputes only the small Q K^T tile.
    # fp32 only: with 16-bit dots at BV 32 (d 128) Triton 3.6's sm_90 code makes out-of-range
    # shared-memory accesses (compute-sanitizer, H200, 2026-11-27; BV 64 and fp32 dots are clean).
    if dev.type == "cuda" and not half and bv > 32 and n * hv * triton.cdiv(dv, bv) < _sm_count(dev):
        bv = 32
    _gdr_scan_kernel[(n, hv, triton.cdiv(dv, bv))](
        q, k, gc, w, u, states, slots, has_state.to(torch.int32), cu_seqlens, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), o.stride(0), o.stride(1),
        states.stride(0), states.stride(1), hv, dk ** -0.5,
        GROUP=group, DK=dk, DV=dv, BK=bk, BV=bv, BT=CHUNK, L2NORM=l2norm, HALF=half, STORE=store_state,
        **scan_launch_options(half),
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
