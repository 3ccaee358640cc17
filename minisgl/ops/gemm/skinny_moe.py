"""The routed experts of a decode step's few tokens on the skinny GEMM kernel (csrc/skinny_moe.cuh,
skinny_moe_kernel).

At batch 1 a MoE layer is top_k matrix-vector products per projection. The Triton fused MoE
(kernels/fused_moe.py) pads each expert's one row to a 16-row tile, needs the routing aligned
into expert blocks first and a top-k sum kernel after; its GEMMs ran at ~89% of the read ceiling
on GPT-OSS-20B's shape (RESULTS.md). Here each block reads its expert id and streams that
expert's rows as the dense skinny kernel does: the up projection is one launch over (token,
expert) pairs with the gated activation (SiLU or GPT-OSS's clamped SwiGLU) and the expert bias
as its epilogue, and the down projection one launch per step whose split-K reduction sums a
token's experts, weighted, in a fixed order. So a layer is route + up + down, three kernels.

Pairs that share an expert read it once each: beyond a few tokens the Triton kernel's one read
per expert wins (4-bit experts: this kernel grouped by expert, ops/gemm/grouped_moe.py), so `fits`
takes MAX_TOKENS tokens at most (env MINISGL_SKINNY_MOE; default 2: on
the H100 the routed experts took 0.98-1.10x the Triton path's time at 1-2 tokens and 0.81x at 4,
benchmarks/kernels/skinny_moe.py). A CUDA graph bucket boundary (1, 2, 4, 8), so a padded batch
takes the path its unpadded size would.

Deterministic mode (ops/deterministic.py): 16-bit experts run here too, in the dense mode's order
(`deterministic_configs`: DETERMINISTIC_TILE, the weight shape's fixed K splits as one block's
warps, each warp a contiguous split; one split per pair and per slot). Above MAX_TOKENS the Triton
fused MoE sums in the same splits (`deterministic_splits`, kernels/fused_moe.py), so a token's rows
are the same bits at every batch size and batch 1 runs here, at this kernel's speed.

4-bit experts (`Quant4`, ops/gemm/w4.py fused_moe_w4) run the same kernels with the INT4 / MXFP4
loaders (csrc/skinny_w4.cuh) and their own tile table: there the Triton path decodes the 4-bit
tiles inside a grouped GEMM built for batches, which ran 12-55x the batch-1 floor (RESULTS.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from minisgl import env
from minisgl.kernels import device as _device  # (its num_sms: a parameter here has that name)
from minisgl.kernels import w4a16_gemm as _w4
from minisgl.kernels.batch_invariant_gemm import skinny_splits, splits_for
from minisgl.kernels.fused_moe import ExpertAct, moe_sum
from minisgl.logging_setup import log_once
from minisgl.ops._backend import compiled, current_stream, use_cuda_kernel
from minisgl.ops.deterministic import is_deterministic
from minisgl.ops.gemm.skinny import (
    _KERNEL_DTYPES,
    DENSE,
    DETERMINISTIC_TILE,
    MAX_SPLITS,
    PDL,
    SkinnyConfig,
    check_config,
    num_tiles,
    split_buffers,
    split_count,
    tile_shapes,
)


def _parse(text: str) -> tuple[int, SkinnyConfig | None, SkinnyConfig | None]:
    """MINISGL_SKINNY_MOE: "" (defaults), "N" (at most N tokens; 0 off) or "N:UP,DOWN" configs."""
    text = text.strip()
    if not text:
        return 2, None, None
    head, _, rest = text.partition(":")
    try:
        n = int(head)
    except ValueError as e:
        raise ValueError(f"MINISGL_SKINNY_MOE must be 'N' or 'N:UP,DOWN' (e.g. '4:t2w4s1,t1w4s1'), got {text!r}") from e
    if not rest:
        return n, None, None
    up, _, down = rest.partition(",")
    return n, SkinnyConfig.parse(up), SkinnyConfig.parse(down)


MAX_TOKENS, UP_CONFIG, DOWN_CONFIG = _parse(env.SKINNY_MOE)


@dataclass(frozen=True)
class Quant4:
    """4-bit experts (ops/gemm/w4.py fused_moe_w4, kernels/quant4.py layouts): fmt 1 INT4 (scales
    and zeros [E, N, K / group] in x's dtype) or 2 MXFP4 (e8m0 scales [E, N, K / 32], zeros None),
    for w13 and w2."""

    fmt: int
    s13: torch.Tensor
    z13: torch.Tensor | None
    s2: torch.Tensor
    z2: torch.Tensor | None


def fits(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, shared: torch.Tensor | None,
         quant: Quant4 | None = None) -> bool:
    """Whether fused_moe's checked arguments run here: 1..MAX_TOKENS rows of x and kernel_fits."""
    return 1 <= x.shape[0] <= MAX_TOKENS and kernel_fits(x, w13, w2, top_k, shared, quant)


def kernel_fits(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, shared: torch.Tensor | None,
                quant: Quant4 | None = None) -> bool:
    """The kernel's conditions (this one's and the grouped one's, ops/gemm/grouped_moe.py): a CUDA
    build, 16-bit x with 16-byte aligned rows, top_k <= 64 (one split-K slot each). A shared expert
    (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE) joins in the top-k sum kernel after the down launch
    (kernels/fused_moe.py moe_sum), except in deterministic mode, whose shared-expert layers keep
    the Triton path at every token count (one summation order for a token at any batch size).
    4-bit experts (`quant`) also need H and I multiples of 32 and INT4 groups of a multiple of 32
    (a thread's 32-element load in one group)."""
    if x.dtype not in _KERNEL_DTYPES:
        return False
    if shared is not None and is_deterministic(x.device):
        return False
    if top_k > MAX_SPLITS:
        return False
    if is_deterministic(x.device) and quant is not None:  # the mode refuses 4-bit weights (engine/deterministic.py)
        return False
    if not use_cuda_kernel("skinny_moe", x) or not hasattr(compiled(), "skinny_moe"):
        return False
    h, inter = x.shape[1], (w2.shape[2] if quant is None else w13.shape[1] // 2)
    if quant is not None and (h % 32 or inter % 32 or (quant.fmt == _w4.INT4 and (
            (h // quant.s13.shape[2]) % 32 or (inter // quant.s2.shape[2]) % 32))):
        return False
    return (h % 8 == 0 and inter % 8 == 0 and x.stride(1) == 1 and (x.shape[0] == 1 or x.stride(0) % 8 == 0)
            and x.data_ptr() % 16 == 0 and w13.data_ptr() % 16 == 0 and w2.data_ptr() % 16 == 0)


@functools.cache
def default_configs(top_k: int, hidden: int, inter: int, num_sms: int,
                    fmt: str = DENSE) -> tuple[SkinnyConfig, SkinnyConfig]:
    """(up, down) launch configurations: tile 1 (16-bit: 16 rows, 4 chunks of 32 in flight; 4-bit:
    32 rows, one chunk of 128), 4 warps, the dense default's K splits over one token's planes. The
    same for every token count, so a token's row does not depend on the batch it is in (CUDA graphs
    pad batches: eager and replay give the same bits). Cached: the decode step's layers ask it per
    call."""
    tile, warps = 1, 4
    group = tile_shapes(fmt)[tile][1] * 32  # K elements per warp group
    up_blocks = num_tiles(inter, True, tile, fmt) * top_k
    down_blocks = num_tiles(hidden, False, tile, fmt) * top_k
    up = SkinnyConfig(tile, warps, split_count(up_blocks, hidden, group, warps, num_sms))
    down = SkinnyConfig(tile, warps, split_count(down_blocks, inter, group, warps, num_sms, MAX_SPLITS // top_k))
    return up, down


# Deterministic mode's shortest K split of an expert weight (kernels/batch_invariant_gemm.splits_for's
# rule otherwise; the dense GEMM's minimum is 512). Qwen3-30B-A3B's down projection (K = 768) then
# runs in 2 splits, not 1: 29.3 against 32.0 us per layer at 1 token, no slower at 2-2048 (H200,
# `benchmarks/kernels/skinny_moe.py --deterministic`'s measurement; the splits cost the grouped GEMM
# one add per split, not a pipeline refill).
MIN_SPLIT_K = 384


def deterministic_splits(x: torch.Tensor, hidden: int, inter: int) -> tuple[int, int]:
    """Deterministic mode's fixed K splits of the (up, down) projections, for every token count:
    kernels/batch_invariant_gemm.splits_for's rule with MIN_SPLIT_K on the GPU's 16-bit x, else one
    (fp32 and the CPU interpreter need no match with this kernel)."""
    if not skinny_splits(x):
        return 1, 1
    up, down = deterministic_configs(hidden, inter)
    return up.warps, down.warps


def deterministic_configs(hidden: int, inter: int) -> tuple[SkinnyConfig, SkinnyConfig]:
    """(up, down) in deterministic mode: DETERMINISTIC_TILE, the splits as one block's warps
    (launched with warp_ranges) and one split per pair or slot."""
    return _deterministic_configs(hidden, inter, MIN_SPLIT_K)


@functools.cache  # (the decode step's layers ask per call; MIN_SPLIT_K is a key: the benchmark moves it)
def _deterministic_configs(hidden: int, inter: int, min_split: int) -> tuple[SkinnyConfig, SkinnyConfig]:
    return (SkinnyConfig(DETERMINISTIC_TILE, splits_for(hidden, min_split), 1),
            SkinnyConfig(DETERMINISTIC_TILE, splits_for(inter, min_split), 1))


def _launch(x, w, bias, ids, weights, out, down: bool, act: ExpertAct | None, cfg: SkinnyConfig,
            q: tuple[int, torch.Tensor, torch.Tensor | None] | None, warp_ranges: bool = False) -> None:
    """One launch; q = (fmt, scales, zeros) for 4-bit experts (w [E, N, K/8] int32 or [E, N, K/2] uint8)."""
    tokens, top_k = ids.shape
    n = out.shape[1]
    k = x.shape[1]
    fmt = DENSE if q is None else _w4.NAMES[q[0]]
    # 4-bit: format id, scales, zeros, scale row and expert strides, group (16-bit: all 0)
    f_id, s_ptr, z_ptr, q_stride, q_group, q_estride = (0,) * 6 if q is None else (
        q[0], q[1].data_ptr(), 0 if q[2] is None else q[2].data_ptr(), q[1].stride(1), k // q[1].shape[2],
        q[1].stride(0))
    z = tokens if down else tokens * top_k
    splits = cfg.splits * top_k if down else cfg.splits
    tiles = num_tiles(n, not down, cfg.tile, fmt) * z
    ws, buffers = split_buffers(x.device, tiles, splits, tile_shapes(fmt)[cfg.tile][0], 1, "skinny_moe")
    gpt_oss = act is not None and act.kind == "gpt_oss"
    compiled().skinny_moe(
        x.data_ptr(), w.data_ptr(), 0 if bias is None else bias.data_ptr(), ids.data_ptr(),
        weights.data_ptr() if down else 0, out.data_ptr(), *buffers, tokens, top_k, n, k,
        x.stride(0) if x.shape[0] > 1 else k, w.stride(1), out.stride(0) if out.shape[0] > 1 else n, w.stride(0),
        0 if bias is None else bias.stride(0), down, 1 if gpt_oss else 0, act.alpha if gpt_oss else 0.0,
        act.limit if gpt_oss else 0.0, f_id, s_ptr, z_ptr, q_stride, q_group, q_estride, _KERNEL_DTYPES[x.dtype],
        cfg.tile, cfg.warps, cfg.splits, PDL, current_stream(x.device), warp_ranges,
    )


def experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, act: ExpertAct | None = None,
    up: SkinnyConfig | None = None, down: SkinnyConfig | None = None, quant: Quant4 | None = None,
    shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] (fits()), w13 [E, 2I, H], w2 [E, H, I], routing [T, k] (ops/moe.py or ops/gemm/w4.py
    checked them all) -> [T, H] = sum_j weight_j * (act(x W13_j^T + b13_j) W2_j^T + b2_j) (+
    sigmoid(shared_gate) * shared, the shared expert's [T, H] and its gate logit [T, 1]). Expert
    ids must lie in [0, E): the kernel reads them on the device, unchecked. `quant`: the experts are
    4-bit (w13 / w2 in the kernels/quant4.py layouts; configs index the 4-bit tiles)."""
    tokens, h = x.shape
    top_k = topk_ids.shape[1]
    inter = w2.shape[2] if quant is None else w13.shape[1] // 2
    fmt = DENSE if quant is None else _w4.NAMES[quant.fmt]
    det = is_deterministic(x.device)
    if det:
        if up is not None or down is not None or quant is not None or shared is not None:
            raise ValueError("skinny_moe: deterministic mode takes its own configs (deterministic_configs) "
                             "and 16-bit experts without a shared expert only")
        if UP_CONFIG is not None:
            log_once("skinny_moe det env", "MINISGL_SKINNY_MOE's launch configs do not apply in deterministic "
                     "mode (its configs fix the summation order); its token bound does")
        up, down = deterministic_configs(h, inter)
    elif up is None or down is None:
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        d_up, d_down = default_configs(top_k, h, inter, _device.num_sms(index), fmt)
        env_up, env_down = (UP_CONFIG, DOWN_CONFIG) if quant is None else (None, None)  # env: 16-bit tiles
        up, down = up or env_up or d_up, down or env_down or d_down
    check_config(up, 1, fmt)
    check_config(down, 1, fmt)
    if down.splits * top_k > MAX_SPLITS:  # the down launch's splits are per expert slot
        raise ValueError(f"down config splits must be in 1..{MAX_SPLITS // top_k} at top_k {top_k}, got {down.splits}")
    q13 = None if quant is None else (quant.fmt, quant.s13, quant.z13)
    q2 = None if quant is None else (quant.fmt, quant.s2, quant.z2)
    mid = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _launch(x, w13, b13, topk_ids, topk_weights, mid, False, act, up, q13, det)
    out = torch.empty(tokens, h, dtype=x.dtype, device=x.device)
    _launch(mid, w2, b2, topk_ids, topk_weights, out, True, None, down, q2, det)
    if shared is not None:  # one more small launch: the shared expert's gated row joins the routed sum
        return moe_sum(out, 1, shared, shared_gate)
    return out
