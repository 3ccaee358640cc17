"""A probe kernel for test_deterministic.py: the batch-invariant GEMM's in-register skinny order
applied to tiles holding their own K offsets (a module of its own: a jit function defined inside a
test cannot see the test's imports in the interpreter)."""

import triton
import triton.language as tl

from minisgl.kernels.batch_invariant_gemm import _skinny_offsets, _skinny_perm_w, _skinny_perm_x


@triton.jit
def skinny_order_probe(OutX, OutW, OutG, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """OutX [ROWS, BLOCK_K]: x tile rows after _skinny_perm_x; OutW [BLOCK_K, ROWS]: w tile
    columns after _skinny_perm_w; each element the K offset it came from. OutG [BLOCK_K]: the
    offsets the gathering variant loads (_skinny_offsets)."""
    r = tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_K)
    x = tl.zeros([ROWS, BLOCK_K], tl.int32) + k[None, :]
    tl.store(OutX + r[:, None] * BLOCK_K + k[None, :], _skinny_perm_x(x, ROWS, BLOCK_K))
    w = tl.zeros([BLOCK_K, ROWS], tl.int32) + k[:, None]
    tl.store(OutW + k[:, None] * ROWS + r[None, :], _skinny_perm_w(w, BLOCK_K, ROWS))
    tl.store(OutG + k, _skinny_offsets(BLOCK_K))
