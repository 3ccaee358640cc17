"""The first Gated DeltaNet chunked prefill kernel (the others and the wrapper that launches them:
kernels/gated_delta_prefill.py): per (chunk of 64, v-head), the cumulative log decays, the keys'
inverse norms, L = strictly_lower(beta_i (k_i . k_j) exp(c_i - c_j)) in ten 16 x 16 blocks and
X = (I + L)^-1 in registers."""

from __future__ import annotations

import triton
import triton.language as tl

from minisgl.kernels.chunk_table import _chunk
from minisgl.kernels.gated_delta_tiles import _dot, _ld, _rnorm, _st, _tile


@triton.jit
def _dot32(a, b, HALF: tl.constexpr):
    """fp32 operands: tf32 for 16-bit inputs (X's entries need more than 8 mantissa bits)."""
    if HALF:
        out = tl.dot(a, b, input_precision="tf32")
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def _sub(G, Beta, tok0, end, h, sg_t, sb_t, carry, GC, KS, HV, n2, L2NORM: tl.constexpr):
    """A 16-token block's cumulative log decays (continuing `carry`), beta, and the keys' inverse
    norms from their summed squares `n2`; stores the decays and the norms for the later kernels."""
    tok = tok0 + tl.arange(0, 16)
    mt = tok < end
    tok64 = tok.to(tl.int64)
    g = tl.load(G + tok64 * sg_t + h, mask=mt, other=0.0).to(tl.float32)
    gc = tl.cumsum(g, axis=0) + carry
    beta = tl.load(Beta + tok64 * sb_t + h, mask=mt, other=0.0).to(tl.float32)
    ks = _rnorm(n2, L2NORM)
    tl.store(GC + tok64 * HV + h, gc, mask=mt)
    tl.store(KS + tok64 * HV + h, ks, mask=mt)
    return gc, beta, ks, carry + tl.sum(g, axis=0)


@triton.jit
def _scale(a, gi, bi, ki, gj, kj, DIAG: tl.constexpr):
    """Block (i, j) of L from the raw keys' dot products: beta_i k_i.k_j exp(c_i - c_j) with the
    keys' norms applied; a diagonal block keeps its strictly lower part."""
    r, c = tl.arange(0, 16)[:, None], tl.arange(0, 16)[None, :]
    if DIAG:
        # exp only where the row is after the column (c_i - c_j <= 0): elsewhere it could overflow
        a = tl.where(r > c, a * tl.exp(tl.where(r > c, gi[:, None] - gj[None, :], float("-inf"))), 0.0)
    else:
        a = a * tl.exp(gi[:, None] - gj[None, :])  # every row after every column
    return a * (bi * ki)[:, None] * kj[None, :]


@triton.jit
def _inv16(L):
    """(I + L)^-1 of a strictly lower 16 x 16 block by forward substitution in registers: row i
    of Y = X - I is -L_i - sum_{j<i} L_ij Y_j. With one or two warps the row extraction and the
    column sums stay within a warp (shuffles); with 8 warps this spilled (RESULTS.md)."""
    r = tl.arange(0, 16)
    y = -L
    for i in range(2, 16):
        a = -tl.sum(tl.where(r[:, None] == i, L, 0.0), axis=0)
        a = a + tl.sum(a[:, None] * y, axis=0)
        y = tl.where(r[:, None] == i, a[None, :], y)
    return y + tl.where(r[:, None] == r[None, :], 1.0, 0.0)


@triton.jit
def _kt(K, tok0, end, hk, sk_t, sk_h, k0, DK: tl.constexpr, BKC: tl.constexpr):
    return _ld(_tile(K + hk * sk_h, end, DK, sk_t, tok0, k0, 16, BKC))


@triton.jit
def _xst(X, x, tok0, end, h, HV, col0, BT: tl.constexpr):
    _st(_tile(X + h * BT, end, BT, HV * BT, tok0, col0, 16, 16), x)


@triton.jit
def _gdr_kkt_solve_kernel(
    K, G, Beta, Cu, ChunkSeq, ChunkStart, GC, KS, X,
    sk_t, sk_h, sg_t, sb_t, HV,
    GROUP: tl.constexpr, DK: tl.constexpr, BKC: tl.constexpr, BT: tl.constexpr, L2NORM: tl.constexpr,
    HALF: tl.constexpr,
):
    """Per (chunk, v-head): c = cumsum(g), the keys' inverse norms, L = strictly_lower(beta_i
    (k_i . k_j) exp(c_i - c_j)) in ten 16 x 16 blocks (raw-key dots over d_k in BKC columns,
    norms applied after), and X = (I + L)^-1: the diagonal blocks by substitution, then
    X_ij = -X_ii sum_{j<=m<i} L_im X_mj. Writes X's lower blocks (the W/U kernel masks the rest)."""
    c, h = tl.program_id(0), tl.program_id(1)
    seq, s0, _, _, end = _chunk(ChunkSeq, ChunkStart, Cu, c, BT)
    if seq < 0:
        return
    hk = h // GROUP
    s1, s2, s3 = s0 + 16, s0 + 32, s0 + 48
    DT = K.dtype.element_ty
    z = tl.zeros((16, 16), dtype=tl.float32)
    A00, A11, A22, A33, A10, A20, A21, A30, A31, A32 = z, z, z, z, z, z, z, z, z, z
    zn = tl.zeros((16,), dtype=tl.float32)
    n0, n1, n2, n3 = zn, zn, zn, zn
    for k0 in range(0, DK, BKC):
        k_0 = _kt(K, s0, end, hk, sk_t, sk_h, k0, DK, BKC)
        k_1 = _kt(K, s1, end, hk, sk_t, sk_h, k0, DK, BKC)
        k_2 = _kt(K, s2, end, hk, sk_t, sk_h, k0, DK, BKC)
        k_3 = _kt(K, s3, end, hk, sk_t, sk_h, k0, DK, BKC)
        A00 += _dot(k_0, tl.trans(k_0), HALF, DT)
        A11 += _dot(k_1, tl.trans(k_1), HALF, DT)
        A22 += _dot(k_2, tl.trans(k_2), HALF, DT)
        A33 += _dot(k_3, tl.trans(k_3), HALF, DT)
        A10 += _dot(k_1, tl.trans(k_0), HALF, DT)
        A20 += _dot(k_2, tl.trans(k_0), HALF, DT)
        A21 += _dot(k_2, tl.trans(k_1), HALF, DT)
        A30 += _dot(k_3, tl.trans(k_0), HALF, DT)
        A31 += _dot(k_3, tl.trans(k_1), HALF, DT)
        A32 += _dot(k_3, tl.trans(k_2), HALF, DT)
        if L2NORM:
            n0 += tl.sum(k_0.to(tl.float32) * k_0.to(tl.float32), axis=1)
            n1 += tl.sum(k_1.to(tl.float32) * k_1.to(tl.float32), axis=1)
            n2 += tl.sum(k_2.to(tl.float32) * k_2.to(tl.float32), axis=1)
            n3 += tl.sum(k_3.to(tl.float32) * k_3.to(tl.float32), axis=1)
    g0, b0, ks0, cy = _sub(G, Beta, s0, end, h, sg_t, sb_t, 0.0, GC, KS, HV, n0, L2NORM)
    g1, b1, ks1, cy = _sub(G, Beta, s1, end, h, sg_t, sb_t, cy, GC, KS, HV, n1, L2NORM)
    g2, b2, ks2, cy = _sub(G, Beta, s2, end, h, sg_t, sb_t, cy, GC, KS, HV, n2, L2NORM)
    g3, b3, ks3, cy = _sub(G, Beta, s3, end, h, sg_t, sb_t, cy, GC, KS, HV, n3, L2NORM)
    X00 = _inv16(_scale(A00, g0, b0, ks0, g0, ks0, True))
    X11 = _inv16(_scale(A11, g1, b1, ks1, g1, ks1, True))
    X22 = _inv16(_scale(A22, g2, b2, ks2, g2, ks2, True))
    X33 = _inv16(_scale(A33, g3, b3, ks3, g3, ks3, True))
    L10 = _scale(A10, g1, b1, ks1, g0, ks0, False)
    L20, L21 = _scale(A20, g2, b2, ks2, g0, ks0, False), _scale(A21, g2, b2, ks2, g1, ks1, False)
    L30, L31 = _scale(A30, g3, b3, ks3, g0, ks0, False), _scale(A31, g3, b3, ks3, g1, ks1, False)
    L32 = _scale(A32, g3, b3, ks3, g2, ks2, False)
    X10 = -_dot32(X11, _dot32(L10, X00, HALF), HALF)
    X21 = -_dot32(X22, _dot32(L21, X11, HALF), HALF)
    X20 = -_dot32(X22, _dot32(L20, X00, HALF) + _dot32(L21, X10, HALF), HALF)
    X32 = -_dot32(X33, _dot32(L32, X22, HALF), HALF)
    X31 = -_dot32(X33, _dot32(L31, X11, HALF) + _dot32(L32, X21, HALF), HALF)
    X30 = -_dot32(X33, _dot32(L30, X00, HALF) + _dot32(L31, X10, HALF) + _dot32(L32, X20, HALF), HALF)
    _xst(X, X00, s0, end, h, HV, 0, BT)
    _xst(X, X10, s1, end, h, HV, 0, BT)
    _xst(X, X11, s1, end, h, HV, 16, BT)
    _xst(X, X20, s2, end, h, HV, 0, BT)
    _xst(X, X21, s2, end, h, HV, 16, BT)
    _xst(X, X22, s2, end, h, HV, 32, BT)
    _xst(X, X30, s3, end, h, HV, 0, BT)
    _xst(X, X31, s3, end, h, HV, 16, BT)
    _xst(X, X32, s3, end, h, HV, 32, BT)
    _xst(X, X33, s3, end, h, HV, 48, BT)
