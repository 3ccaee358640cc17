"""Gated DeltaNet chunked prefill in Triton (maths, layouts and the recurrent reference it is
tested against: kernels/gated_delta_rule.py).

Chunked prefill (chunks of 64 tokens, the WY / UT-transform form). Within a chunk with
cumulative log decay c_i, L = strictly_lower(beta_i (k_i.k_j) exp(c_i - c_j)); with
X = (I + L)^-1 (forward substitution), W = X (beta k exp(c)) and U = X (beta v) hold the
chunk's delta-rule corrections, so per chunk with S_c the state at its start:  v' = U - W S_c;
o = (q exp(c)) S_c + lower_incl_diag((q k^T) exp(c_i - c_j)) v';
S_{c+1} = S_c exp(c_last) + (k exp(c_last - c))^T v'.
Four kernels (flash-linear-attention's decomposition), split where the work turns serial: per
(chunk, v-head) L and X (kernels/gated_delta_solve.py), then W and U; per (sequence, v-head,
v-block) the only serial kernel, a walk over the chunks storing each S_c and v' (two small dots
per chunk); per (chunk, v-head, v-block) the outputs. (The first version did the outputs inside
the walk and built X, W, U in one kernel holding ~20 16 x 16 tiles, which spilled: 48 ms vs
FLA's 2.4 ms at 32k tokens on the H100; this split 2.4-2.6 ms, RESULTS.md.) q/k normalisation
scales the dot products (the raw 16-bit keys feed the tensor cores). Nothing reads host values
(kernels/chunk_table.py), so it is capturable. With 16-bit inputs the buffers between kernels
(X, W, U, S_c, v') are 16-bit and the dots take 16-bit operands (fp32 accumulation), as FLA's
do; fp32 inputs keep fp32 ("ieee").
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
    K, V, Beta, Cu, ChunkSeq, ChunkStart, GC, KS, X, W, U,
    sk_t, sk_h, sv_t, sv_h, sb_t, HV,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    HALF: tl.constexpr,
):
    """Per (chunk, v-head): W = X (beta k exp(c)) and U = X (beta v), the row factors folded
    into X's columns and the columns of W and U made BV at a time."""
    c, h = tl.program_id(0), tl.program_id(1)
    seq, s0, tok, mt, end = _chunk(ChunkSeq, ChunkStart, Cu, c, BT)
    if seq < 0:
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
    xk = x * (beta * ks * tl.exp(gc))[None, :]
    for k0 in range(0, DK, BV):
        k = _ld(_tile(K + (h // GROUP) * sk_h, end, DK, sk_t, s0, k0, BT, BV))
        _st(_tile(W + h * DK, end, DK, HV * DK, s0, k0, BT, BV), _dot(xk, k, HALF, DT))
    xv = x * beta[None, :]
    for v0 in range(0, DV, BV):
        v = _ld(_tile(V + h * sv_h, end, DV, sv_t, s0, v0, BT, BV))
        _st(_tile(U + h * DV, end, DV, HV * DV, s0, v0, BT, BV), _dot(xv, v, HALF, DT))


@triton.jit
def _gdr_state_kernel(
    K, GC, KS, W, U, S, Slots, HasState, Cu, ChunkFirst, H, VN,
    sk_t, sk_h, ss_s, ss_h, HV,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, HALF: tl.constexpr, STORE: tl.constexpr,
):
    """Per (sequence, v-head, v-block), chunk after chunk: writes the state at each chunk's start
    S_c to H and v' = U - W S_c to VN, then S <- S exp(c_last) + k^T (v' k_scale exp(c_last - c)).
    S is held as two halves of d_k rows (smaller tiles: the whole [128, BV] state with the
    chunk's [64, 128] operands spilled)."""
    n, h, pv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BKH: tl.constexpr = BK // 2
    start, end = tl.load(Cu + n), tl.load(Cu + n + 1)
    first = tl.load(ChunkFirst + n).to(tl.int64)
    slot = tl.load(Slots + n).to(tl.int64)
    read = (slot >= 0) & (tl.load(HasState + n) != 0)
    v0 = pv * BV
    # a fresh sequence or a padding row (negative slot) reads no row: its limit drops to 0
    sbase = S + slot * ss_s + h * ss_h
    s1 = _ld(_tile(sbase, tl.where(read, DK, 0), DV, DV, 0, v0, BKH, BV))
    s2 = _ld(_tile(sbase, tl.where(read, DK, 0), DV, DV, BKH, v0, BKH, BV))
    DT = K.dtype.element_ty
    kbase = K + (h // GROUP) * sk_h
    for cs in range(start, end, BT):
        hbase = H + ((first + (cs - start) // BT) * HV + h) * DK * DV
        _st(_tile(hbase, DK, DV, DV, 0, v0, BKH, BV), s1)
        _st(_tile(hbase, DK, DV, DV, BKH, v0, BKH, BV), s2)
        u = _ld(_tile(U + h * DV, end, DV, HV * DV, cs, v0, BT, BV)).to(tl.float32)
        w1 = _ld(_tile(W + h * DK, end, DK, HV * DK, cs, 0, BT, BKH))
        w2 = _ld(_tile(W + h * DK, end, DK, HV * DK, cs, BKH, BT, BKH))
        vn = u - _dot(w1, s1, HALF, DT) - _dot(w2, s2, HALF, DT)
        _st(_tile(VN + h * DV, end, DV, HV * DV, cs, v0, BT, BV), vn)
        tok = cs + tl.arange(0, BT)
        tok64 = tok.to(tl.int64)
        gc = tl.load(GC + tok64 * HV + h, mask=tok < end, other=0.0)
        ks = tl.load(KS + tok64 * HV + h, mask=tok < end, other=0.0)
        glast = tl.load(GC + (tl.minimum(end, cs + BT) - 1).to(tl.int64) * HV + h)
        vn = vn * (ks * tl.exp(glast - gc))[:, None]
        k1 = _ld(_tile(kbase, end, DK, sk_t, cs, 0, BT, BKH))
        k2 = _ld(_tile(kbase, end, DK, sk_t, cs, BKH, BT, BKH))
        s1 = s1 * tl.exp(glast) + _dot(tl.trans(k1), vn, HALF, DT)
        s2 = s2 * tl.exp(glast) + _dot(tl.trans(k2), vn, HALF, DT)
    if STORE:
        _st(_tile(sbase, tl.where(slot >= 0, DK, 0), DV, DV, 0, v0, BKH, BV), s1)
        _st(_tile(sbase, tl.where(slot >= 0, DK, 0), DV, DV, BKH, v0, BKH, BV), s2)


@triton.jit
def _gdr_out_kernel(
    Q, K, GC, KS, H, VN, Cu, ChunkSeq, ChunkStart, NumChunks, O,
    sq_t, sq_h, sk_t, sk_h, so_t, so_h, HV, T, N, scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, L2NORM: tl.constexpr, HALF: tl.constexpr,
):
    """Per (chunk, v-head, v-block): o = (q exp(c)) S_c + lower_incl_diag((q k^T) exp(c_i - c_j)) v',
    q and k normalised by scaling the dots' rows and columns. A program past the last chunk
    writes zeros over BT tokens of the padding past cu_seqlens[N] (a graph bucket's): the
    table has enough spare entries to cover it."""
    c, h, pv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq, s0, tok, mt, end = _chunk(ChunkSeq, ChunkStart, Cu, c, BT)
    if seq < 0:
        pad0 = tl.load(Cu + N) + (c - tl.load(NumChunks)) * BT
        _st(_tile(O + h * so_h, T, DV, so_t, pad0, pv * BV, BT, BV), tl.zeros((BT, BV), dtype=tl.float32))
        return
    DT = Q.dtype.element_ty
    hk = h // GROUP
    q = _ld(_tile(Q + hk * sq_h, end, DK, sq_t, s0, 0, BT, BK))
    k = _ld(_tile(K + hk * sk_h, end, DK, sk_t, s0, 0, BT, BK))
    tok64 = tok.to(tl.int64)
    gc = tl.load(GC + tok64 * HV + h, mask=mt, other=0.0)
    ks = tl.load(KS + tok64 * HV + h, mask=mt, other=0.0)
    qf = q.to(tl.float32)
    qs = _rnorm(tl.sum(qf * qf, axis=1), L2NORM) * scale
    s = _ld(_tile(H + (c.to(tl.int64) * HV + h) * DK * DV, DK, DV, DV, 0, pv * BV, BK, BV))
    vn = _ld(_tile(VN + h * DV, end, DV, HV * DV, s0, pv * BV, BT, BV))
    r, cl = tl.arange(0, BT)[:, None], tl.arange(0, BT)[None, :]
    qk = _dot(q, tl.trans(k), HALF, DT)
    decay = tl.exp(tl.where(r >= cl, gc[:, None] - gc[None, :], float("-inf")))
    attn = tl.where(r >= cl, qk * ks[None, :] * decay, 0.0)
    o = (_dot(q, s, HALF, DT) * tl.exp(gc)[:, None] + _dot(attn, vn, HALF, DT)) * qs[:, None]
    _st(_tile(O + h * so_h, end, DV, so_t, s0, pv * BV, BT, BV), o)


# Per kernel: num_warps / num_stages and tile widths ("bv", "bkc"), chosen on the H100 by
# `benchmarks/kernels/gated_delta_rule.py --sweep` (RESULTS.md), which alone edits this table.
# The outputs stay one stage with separate dots: with Triton 3.6 on the H100 a pipelined d_k loop
# gave wrong outputs and accumulating dots (tl.dot(a, b, acc)) failed the fp16 verify test and
# bf16 MTP (RESULTS.md, tenth session). Check the benchmark's max|diff| column after any change.
LAUNCH = {
    "kkt_solve": {"num_warps": 1, "bkc": 64},
    "wu": {"num_warps": 4, "num_stages": 3, "bv": 64},
    "state": {"num_warps": 4, "num_stages": 3, "bv": 64},
    "out": {"num_warps": 4, "bv": 128},
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
    o = torch.empty((t, hv, dv), dtype=v.dtype, device=v.device)
    if n == 0:
        return o.zero_()
    dev = q.device
    half = q.dtype != torch.float32
    bdt = q.dtype if half else torch.float32  # the buffers between kernels
    chunk_seq, chunk_start, chunk_first, num_chunks = chunks if chunks is not None else chunk_table(cu_seqlens, t,
                                                                                                    CHUNK)
    nc = chunk_seq.numel()
    gc = torch.empty((t, hv), dtype=torch.float32, device=dev)
    ks = torch.empty((t, hv), dtype=torch.float32, device=dev)
    x = torch.empty((t, hv, CHUNK), dtype=bdt, device=dev)
    w = torch.empty((t, hv, dk), dtype=bdt, device=dev)
    u = torch.empty((t, hv, dv), dtype=bdt, device=dev)
    vn = torch.empty((t, hv, dv), dtype=bdt, device=dev)
    h_all = torch.empty((nc, hv, dk, dv), dtype=bdt, device=dev)
    group = hv // hk
    meta = dict(GROUP=group, DK=dk, BT=CHUNK, HALF=half)
    bkc = max(16, min(LAUNCH["kkt_solve"]["bkc"], bk))
    _gdr_kkt_solve_kernel[(nc, hv)](
        k, g, beta, cu_seqlens, chunk_seq, chunk_start, gc, ks, x,
        k.stride(0), k.stride(1), g.stride(0), beta.stride(0), hv, BKC=bkc, L2NORM=l2norm, **meta,
        **launch_options("kkt_solve", half))
    bvw = min(triton.next_power_of_2(max(dk, dv, 16)), LAUNCH["wu"]["bv"])
    _gdr_wu_kernel[(nc, hv)](
        k, v, beta, cu_seqlens, chunk_seq, chunk_start, gc, ks, x, w, u,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0), hv,
        GROUP=group, DK=dk, DV=dv, BV=bvw, BT=CHUNK, HALF=half, **launch_options("wu", half))
    # The walk is serial over chunks: split the v columns finer when (sequences x heads) alone
    # would leave SMs idle (one long prompt).
    pdv = triton.next_power_of_2(max(dv, 16))
    bv = min(pdv, LAUNCH["state"]["bv"])
    if dev.type == "cuda" and bv > 32 and n * hv * triton.cdiv(dv, bv) < num_sms(dev):
        bv = 32
    _gdr_state_kernel[(n, hv, triton.cdiv(dv, bv))](
        k, gc, ks, w, u, states, slots, has_state, cu_seqlens, chunk_first, h_all, vn,
        k.stride(0), k.stride(1), states.stride(0), states.stride(1), hv,
        GROUP=group, DK=dk, DV=dv, BK=bk, BV=bv, BT=CHUNK, HALF=half, STORE=store_state,
        **launch_options("state", half))
    bvo = min(pdv, LAUNCH["out"]["bv"])
    _gdr_out_kernel[(nc, hv, triton.cdiv(dv, bvo))](
        q, k, gc, ks, h_all, vn, cu_seqlens, chunk_seq, chunk_start, num_chunks, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), o.stride(0), o.stride(1), hv, t, n, dk ** -0.5,
        BK=bk, DV=dv, BV=bvo, L2NORM=l2norm, **meta, **launch_options("out", half))
    return o
