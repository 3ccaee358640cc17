"""4-bit routed experts of tens of tokens on the skinny GEMM kernel, grouped by expert
(csrc/skinny_moe.cuh skinny_moe_grouped_kernel).

Past skinny_moe.MAX_TOKENS the per-pair kernel reads an expert once per (token, expert) pair; the
Triton fused MoE reads it once per aligned block, but decodes each 4-bit tile into registers
inside a grouped GEMM built for batches: at 8-256 tokens it ran latency-bound at 12-25% occupancy
and ~15% of DRAM bandwidth (RESULTS.md, thirty-second session, ncu). Here kernels/moe_align.py's
blocks of BLOCK_M pairs (8 or 16, one expert each) are the skinny kernel's x rows: each block
streams its expert's W once with the dense 4-bit loaders (csrc/skinny_w4.cuh), gathers its x rows
through the sorted pair numbers and writes its pairs' rows. A layer is align + up (the gated
activation and expert bias as its epilogue) + down (bias, then the routing weight) + the top-k sum
(kernels/fused_moe.py moe_sum), the Triton path's launches.

fits() takes MAX_TOKENS (env MINISGL_GROUPED_MOE, default 256, "0" turns it off) tokens at most: on
an H200 the layer ran 2.3-2.5x the Triton path's speed at 3-64 tokens (Qwen3-30B-A3B INT4) and
2.3-3.2x (GPT-OSS-20B MXFP4), 1.9x / 1.7x at 128 and 1.3x / 1.1x at 256 (RESULTS.md, thirty-third
session; benchmarks/kernels/grouped_moe.py). The launch configuration is `configs`' rule, from
that script's --sweep. Not in deterministic mode (4-bit weights are refused there). 16-bit experts
keep the Triton path past skinny_moe.MAX_TOKENS (its GEMMs are not dequantising; not measured here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from minisgl import env
from minisgl.kernels import moe_align as _align
from minisgl.kernels import w4a16_gemm as _w4
from minisgl.kernels.fused_moe import ExpertAct, moe_sum
from minisgl.ops._backend import compiled, current_stream
from minisgl.ops.gemm import skinny_moe as _skinny
from minisgl.ops.gemm.skinny import (
    _KERNEL_DTYPES,
    PDL,
    SkinnyConfig,
    check_config,
    num_tiles,
    split_buffers,
    tile_shapes,
)

BLOCK_SIZES = (8, 16)  # the kernel's BLOCK_M: 8 * MT pairs, MT 1 or 2


def _parse(text: str) -> int:
    text = text.strip()
    if not text:
        return 256
    try:
        return int(text)
    except ValueError as e:
        raise ValueError(f"MINISGL_GROUPED_MOE must be a token count (0: off), got {text!r}") from e


MAX_TOKENS = _parse(env.GROUPED_MOE)


@dataclass(frozen=True)
class GroupedConfig:
    """A layer's launches: align blocks of block_m pairs, the up and down tiles."""

    block_m: int
    up: SkinnyConfig
    down: SkinnyConfig


def fits(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, shared: torch.Tensor | None,
         quant: _skinny.Quant4) -> bool:
    """Whether fused_moe_w4's checked arguments run here: skinny_moe.MAX_TOKENS < T <= MAX_TOKENS
    and the per-pair kernel's conditions (skinny_moe.kernel_fits), with every x row's offset (the
    intermediate's T * top_k rows in the down launch) within 32 bits."""
    t = x.shape[0]
    if not _skinny.MAX_TOKENS < t <= MAX_TOKENS or not hasattr(compiled(), "skinny_moe_grouped"):
        return False
    if not _skinny.kernel_fits(x, w13, w2, top_k, shared, quant):
        return False
    inter = w13.shape[1] // 2
    return t * x.stride(0) < 2**31 and t * top_k * inter < 2**31


@functools.cache
def configs(tokens: int, top_k: int, experts: int) -> GroupedConfig:
    """The launch for `tokens` tokens: blocks of 8 pairs while an expert averages at most 8 of them
    (tokens * top_k / experts), else 16; tile 1 (two 16-row W tiles a block, one 128-K chunk a warp
    group) in blocks of 2 warps, one K split. The sweep (H200, 8-128 tokens, both shapes): blocks of
    8 ran 1.1-1.5x blocks of 16 up to 8 pairs an expert, 16 won at 16; this tile was the best or
    within 5% of it (1 warp at 128 tokens). A first sweep with 2-8 warps and 1-2 K splits (RESULTS.md,
    thirty-third session, call 1) found splits only cost: a block's K loop is short already and the
    launch covers the GPU. The same for INT4 and MXFP4 (their sweeps chose alike). Cached: the decode
    step's layers ask per call."""
    block_m = 8 if tokens * top_k <= 8 * experts else 16
    cfg = SkinnyConfig(1, 2, 1)
    return GroupedConfig(block_m, cfg, cfg)


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, sorted_ids: torch.Tensor,
            block_experts: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor, tokens: int, top_k: int,
            block_m: int, down: bool, act: ExpertAct | None, cfg: SkinnyConfig,
            q: tuple[int, torch.Tensor, torch.Tensor | None]) -> None:
    """One launch; q = (fmt, scales, zeros) of w [E, N, K/8] int32 (INT4) or [E, N, K/2] uint8 (MXFP4)."""
    fmt, scales, zeros = q
    name = _w4.NAMES[fmt]
    n, k = out.shape[1], x.shape[1]
    if block_m not in BLOCK_SIZES:
        raise ValueError(f"grouped_moe: block_m must be one of {BLOCK_SIZES}, got {block_m}")
    num_blocks = block_experts.numel()
    if sorted_ids.numel() != num_blocks * block_m:  # the kernel reads block z's ids at z * block_m
        raise ValueError(f"grouped_moe: sorted_ids has {sorted_ids.numel()} slots, not {num_blocks} blocks x "
                         f"block_m {block_m}: align with the block_m the launches take")
    if w.shape[1] != (n if down else 2 * n):
        raise ValueError(f"grouped_moe: w has {w.shape[1]} rows an expert for {n} output columns "
                         f"({'down: n' if down else 'up: gate | up, 2n'})")
    if tuple(out.shape) != (tokens * top_k, n) or out.stride(1) != 1:
        raise ValueError(f"grouped_moe: out must be [{tokens * top_k}, {n}] with contiguous rows, got "
                         f"{tuple(out.shape)}")
    check_config(cfg, block_m, name)
    tiles = num_tiles(n, not down, cfg.tile, name) * num_blocks
    ws, buffers = split_buffers(x.device, tiles, cfg.splits, tile_shapes(name)[cfg.tile][0], block_m // 8,
                                "grouped_moe")
    gpt_oss = act is not None and act.kind == "gpt_oss"
    compiled().skinny_moe_grouped(
        x.data_ptr(), w.data_ptr(), 0 if bias is None else bias.data_ptr(), sorted_ids.data_ptr(),
        block_experts.data_ptr(), weights.data_ptr() if down else 0, out.data_ptr(), *buffers, tokens, top_k,
        num_blocks, block_m, n, k, x.stride(0), w.stride(1),
        out.stride(0), w.stride(0), 0 if bias is None else bias.stride(0), down, 1 if gpt_oss else 0,
        act.alpha if gpt_oss else 0.0, act.limit if gpt_oss else 0.0, fmt, scales.data_ptr(),
        0 if zeros is None else zeros.data_ptr(), scales.stride(1), k // scales.shape[2], scales.stride(0),
        _KERNEL_DTYPES[x.dtype], cfg.tile, cfg.warps, cfg.splits, PDL, current_stream(x.device),
    )


def up(x, w13, b13, sorted_ids, block_experts, top_k, block_m, act, cfg, quant, out=None) -> torch.Tensor:
    """x [T, H] -> the intermediate [T * top_k, I] (into `out` if given: the tests' poisoned buffers)."""
    mid = torch.empty(x.shape[0] * top_k, w13.shape[1] // 2, dtype=x.dtype, device=x.device) if out is None else out
    _launch(x, w13, b13, sorted_ids, block_experts, None, mid, x.shape[0], top_k, block_m, False, act, cfg,
            (quant.fmt, quant.s13, quant.z13))
    return mid


def down(mid, w2, b2, sorted_ids, block_experts, topk_weights, top_k, block_m, cfg, quant, out=None) -> torch.Tensor:
    """The intermediate [T * top_k, I] -> weighted rows [T * top_k, H] (before the top-k sum)."""
    y = torch.empty(mid.shape[0], w2.shape[1], dtype=mid.dtype, device=mid.device) if out is None else out
    _launch(mid, w2, b2, sorted_ids, block_experts, topk_weights, y, mid.shape[0] // top_k, top_k, block_m, True,
            None, cfg, (quant.fmt, quant.s2, quant.z2))
    return y


def experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    quant: _skinny.Quant4, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
    act: ExpertAct | None = None, config: GroupedConfig | None = None,
    shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] (fits()), 4-bit w13 [E, 2I, ...], w2 [E, H, ...] (kernels/quant4.py layouts, `quant`'s
    scales), routing [T, k] (ops/gemm/w4.py checked them all) -> [T, H] = sum_j weight_j *
    (act(x W13_j^T + b13_j) W2_j^T + b2_j) (+ sigmoid(shared_gate) * shared, in the top-k sum).
    Expert ids must lie in [0, E): the alignment reads them on the device, unchecked."""
    tokens, top_k = topk_ids.shape
    e = w13.shape[0]
    if config is None:
        config = configs(tokens, top_k, e)
    sorted_ids, block_experts = _align.align(topk_ids, e, config.block_m)
    mid = up(x, w13, b13, sorted_ids, block_experts, top_k, config.block_m, act, config.up, quant)
    y = down(mid, w2, b2, sorted_ids, block_experts, topk_weights, top_k, config.block_m, config.down, quant)
    return moe_sum(y, top_k, shared, shared_gate)
