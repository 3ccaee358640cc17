"""Deterministic mode's attention: one launch configuration of the extend kernel for prefill,
extend and decode alike (GQA-packed tiles, keys in fixed splits), a one-warp tile with the same
bits for decode steps of DECODE_TILE_MIN_BATCH requests or more, and the split decode.

Every step runs kernels/extend_attention.py with one (BLOCK_M, BLOCK_N, warps, stages) (or the
decode tile, whose rows get the same bits), GQA packing and SPLIT: a query's keys are walked in
BLOCK_N chunks at fixed absolute positions, grouped in splits of SPLIT keys (also at fixed
positions), each split from a fresh (m, l, acc) state, and the splits folded in order by
`fold_split`. What a query's row computes therefore depends only on its own q and keys, never
on the batch, the tile it sits in, or the launch.

A decode step (one program per head group and request would walk all of a long context alone)
runs the same splits in parallel instead, up to a workspace bound: the extend kernel in PARTIAL
mode writes each split's (acc, m, l) to a workspace (without a window a program walks the key
blocks of its splits in one loop, restarting the state at each split's first block: a loop per
split is two blocks long at the GPU's 128-key splits of 64-key blocks, too short for the loads
to run ahead), and `_combine_kernel` folds them in the same order with the same `fold_split`
(explicit FMAs, so no compiler contraction choice can differ): the same bits as the sequential
fold (tests/test_deterministic_gpu.py). The number of splits depends on the context length
alone; the grid on the batch size and the max_seq_len bound (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.attention_blocks import fold_split, with_sink
from minisgl.kernels.device import dependent_launch, gdc_launch_dependents
from minisgl.kernels.extend_attention import default_config, launch

# (BLOCK_M, BLOCK_N, num_warps, num_stages) for every step of the mode. Any fixed choice is
# batch-invariant (one compiled kernel for every step); the choice is speed only:
# benchmarks/determinism.py --only attention times these; the first is the one in use.
# Why prefill keeps one config (H200, eighteenth session): two configs give a row the same bits
# only when their compiled QK^T MMA layouts split a row's keys over the same number of warps
# (wgmma at 64 rows and 4 warps: none; mma.sync at 16 rows and 4 warps: four), and which layout
# Triton picks depends on the head dim too (at head dim 32, (32, 64, 4, 2) splits none, at 128
# four). A one-warp tile splits none at every head dim: DECODE_TILE below.
DETERMINISTIC_CONFIGS: list[tuple[int, int, int, int]] = [
    (64, 64, 4, 2), (32, 64, 4, 2), (16, 64, 4, 2), (64, 128, 4, 2), (32, 128, 4, 2), (128, 128, 8, 3),
]
# Decode steps of at least DECODE_TILE_MIN_BATCH requests take a one-warp 16-row tile: one warp
# holds a row's keys there (mma.sync's warpsPerCTA [1, 1]) as in config 0 (wgmma's [4, 1]), so a
# token gets the same bits (tests/test_deterministic_gpu.py; the H200's probe of (16, 64, 1, s)
# against config 0 found them equal in 12 of 12 cases, the 2- and 4-warp 16/32-row tiles not).
# A decode step's rows are its few heads, so the small tile wastes less of each MMA: 10-12% faster
# at batches 8-256; below 8 the 4-warp tile is faster (H200, nineteenth session).
DECODE_TILE = (16, 64, 1, 3)
DECODE_TILE_MIN_BATCH = 8
SPLIT = 128  # keys per split on the GPU (a multiple of every candidate's BLOCK_N)
INTERPRETER_SPLIT = 64  # small, so CPU tests fold several splits
SPLIT_DECODE_WARPS = 4096  # about this many warps share a split decode's splits
# Decode steps run the splits in parallel (faster than one program walking a request's keys at
# every batch measured, 16 to 256, with 256-key splits; H200, eighteenth session; the 128-key
# splits were measured end to end only) unless the fp32 partials' workspace, sized by the step's
# max_seq_len bound (a CUDA graph's: the context length), would pass this. The engine keeps it
# out of the KV budget (ops.deterministic_decode_workspace_bytes).
SPLIT_DECODE_WORKSPACE_BYTES = 512 << 20


def heads_per_tile(group: int, block_m: int) -> int:
    """Query heads of one KV group a packed tile holds: the largest divisor of the group that
    fits the tile (so a tile never spans two KV groups)."""
    return max(h for h in range(1, min(group, block_m) + 1) if group % h == 0)


def deterministic_config(head_dim: int, dtype: torch.dtype, device: torch.device, group: int,
                         decode_batch: int = 0) -> tuple[tuple[int, ...], int, int]:
    """(config, heads per tile, split) of deterministic mode; `decode_batch`: a decode step's
    request count (0: not a decode step). fp32 and the interpreter keep their default tiles (the
    mode's invariance does not depend on which fixed config it is)."""
    cfg = default_config(head_dim, dtype, device)
    if device.type == "cuda" and dtype != torch.float32 and head_dim <= 128:
        cfg = DECODE_TILE if decode_batch >= DECODE_TILE_MIN_BATCH else DETERMINISTIC_CONFIGS[0]
    split = SPLIT if device.type == "cuda" else INTERPRETER_SPLIT
    return cfg, heads_per_tile(group, cfg[0]), split


@triton.jit
def _combine_kernel(PartAcc, PartML, Out, SeqLens, Sinks, v_scale, stride_ot, stride_oh, num_splits, window,
                    SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
                    WINDOWED: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the o_proj skinny GEMM may launch now (it waits before reading Out)
        gdc_launch_dependents()
    # Program (b, h): request b's token, q head h; its splits 0 .. ceil(seq / SPLIT) - 1 (with a
    # window, from the split of its first key: the ones below hold no seen key, and the kernel
    # wrote no partial there; folding them would change no bit).
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(SeqLens + b)
    n = tl.cdiv(seq, SPLIT)
    if n == 0:  # a padding request of a graph bucket
        return
    first = 0
    if WINDOWED:
        first = tl.maximum(seq - window, 0) // SPLIT
    base = ((b * tl.num_programs(1) + h) * num_splits).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    one = tl.arange(0, 1)
    acc = tl.load(PartAcc + (base + first) * BLOCK_D + offs_d[None, :])
    m_i = tl.load(PartML + 2 * (base + first) + one)
    l_i = tl.load(PartML + 2 * (base + first) + 1 + one)
    for s in range(first + 1, n):
        acc_p = tl.load(PartAcc + (base + s) * BLOCK_D + offs_d[None, :])
        m_p = tl.load(PartML + 2 * (base + s) + one)
        l_p = tl.load(PartML + 2 * (base + s) + 1 + one)
        acc, m_i, l_i = fold_split(acc, m_i, l_i, acc_p, m_p, l_p)
    if HAS_SINKS:  # as the extend kernel's last lines
        acc, l_i = with_sink(acc, m_i, l_i, tl.load(Sinks + h + one))
    out = acc * (v_scale / l_i)[:, None]
    o_ptrs = Out + b.to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_d[None, :] < HEAD_DIM)


def split_decode_workspace(batch: int, num_q_heads: int, head_dim: int, max_seq_len: int, split: int) -> int:
    """Bytes of `split_decode`'s fp32 partials (acc, m, l per split) for this decode step."""
    return batch * num_q_heads * triton.cdiv(max_seq_len, split) * (triton.next_power_of_2(head_dim) + 2) * 4


def use_split_decode(batch: int, num_q_heads: int, head_dim: int, max_seq_len: int, split: int) -> bool:
    """Whether a decode step runs its splits in parallel (the same bits either way)."""
    return split_decode_workspace(batch, num_q_heads, head_dim, max_seq_len, split) <= SPLIT_DECODE_WORKSPACE_BYTES


def split_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_slot: torch.Tensor,
                 req_rows: torch.Tensor, prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, tiles: torch.Tensor, max_seq_len: int, scale: float,
                 config: tuple[int, ...], heads: int, split: int, out: torch.Tensor | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step (q [B, Hq, D], one token per request; `tiles` one per request, from
    `tile_map`) with the splits in parallel; the same bits as `extend_attention(...,
    split=split)` for these tokens. max_seq_len bounds every seq_lens[b] (the workspace size).
    window / sinks as the extend kernel's (the splits below a window hold no seen key: neither the
    kernel nor the combine visits them, the same bits as folding their empty partials)."""
    b, hq, d = q.shape
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    num_splits = triton.cdiv(max_seq_len, split)
    block_d = triton.next_power_of_2(d)
    part_acc = torch.empty((b, hq, num_splits, block_d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((b, hq, num_splits, 2), dtype=torch.float32, device=q.device)
    programs = SPLIT_DECODE_WARPS // config[2]
    per_split = min(num_splits, max(1, programs // (hq // heads * tiles.shape[0])))
    launch((hq // heads, tiles.shape[0], per_split), q, k_cache, v_cache, out, req_to_slot, req_rows, prefix_lens,
           cu_seqlens_q, tiles, scale, config, heads, split, (part_acc, part_ml), k_scale, v_scale, window, sinks)
    _combine_kernel[(b, hq)](part_acc, part_ml, out, seq_lens, part_ml if sinks is None else sinks, v_scale,
                             out.stride(0), out.stride(1), num_splits, window, SPLIT=split, HEAD_DIM=d,
                             BLOCK_D=block_d, HAS_SINKS=sinks is not None, WINDOWED=window > 0,
                             PDL=dependent_launch(q), num_warps=4)
    return out
