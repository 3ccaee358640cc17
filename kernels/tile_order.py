"""The launch order the tiled GEMM kernels share (kernels/fused_moe.py, w4a16_gemm.py, fp8_gemm.py,
batch_invariant_gemm.py): program ids mapped to output tiles in groups of rows."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid`: GROUP_M consecutive row tiles sweep the column
    tiles together, so each column tile (a weight tile) is reused from L2 while it is there.
    Only the order changes, never a tile's result."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m
