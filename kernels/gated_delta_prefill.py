"""Gated DeltaNet chunked prefill in Triton (maths, layouts and the recurrent reference it is
tested against: kernels/gated_delta_rule.py).

Chunked prefill (chunks of 64 tokens, the WY / UT-transform form). Within a chunk with
cumulative log decay c_i, L = strictly_lower(beta_i (k_i.k_j) exp(c_i - c_j)); with
X = (I + L)^-1 (forward substitution), W = X (beta k exp(c)) and U = X (beta v) hold the
chunk's delta-rule corrections, so per chunk with S_c the state at its start:  v' = U - W S_c;
o = (q exp(c)) S_c + lower_incl_diag((q k^T) exp(c_i - c_j)) v';
S_{c+1} = S_c exp(c_last) + (k exp(c_last - c))^T v'.
Three kernels, split where the work turns serial: per (chunk, v-head) L and X
(kernels/gated_delta_solve.py), then W, U and the state-free part of the outputs
(lower_incl_diag((q k^T) exp(c_i - c_j)) and q's row factors); per (sequence, v-head, v-block)
the only serial kernel, a walk over the chunks that makes v' and the outputs where S_c is (seven
small dots per chunk). (The first version did all of the outputs inside the walk and built X, W,
U in one kernel holding ~20 16 x 16 tiles, which spilled: 48 ms vs FLA's 2.4 ms at 32k tokens on
the H100. flash-linear-attention's split, which this followed next, stores every S_c for a
fourth, per-chunk output kernel to read back: an [n_chunks, Hv, d_k, d_v] buffer of 0.5 GB at
32k tokens, written and read (1 GB of traffic); without it 2.26 ms against 2.35, RESULTS.md.)
q/k normalisation scales the dot products (the raw 16-bit keys feed the tensor cores). Nothing reads host values
(kernels/chunk_table.py), so it is capturable. With 16-bit inputs the buffers between kernels
(X, W, U, the intra-chunk scores A) are 16-bit and the dots take 16-bit operands (fp32
accumulation), as FLA's do; fp32 inputs keep fp32 ("ieee").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.chunk_table import _chunk, chunk_table
from minisgl.kernels.device import num_sms
from minisgl.kernels.gated_delta_rule import _shape
from minisgl.kernels.gated_delta_solve import _gdr_kkt_solve_kernel
from minisgl.kernels.gated_delta_tiles import _dot, _ld, _rnorm, _st, _tile

CHUNK = 64


@triton.jit
def _gdr_wu_kernel(
    Q, K, V, Beta, Cu, ChunkSeq, ChunkStart, NumChunks, GC, KS, X, W, U, A, QF, O,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sb_t, so_t, so_h, HV, T, N, scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    L2NORM: tl.constexpr, HALF: tl.constexpr,
):
    """Per (chunk, v-head): W = X (beta k exp(c)) and U = X (beta v), the row factors folded
    into X's columns and the columns of W and U made BV at a time; and the chunk's part of the
    outputs that needs no state, A = lower_incl_diag((q k^T) exp(c_i - c_j)) q_scale_i and
    QF = q_scale exp(c) (the q-side factor of (q exp(c)) S_c), for the walk. A program past the
    last chunk writes zeros over BT tokens of the padding past cu_seqlens[N] (a graph
    bucket's): the table has enough spare entries to cover it."""
    c, h = tl.program_id(0), tl.program_id(1)
    seq, s0, tok, mt, end = _chunk(ChunkSeq, ChunkStart, Cu, c, BT)
    if seq < 0:
        pad0 = tl.load(Cu + N) + (c - tl.load(NumChunks)) * BT
        for v0 in range(0, DV, BV):
            _st(_tile(O + h * so_h, T, DV, so_t, pad0, v0, BT, BV), tl.zeros((BT, BV), dtype=tl.float32))
        return
    # only X's lower 16 x 16 blocks were written (the diagonal ones whole, zero above their diagonal)
    r, cl = tl.arange(0, BT)[:, None], tl.arange(0, BT)[None, :]
    xp, xm = _tile(X + h * BT, end, BT, HV * BT, s0, 0, BT, BT)
    x = tl.load(xp, mask=xm & (r // 16 >= cl // 16), other=0.0).to(tl.float32)
    tok64 = tok.to(tl.int64)
    beta = tl.load(Beta + tok64 * sb_t + h, mask=mt, other=0.0).to(tl.float32)
    gc = tl.load(GC + tok64 * HV + h, mask=mt, other=0.0)
    ks = tl.load(KS + tok64 * HV + h, mask=mt, other=0.0)
    DT = K.dtype.element_ty
    # X's scaled copies in the dots' operand type (16-bit for 16-bit inputs: the dots round them
    # anyway), made once: fp32 copies held across the loops cost ~100 registers (RESULTS.md)
    xk = (x * (beta * ks * tl.exp(gc))[None, :]).to(W.dtype.element_ty)
    xv = (x * beta[None, :]).to(U.dtype.element_ty)
    qk = tl.zeros((BT, BT), dtype=tl.float32)
    qn = tl.zeros((BT,), dtype=tl.float32)
    hk = h // GROUP
    for k0 in range(0, DK, BV):
        k = _ld(_tile(K + hk * sk_h, end, DK, sk_t, s0, k0, BT, BV))
        _st(_tile(W + h * DK, end, DK, HV * DK, s0, k0, BT, BV), _dot(xk, k, HALF, DT))
        q = _ld(_tile(Q + hk * sq_h, end, DK, sq_t, s0, k0, BT, BV))
        qk += _dot(q, tl.trans(k), HALF, DT)
        if L2NORM:
            qf = q.to(tl.float32)
            qn += tl.sum(qf * qf, axis=1)
    for v0 in range(0, DV, BV):
        v = _ld(_tile(V + h * sv_h, end, DV, sv_t, s0, v0, BT, BV))
        _st(_tile(U + h * DV, end, DV, HV * DV, s0, v0, BT, BV), _dot(xv, v, HALF, DT))
    qs = _rnorm(qn, L2NORM) * scale
    decay = tl.exp(tl.where(r >= cl, gc[:, None] - gc[None, :], float("-inf")))
    _st(_tile(A + h * BT, end, BT, HV * BT, s0, 0, BT, BT),
        tl.where(r >= cl, qk * decay * qs[:, None] * ks[None, :], 0.0))
    tl.store(QF + tok64 * HV + h, qs * tl.exp(gc), mask=mt)


@triton.jit
def _gdr_state_kernel(
    Q, K, KS, GC, QF, A, W, U, S, Slots, HasState, Cu, O,
    sq_t, sq_h, sk_t, sk_h, ss_s, ss_h, so_t, so_h, HV,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, HALF: tl.constexpr, STORE: tl.constexpr,
):
    """Per (sequence, v-head, v-block), chunk after chunk, with S_c the state at the chunk's
    start: v' = U - W S_c; the outputs o = QF (q S_c) + A v'; then
    S <- S exp(c_last) + k^T (v' k_scale exp(c_last - c)). S is held as two halves of d_k rows
    (smaller tiles: the whole [128, BV] state with the chunk's [64, 128] operands spilled).
    The outputs are made here, where S_c is, rather than by a kernel per chunk that reads every
    S_c back: that cost an [n_chunks, Hv, d_k, d_v] buffer written and read (0.5 GB each way at
    32k tokens, RESULTS.md, eleventh session)."""
    n, h, pv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BKH: tl.constexpr = BK // 2
    start, end = tl.load(Cu + n), tl.load(Cu + n + 1)
    slot = tl.load(Slots + n).to(tl.int64)
    read = (slot >= 0) & (tl.load(HasState + n) != 0)
    v0 = pv * BV
    # a fresh sequence or a padding row (negative slot) reads no row: its limit drops to 0
    sbase = S + slot * ss_s + h * ss_h
    s1 = _ld(_tile(sbase, tl.where(read, DK, 0), DV, DV, 0, v0, BKH, BV))
    s2 = _ld(_tile(sbase, tl.where(read, DK, 0), DV, DV, BKH, v0, BKH, BV))
    DT = K.dtype.element_ty
    hk = h // GROUP
    kbase = K + hk * sk_h
    qbase = Q + hk * sq_h
    for cs in range(start, end, BT):
        u = _ld(_tile(U + h * DV, end, DV, HV * DV, cs, v0, BT, BV)).to(tl.float32)
        w1 = _ld(_tile(W + h * DK, end, DK, HV * DK, cs, 0, BT, BKH))
        w2 = _ld(_tile(W + h * DK, end, DK, HV * DK, cs, BKH, BT, BKH))
        q1 = _ld(_tile(qbase, end, DK, sq_t, cs, 0, BT, BKH))
        q2 = _ld(_tile(qbase, end, DK, sq_t, cs, BKH, BT, BKH))
        a = _ld(_tile(A + h * BT, end, BT, HV * BT, cs, 0, BT, BT))
        tok = cs + tl.arange(0, BT)
        tok64 = tok.to(tl.int64)
        gc = tl.load(GC + tok64 * HV + h, mask=tok < end, other=0.0)
        ks = tl.load(KS + tok64 * HV + h, mask=tok < end, other=0.0)
        qf = tl.load(QF + tok64 * HV + h, mask=tok < end, other=0.0)
        glast = tl.load(GC + (tl.minimum(end, cs + BT) - 1).to(tl.int64) * HV + h)
        vn = u - _dot(w1, s1, HALF, DT) - _dot(w2, s2, HALF, DT)
        o = (_dot(q1, s1, HALF, DT) + _dot(q2, s2, HALF, DT)) * qf[:, None] + _dot(a, vn, HALF, DT)
        _st(_tile(O + h * so_h, end, DV, so_t, cs, v0, BT, BV), o)
        vn = vn * (ks * tl.exp(glast - gc))[:, None]
        k1 = _ld(_tile(kbase, end, DK, sk_t, cs, 0, BT, BKH))
        k2 = _ld(_tile(kbase, end, DK, sk_t, cs, BKH, BT, BKH))
        decay = tl.exp(glast)
        s1 = s1 * decay + _dot(tl.trans(k1), vn, HALF, DT)
        s2 = s2 * decay + _dot(tl.trans(k2), vn, HALF, DT)
    if STORE:
        _st(_tile(sbase, tl.where(slot >= 0, DK, 0), DV, DV, 0, v0, BKH, BV), s1)
        _st(_tile(sbase, tl.where(slot >= 0, DK, 0), DV, DV, BKH, v0, BKH, BV), s2)


# Per kernel: num_warps / num_stages and tile widths ("bv", "bkc"), chosen on the H100 by
# `benchmarks/kernels/gated_delta_rule.py --sweep` (RESULTS.md), which alone edits this table.
# With Triton 3.6 on the H100 a pipelined d_k loop in the former output kernel gave wrong outputs,
# and accumulating dots (tl.dot(a, b, acc)) there failed the fp16 verify test (RESULTS.md, tenth
# session): the dots here stay separate. Check the benchmark's max|diff| column after any change.
LAUNCH = {
    "kkt_solve": {"num_warps": 1, "bkc": 64},
    "wu": {"num_warps": 4, "num_stages": 3, "bv": 64},
    "state": {"num_warps": 4, "num_stages": 3, "bv": 64},
}


def launch_options(kernel: str, half: bool) -> dict:
    """num_warps / num_stages of a kernel. The walk pipelines its loop's loads; with fp32 inputs
    one stage (its tiles are twice the bytes). tests/test_gated_delta_rule.py compiles every
    kernel for sm_90 with these and checks the shared memory fits the H100's 227 KB."""
    opts = {"num_stages": 1} | {k: v for k, v in LAUNCH[kernel].items() if k not in ("bv", "bkc")}
    if not half:
        opts["num_stages"] = 1
    return opts


def gated_delta_rule_prefill(q, k, v, g, beta, states, slots, cu_seqlens, has_state, l2norm: bool = True,
                             store_state: bool = True, chunks: tuple[torch.Tensor, ...] | None = None):
    """Chunked prefill over packed sequences; reads each sequence's initial state from its slot
    (unless fresh) and writes its final state there (not with store_state False: a speculative
    verify step). `chunks`: chunk_table(cu_seqlens, T, CHUNK) when the caller made it once for
    several layers. Returns o [T, Hv, Dv]."""
    t = q.shape[0]
    n = slots.shape[0]
    hk, dk, hv, dv, bk = _shape(q, v)
    if n == 0:
        return torch.zeros((t, hv, dv), dtype=v.dtype, device=v.device)
    dev = q.device
    half = q.dtype != torch.float32
    bdt = q.dtype if half else torch.float32  # the buffers between kernels
    chunk_seq, chunk_start, num_chunks = chunks if chunks is not None else chunk_table(cu_seqlens, t, CHUNK)
    nc = chunk_seq.numel()
    group = hv // hk
    meta = dict(GROUP=group, DK=dk, BT=CHUNK, HALF=half)
    # Each buffer is allocated just before the kernel that first writes it: an eager call starts
    # on an idle GPU, which waits for the host until the first long kernel is launched.
    gc = torch.empty((t, hv), dtype=torch.float32, device=dev)
    ks = torch.empty((t, hv), dtype=torch.float32, device=dev)
    x = torch.empty((t, hv, CHUNK), dtype=bdt, device=dev)
    bkc = max(16, min(LAUNCH["kkt_solve"]["bkc"], bk))
    _gdr_kkt_solve_kernel[(nc, hv)](
        k, g, beta, cu_seqlens, chunk_seq, chunk_start, gc, ks, x,
        k.stride(0), k.stride(1), g.stride(0), beta.stride(0), hv, BKC=bkc, L2NORM=l2norm, **meta,
        **launch_options("kkt_solve", half))
    w = torch.empty((t, hv, dk), dtype=bdt, device=dev)
    u = torch.empty((t, hv, dv), dtype=bdt, device=dev)
    a = torch.empty((t, hv, CHUNK), dtype=bdt, device=dev)
    qf = torch.empty((t, hv), dtype=torch.float32, device=dev)
    o = torch.empty((t, hv, dv), dtype=v.dtype, device=dev)
    bvw = min(triton.next_power_of_2(max(dk, dv, 16)), LAUNCH["wu"]["bv"])
    _gdr_wu_kernel[(nc, hv)](
        q, k, v, beta, cu_seqlens, chunk_seq, chunk_start, num_chunks, gc, ks, x, w, u, a, qf, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0),
        o.stride(0), o.stride(1), hv, t, n, dk ** -0.5,
        DV=dv, BV=bvw, L2NORM=l2norm, **meta, **launch_options("wu", half))
    # The walk is serial over chunks: split the v columns finer when (sequences x heads) alone
    # would leave SMs idle (one long prompt).
    pdv = triton.next_power_of_2(max(dv, 16))
    bv = min(pdv, LAUNCH["state"]["bv"])
    if dev.type == "cuda" and bv > 32 and n * hv * triton.cdiv(dv, bv) < num_sms(dev):
        bv = 32
    _gdr_state_kernel[(n, hv, triton.cdiv(dv, bv))](
        q, k, ks, gc, qf, a, w, u, states, slots, has_state, cu_seqlens, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), states.stride(0), states.stride(1),
        o.stride(0), o.stride(1), hv,
        GROUP=group, DK=dk, DV=dv, BK=bk, BV=bv, BT=CHUNK, HALF=half, STORE=store_state,
        **launch_options("state", half))
    return o
