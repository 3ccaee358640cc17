"""The launch order the tiled GEMM kernels share (kernels/fused_moe.py, w4a16_gemm.py, fp8_gemm.py,
batch_invariant_gemm.py, batch_invariant_fp8.py): program ids mapped to output tiles in groups of rows."""

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


@triton.jit
def clamped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program `pid`'s output tile of an [M, N] result in grouped order: (offs_m, offs_n, rows, cols),
    where rows and cols are the offsets clamped into range (int64): loads through them need no masks
    (the repeated rows and columns are never stored)."""
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, (offs_m % M).to(tl.int64), (offs_n % N).to(tl.int64)
