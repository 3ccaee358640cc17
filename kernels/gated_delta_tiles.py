"""Tile helpers shared by the Gated DeltaNet chunked prefill kernels (kernels/gated_delta_solve.py,
kernels/gated_delta_prefill.py): pointers and masks of a 2-D tile, masked loads and stores, dots
on 16-bit or exact fp32 operands, and inverse row norms."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, HALF: tl.constexpr, DT: tl.constexpr):
    """16-bit tensor-core operands for 16-bit inputs, exact fp32 otherwise."""
    if HALF:
        out = tl.dot(a.to(DT), b.to(DT))
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return out


@triton.jit
def _tile(P, rows, width, stride, row0, col0, BR: tl.constexpr, BC: tl.constexpr):
    """Pointers and mask of rows row0.. (below `rows`), columns col0.. (below `width`) of a
    row-major 2-D view whose rows are `stride` apart."""
    r = row0 + tl.arange(0, BR)
    cl = col0 + tl.arange(0, BC)
    return P + r.to(tl.int64)[:, None] * stride + cl[None, :], (r < rows)[:, None] & (cl < width)[None, :]


@triton.jit
def _ld(bp):
    return tl.load(bp[0], mask=bp[1], other=0.0)


@triton.jit
def _st(bp, x):
    tl.store(bp[0], x.to(bp[0].dtype.element_ty), mask=bp[1])


@triton.jit
def _rnorm(sq, ENABLE: tl.constexpr):
    """1 / |row| from the rows' summed squares (1 when not normalising): the kernels scale dot
    products and small tiles by it instead of normalising the 16-bit operands."""
    if ENABLE:
        out = tl.rsqrt(sq + 1e-6)
    else:
        out = tl.full(sq.shape, 1.0, tl.float32)
    return out
