"""y = x W^T (+ bias): a Triton GEMM whose every output row is bit-identical whatever M is and
whatever rows share its launch (deterministic mode's one GEMM family; fp32 reference beside).

Batch invariance by construction: no split-K across programs; each program owns a whole
BLOCK_M x BLOCK_N output tile and walks K from 0 upwards in BLOCK_K steps, accumulating in fp32
in that order (in fixed splits, below, each its own chain).
M only changes how many programs run (and in which order: grouped, so programs that run
together share W tiles in L2), never what one output element's reduction is: element (i, j)
is the same chain of tensor-core dot products, added in the same order, in the same compiled
kernel, whichever tile row i lands in. Rows and columns past M / N load clamped (valid,
repeated) rows, which are never stored.

The configuration (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, "tma"]) comes from
batch_invariant_gemm_configs.json per weight shape (N, K) and M range. A config ending in "tma"
loads its tiles through tensor descriptors (TMA on Hopper: one thread issues each tile's copy,
where pointer loads spend the MMA warps' issue slots on addresses and cp.async; out-of-range rows,
columns and the K tail arrive as zeros, the results are stored clipped), which from 512 rows
runs (with 128 x 256 tiles) 1.1-1.4x faster than the pointer kernel (benchmarks/RESULTS.md, H200). The math is
the same chain of dots: its bits are the pointer kernel's. Every config of
CANDIDATES gives the same bits (a row's chain does not depend on the tile it lands in: the GPU
tests compare each shipped shape's table configs and its skinny rows, and every candidate on one
shape; benchmarks/determinism.py --only gemm checks every option on every shape at every M it
times), so the table picks per M for speed alone. An entry
may also name "skinny" for M up to SKINNY_ROWS: ops.linear then runs the skinny CUDA kernel in
the same order (below), again the same bits. benchmarks/determinism.py measures both, with the
weights read from HBM as in a decode step, and proposes the table.

16-bit weights on the GPU sum in the skinny kernel's deterministic order (issue 39), so that where
the table names it (a few rows; at most SKINNY_ROWS) the skinny CUDA kernel (ops/gemm/skinny.py,
the splits as one block's warps, each warp a contiguous split) gives the same bits and batch 1
runs at its speed:
- K is cut into `splits_for(K)` splits at fixed positions (a multiple of 128 elements each,
  the same for every M); each split's chain starts from zero and the splits are added in order
  to a zero total, as the skinny kernel's warp reduction adds them.
- Inside a split the dot takes K in plain order: every tensor-core k16 step holds the products
  of 16 contiguous K elements, and so does each MMA of the skinny kernel's deterministic loader
  (csrc/skinny_weights.cuh Bf16DetW: one 16-byte load per thread, halves swapped between quad
  partners by two shuffles). On sm_90 a k16 step's result depends only on which products it
  holds, not on their k slots (mma.sync and wgmma alike, and the steps chain in K order in
  both), which the GPU test checks (tests/test_deterministic_gpu.py: the slot test, and rows at
  M 1-32 through the skinny kernel against the same rows at larger M through this one).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from minisgl.kernels.tile_order import clamped_tile, grouped_tile
from minisgl.logging_setup import log_once

try:  # host-side tensor descriptors came with Triton 3.4 (torch 2.8); older Triton runs TMA configs with pointer loads
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - the CI's Triton has them
    TensorDescriptor = None

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), or the same and TMA: loads through tensor descriptors
Config = tuple[int, int, int, int, int] | tuple[int, int, int, int, int, str]
TMA = "tma"
CONFIG_FILE = Path(__file__).with_name("batch_invariant_gemm_configs.json")
INTERPRETER_CONFIG: Config = (16, 16, 16, 1, 1)  # small tiles keep the CPU interpreter fast in CI
FLOAT32_CONFIG: Config = (64, 64, 32, 4, 3)  # ieee dots on FMA units
GROUP_M = 8
SPLIT_ALIGN = 128  # a split's K elements: a multiple of every skinny warp group (U * 32) and BLOCK_K
MIN_SPLIT_K = 512  # splits_for keeps every split at least this long (short chains slow this kernel)
MAX_SPLITS = 8  # the skinny kernel runs the splits as one block's warps (at most 8)
# What benchmarks/determinism.py times (and the GPU tests compare bit for bit).
CANDIDATES: list[Config] = [
    (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (64, 64, 64, 4, 4), (128, 256, 64, 8, 3), (64, 32, 64, 4, 4),
    (16, 64, 64, 4, 4), (128, 128, 128, 8, 3), (16, 32, 128, 4, 4), (16, 32, 64, 2, 6), (16, 64, 128, 4, 5),
    (32, 32, 128, 4, 4), (32, 64, 128, 4, 4), (32, 64, 64, 4, 5), (16, 128, 128, 4, 4), (64, 64, 128, 4, 4),
    (64, 128, 128, 8, 4), (32, 128, 64, 4, 4), (16, 32, 128, 2, 6), (32, 32, 64, 2, 6), (64, 32, 128, 4, 4),
    (128, 256, 64, 8, 3, TMA), (128, 128, 64, 8, 4, TMA), (128, 128, 128, 8, 3, TMA), (64, 128, 64, 4, 4, TMA),
    (128, 64, 64, 4, 4, TMA), (64, 64, 128, 4, 4, TMA), (64, 256, 64, 4, 3, TMA), (32, 64, 128, 4, 4, TMA),
    (16, 64, 128, 4, 5, TMA), (64, 32, 128, 4, 4, TMA),
]
SKINNY = "skinny"  # a table entry: the skinny kernel in this order (ops/gemm/dispatch.py), same bits
SKINNY_ROWS = 32  # the most rows the skinny kernel takes (ops/gemm/skinny.py MAX_M; a test checks)


@triton.jit
def _gemm_kernel(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, K_SPLIT,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP: tl.constexpr, DOT_PREC: tl.constexpr, SPLITS: tl.constexpr):
    offs_m, offs_n, rows, cols = clamped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP)
    offs_k = tl.arange(0, BLOCK_K)
    x_base = X + rows[:, None] * stride_xm + offs_k[None, :]
    w_base = W + cols[None, :] * stride_wn + offs_k[:, None]
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if EVEN_K:  # whole BLOCK_K steps in every split: one flat loop, so the loads stay pipelined across splits
        steps = K_SPLIT // BLOCK_K
        for i in range(0, SPLITS * steps):
            x = tl.load(x_base + i * BLOCK_K)
            w = tl.load(w_base + i * BLOCK_K)
            acc = tl.dot(x, w, acc, input_precision=DOT_PREC)
            if (i + 1) % steps == 0:  # a split ends: its chain joins the total (in split order), the next starts at 0
                total += acc
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:  # masked K tail (one split): zeros add nothing to the chain
        tl.static_assert(SPLITS == 1)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_base + k0, mask=(k0 + offs_k)[None, :] < K, other=0.0)
            w = tl.load(w_base + k0, mask=(k0 + offs_k)[:, None] < K, other=0.0)
            acc = tl.dot(x, w, acc, input_precision=DOT_PREC)
        total += acc
    if HAS_BIAS:
        total += tl.load(Bias + cols).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], total.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_tma_kernel(x_desc, w_desc, Bias, y_desc, M, N, K, K_SPLIT, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                     DOT_PREC: tl.constexpr, SPLITS: tl.constexpr):
    """_gemm_kernel's chain with its tiles loaded through tensor descriptors (zeros past M, N and K)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    om = pid_m * BLOCK_M
    on = pid_n * BLOCK_N
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # whole BLOCK_K steps in every split; else one split over a zero-filled tail (zeros add nothing)
    tl.static_assert(EVEN_K or SPLITS == 1)
    steps = K_SPLIT // BLOCK_K if EVEN_K else tl.cdiv(K, BLOCK_K)
    for i in range(0, SPLITS * steps):
        x = x_desc.load([om, i * BLOCK_K])
        w = w_desc.load([on, i * BLOCK_K])
        acc = tl.dot(x, w.T, acc, input_precision=DOT_PREC)
        if (i + 1) % steps == 0:  # a split ends: its chain joins the total (in split order), the next starts at 0
            total += acc
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if HAS_BIAS:
        offs_n = on + tl.arange(0, BLOCK_N)
        total += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_desc.store([om, on], total.to(y_desc.dtype))


@functools.cache  # the mode's dispatch asks per call
def splits_for(k: int, min_split: int = MIN_SPLIT_K) -> int:
    """The fixed K splits of a 16-bit weight with K columns in deterministic mode, for every M: doubled
    up to MAX_SPLITS while each split stays a whole multiple of SPLIT_ALIGN elements and at least
    `min_split` long. Up to 32 rows the skinny kernel runs them as the warps of one block (every
    warp a contiguous split), so they set its warps per block; here, each split is a chain whose
    pipeline refills, so fewer long splits are faster at large M (benchmarks/determinism.py).
    (The fused MoE folds its splits inside one loop: ops/gemm/skinny_moe.py passes its own minimum.)"""
    s = 1
    while 2 * s <= MAX_SPLITS and k % (2 * s * SPLIT_ALIGN) == 0 and k // (2 * s) >= min_split:
        s *= 2
    return s


@functools.cache
def _table() -> dict[str, list[tuple[int, Config | str]]]:
    raw = json.loads(CONFIG_FILE.read_text())["16bit"]
    table = {shape: [(int(m), c if c == SKINNY else tuple(c)) for m, c in entries] for shape, entries in raw.items()}
    for shape, entries in table.items():
        if not entries or entries[0][0] != 1 or any(a[0] >= b[0] for a, b in zip(entries, entries[1:])):
            raise ValueError(f"{CONFIG_FILE.name}: {shape} must list [min_m, config] from min_m 1 upwards")
        if any(c != SKINNY and not _is_config(c) for _, c in entries):
            raise ValueError(f"{CONFIG_FILE.name}: {shape}: a config is [BLOCK_M, BLOCK_N, BLOCK_K, warps, stages], "
                             f"optionally followed by \"{TMA}\", or \"{SKINNY}\"")
        if any(c == SKINNY and lo > SKINNY_ROWS for lo, c in entries) or _entry(entries, SKINNY_ROWS + 1) == SKINNY:
            raise ValueError(f"{CONFIG_FILE.name}: {shape}: \"{SKINNY}\" may cover at most {SKINNY_ROWS} rows; "
                             f"a Triton config must follow it by min_m {SKINNY_ROWS + 1}")
    return table  # type: ignore[return-value]


def _is_config(c: object) -> bool:
    """Five positive ints (the block sizes and warps powers of two, as Triton needs), optionally TMA."""
    return (isinstance(c, tuple) and len(c) in (5, 6) and all(type(v) is int and v > 0 for v in c[:5])
            and all(v & (v - 1) == 0 for v in c[:4]) and c[5:] in ((), (TMA,)))


def _entry(entries: list[tuple[int, Config | str]], m: int) -> Config | str:
    return [c for lo, c in entries if lo <= m][-1]


def configs_for(n: int, k: int) -> list[tuple[int, Config | str]]:
    """[(min_m, config or SKINNY)] of a 16-bit weight of shape (N, K) on the GPU, from min_m = 1 up."""
    table = _table()
    return table.get(f"{n}x{k}", table["default"])


def uses_skinny(n: int, k: int, m: int) -> bool:
    """Whether the table sends a 16-bit (N, K) GEMM of m rows to the skinny kernel (GPU)."""
    return _entry(configs_for(n, k), m) == SKINNY


def config_for(dtype: torch.dtype, device: torch.device, n: int = 0, k: int = 0, m: int = 1) -> Config:
    """This kernel's tile for m rows: the table's entry at m, or where that names the skinny
    kernel (which this kernel stands in for when called directly), the first config after it."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        return FLOAT32_CONFIG
    entries = configs_for(n, k)
    at = _entry(entries, m)
    return at if at != SKINNY else next(c for lo, c in entries if lo > m and c != SKINNY)  # type: ignore[return-value]


def skinny_splits(x: torch.Tensor) -> bool:
    """Whether `gemm` sums in the skinny kernel's splits by default: 16-bit on the GPU (the skinny
    kernel's dtypes; fp32 runs ieee dots on FMA units, and the CPU interpreter needs no match)."""
    return x.device.type == "cuda" and x.dtype in (torch.float16, torch.bfloat16)


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: Config | None = None, *, splits: int | None = None) -> torch.Tensor:
    """x [M, K] (unit column stride) @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype.
    splits defaults to splits_for(K) where skinny_splits(x), else 1; tests set it on the CPU."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    bm, bn, bk, warps, stages, *loads = config or config_for(x.dtype, x.device, n, k, m)
    if splits is None:
        splits = splits_for(k) if skinny_splits(x) else 1
    k_split = -(-k // splits)
    if splits > 1 and (k % splits or k_split % bk or k_split % SPLIT_ALIGN and x.device.type == "cuda"):
        raise ValueError(f"batch-invariant GEMM: K {k} in {splits} splits needs splits of a multiple of "
                         f"BLOCK_K {bk}" + (f" and of {SPLIT_ALIGN}" if x.device.type == "cuda" else ""))
    grid = (triton.cdiv(n, bn) * triton.cdiv(m, bm),)
    consts = dict(HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=GROUP_M,
                  DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", SPLITS=splits,
                  num_warps=warps, num_stages=stages)
    if loads == [TMA] and _descriptors_fit(x, weight, y):
        _gemm_tma_kernel[grid](
            TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
            bias if bias is not None else y, TensorDescriptor.from_tensor(y, [bm, bn]), m, n, k, k_split, **consts)
        return y
    _gemm_kernel[grid](
        x, weight, bias if bias is not None else y, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0), k_split,
        **consts)
    return y


def _descriptors_fit(*ts: torch.Tensor) -> bool:
    """Tensor descriptors need non-empty tensors with unit column strides and 16-byte aligned rows
    and bases; a tensor without them takes the pointer kernel in the same tile (the same bits), said once.
    So does every call where Triton predates host tensor descriptors (3.4)."""
    if TensorDescriptor is None:
        log_once("batch_invariant_gemm.no_descriptors", f"batch-invariant GEMM: Triton {triton.__version__} has no "
                 "host tensor descriptors (Triton 3.4+, torch 2.8+): the table's TMA tiles run with pointer loads "
                 "(same bits, up to 1.5x slower from 512 rows)")
        return False
    if all(min(t.shape) > 0 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
           and t.data_ptr() % 16 == 0 for t in ts):
        return True
    log_once("batch_invariant_gemm.unaligned", "batch-invariant GEMM: a TMA tile config met an empty tensor or rows "
             f"that are not 16-byte aligned (shapes {[tuple(t.shape) for t in ts]}, strides "
             f"{[t.stride() for t in ts]}); it runs with pointer loads (same bits, slower)")
    return False


def gemm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 math; returns fp32 [M, N]."""
    y = x.float() @ weight.float().T
    return y + bias.float() if bias is not None else y
