"""Mixture-of-experts ops: routing, token alignment and the fused expert GEMMs. Triton where it
can run, else the torch references (the CPU path, which the model tests hold to transformers)."""

from __future__ import annotations

from pathlib import Path

import torch

from minisgl import env
from minisgl.kernels import device as _device
from minisgl.kernels import fused_moe as _gemm
from minisgl.kernels import moe_align as _align
from minisgl.kernels import moe_routing as _route
from minisgl.kernels.fused_moe import ExpertAct
from minisgl.kernels.fused_moe_config import MoeTileConfig, get_config, use_config_file
from minisgl.ops._backend import log_cpu_reference_once, use_triton
from minisgl.ops._checks import check_contiguous, check_inner_contiguous, check_same_device, check_shape, check_tensor
from minisgl.ops.deterministic import is_deterministic
from minisgl.ops.gemm import skinny_moe as _skinny

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCORING = ("softmax", "sigmoid")
# Deterministic mode (ops/deterministic.py) on fp32: the grouped GEMMs take the tiles tuned for this
# many tokens at every token count (its ieee dots' order is not pinned). 16-bit x on the GPU sums
# in fixed K splits, each a chain of k16 steps in plain K order (kernels/fused_moe.py `splits`), so
# there a row's bits do not depend on the tile (as kernels/batch_invariant_gemm.py's table entries:
# tests/test_deterministic_gpu.py checks batches of 300 and 2048 tokens, whose tiles differ) and
# the tuned tiles serve every token count: this fixed choice ran 2,048 tokens 2.8x slower (H200).
DETERMINISTIC_TOKENS = 256
# Deterministic mode's grouped GEMM keeps each slot's row in fp32 (tokens * top_k * H * 4 bytes,
# twice the default's bf16 rows); a step of more tokens runs its experts in chunks of this many (a
# token's rows do not depend on what else is in its batch), so that buffer stays at 256 MiB for
# H 4096 and top-8 however large a prefill chunk the scheduler sends.
DETERMINISTIC_CHUNK = 2048
if env.FUSED_MOE_CONFIGS:
    use_config_file(Path(env.FUSED_MOE_CONFIGS))


def _check_routing(logits: object, top_k: int, scoring: str) -> None:
    check_tensor("router_logits", logits, dtype=_DTYPES, ndim=2)
    check_inner_contiguous("router_logits", logits)
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[1]}] (the number of experts), got {top_k}")
    if scoring not in SCORING:
        raise ValueError(f"scoring must be one of {SCORING}, got {scoring!r}")


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """router logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k] int32), largest first."""
    _check_routing(logits, top_k, scoring)
    if use_triton("moe_route", logits):
        return _route.route(logits, top_k, renormalize, scoring)
    log_cpu_reference_once("moe_route")
    return _route.route_reference(logits, top_k, renormalize, scoring)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, top_k] int32 -> (sorted_ids, expert_ids) grouped by expert in BLOCK_M-row blocks
    (kernels/moe_align.py). Ids must lie in [0, num_experts): they are not read on the host."""
    check_tensor("topk_ids", topk_ids, dtype=torch.int32, ndim=2)
    check_contiguous("topk_ids", topk_ids)
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    if use_triton("moe_align", topk_ids):
        return _align.align(topk_ids, num_experts, block_m)
    log_cpu_reference_once("moe_align")
    return _align.align_reference(topk_ids, num_experts, block_m)


def check_shared(x: torch.Tensor, shared: object, shared_gate: object) -> None:
    """Qwen2-MoE's shared expert output [T, H] and its gate logit [T, 1], or neither."""
    if (shared is None) != (shared_gate is None):
        raise ValueError("shared and shared_gate go together: give both or neither")
    if shared is not None:
        check_tensor("shared", shared, dtype=x.dtype, ndim=2)
        check_shape("shared", shared, tuple(x.shape))
        check_contiguous("shared", shared)
        check_tensor("shared_gate", shared_gate, dtype=_DTYPES, ndim=2)
        check_shape("shared_gate", shared_gate, (x.shape[0], 1))
        check_same_device(x=x, shared=shared, shared_gate=shared_gate)


def check_topk(x: torch.Tensor, topk_weights: object, topk_ids: object) -> None:
    """A given routing: topk_ids int32 [T, k], topk_weights fp32 [T, k], both contiguous."""
    check_tensor("topk_ids", topk_ids, dtype=torch.int32, ndim=2)
    check_shape("topk_ids", topk_ids, (x.shape[0], None))
    check_contiguous("topk_ids", topk_ids)
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2)
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    check_contiguous("topk_weights", topk_weights)
    check_same_device(x=x, topk_ids=topk_ids, topk_weights=topk_weights)


def _check_experts(x: object, w13: object, w2: object, shared: object, shared_gate: object) -> None:
    check_tensor("x", x, dtype=_DTYPES, ndim=2)
    check_inner_contiguous("x", x)
    check_tensor("w13", w13, dtype=x.dtype, ndim=3)
    check_tensor("w2", w2, dtype=x.dtype, ndim=3)
    e, two_i, h = w13.shape
    if two_i % 2 or h != x.shape[1]:
        raise ValueError(f"w13 must have shape (E, 2 * I, {x.shape[1]}), got {tuple(w13.shape)}")
    check_shape("w2", w2, (e, h, two_i // 2))
    check_contiguous("w13", w13)
    check_contiguous("w2", w2)
    check_shared(x, shared, shared_gate)
    check_same_device(x=x, w13=w13, w2=w2)


def _check_biases(w13: torch.Tensor, w2: torch.Tensor, b13: object, b2: object, act: object) -> None:
    check_expert_biases(w13, w13.dtype, tuple(w13.shape[:2]), tuple(w2.shape[:2]), b13, b2, act)


def check_expert_biases(like: torch.Tensor, dtype: torch.dtype, shape13: tuple[int, int], shape2: tuple[int, int],
                        b13: object, b2: object, act: object) -> None:
    """GPT-OSS's expert biases b13 [E, 2I], b2 [E, H] (both or neither; `dtype`, on `like`'s
    device) and the activation (an ExpertAct)."""
    if (b13 is None) != (b2 is None):
        raise ValueError("b13 and b2 go together: give both or neither")
    if b13 is not None:
        check_tensor("b13", b13, dtype=dtype, ndim=2)
        check_shape("b13", b13, shape13)
        check_contiguous("b13", b13)
        check_tensor("b2", b2, dtype=dtype, ndim=2)
        check_shape("b2", b2, shape2)
        check_contiguous("b2", b2)
        check_same_device(experts=like, b13=b13, b2=b2)
    if act is not None and (not isinstance(act, ExpertAct) or act.kind not in ("silu", "gpt_oss")):
        raise ValueError(f"act must be an ExpertAct of kind 'silu' or 'gpt_oss', got {act!r}")


def check_layer(x: torch.Tensor, w13: object, w2: object, top_k: int, scoring: str, shared: object,
                shared_gate: object, b13: object, b2: object, act: object) -> None:
    """A MoE layer's arguments but its router logits (fused_moe and ops/moe_layer.py)."""
    _check_experts(x, w13, w2, shared, shared_gate)
    _check_biases(w13, w2, b13, b2, act)
    if not 1 <= top_k <= w13.shape[0]:
        raise ValueError(f"top_k must be in [1, {w13.shape[0]}] (the number of experts), got {top_k}")
    if scoring not in SCORING:
        raise ValueError(f"scoring must be one of {SCORING}, got {scoring!r}")


def _experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, sorted_ids: torch.Tensor,
             expert_ids: torch.Tensor, top_k: int, cfg: MoeTileConfig, shared: torch.Tensor | None,
             shared_gate: torch.Tensor | None, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
             act: ExpertAct | None = None) -> torch.Tensor:
    # Deterministic mode: each GEMM sums K in its weight shape's fixed splits, as the skinny MoE
    # kernel does for 1-2 tokens (ops/gemm/skinny_moe.py deterministic_configs), and the slots
    # are added in fp32 (kernels/fused_moe.py).
    up_splits = down_splits = 0
    if is_deterministic(x.device):
        up_splits, down_splits = _skinny.deterministic_splits(x, w13.shape[2], w2.shape[2])
    inter = _gemm.up_gemm(x, w13, sorted_ids, expert_ids, top_k, cfg.block_m, cfg.up, b13=b13, act=act,
                          splits=up_splits)
    y = _gemm.down_gemm(inter, w2, weights, sorted_ids, expert_ids, cfg.block_m, cfg.down, b2=b2, splits=down_splits)
    return _gemm.moe_sum(y, top_k, shared, shared_gate, dtype=x.dtype)


def _config(x: torch.Tensor, w13: torch.Tensor, top_k: int) -> MoeTileConfig:
    e, two_i, h = w13.shape
    fixed = is_deterministic(x.device) and not _skinny.skinny_splits(x)
    tokens = DETERMINISTIC_TOKENS if fixed else x.shape[0]
    return get_config(e, top_k, two_i // 2, h, tokens, x.dtype, _device.name(x.device))


def _reference_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    shared: torch.Tensor | None, shared_gate: torch.Tensor | None, b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None, act: ExpertAct | None = None) -> torch.Tensor:
    """The experts' torch reference; in deterministic mode one token at a time, as
    ops.deterministic's linear does on the CPU (its BLAS takes another path at M = 1 than at
    M > 1, and an expert's rows are however many tokens the batch routes to it)."""
    if not is_deterministic(x.device) or x.shape[0] <= 1:
        return _gemm.fused_experts_reference(x, w13, w2, weights, ids, shared, shared_gate, b13, b2, act)

    def row(i: int) -> torch.Tensor:
        one = slice(i, i + 1)
        return _gemm.fused_experts_reference(
            x[one], w13, w2, weights[one], ids[one], None if shared is None else shared[one],
            None if shared_gate is None else shared_gate[one], b13, b2, act)

    return torch.cat([row(i) for i in range(x.shape[0])])


def _chunks(x: torch.Tensor) -> list[slice] | None:
    """Deterministic mode's token chunks of a step past DETERMINISTIC_CHUNK tokens (else None)."""
    t = x.shape[0]
    if t <= DETERMINISTIC_CHUNK or not is_deterministic(x.device):
        return None
    return [slice(i, min(t, i + DETERMINISTIC_CHUNK)) for i in range(0, t, DETERMINISTIC_CHUNK)]


def _part(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if t is None else t[rows]


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts for a given routing: x [T, H], w13 [E, 2I, H] (gate | up rows), w2 [E, H, I],
    topk_weights [T, k] fp32, topk_ids [T, k] int32 -> [T, H] = sum_j weight_j * expert_j(x)
    (+ sigmoid(shared_gate [T, 1]) * shared [T, H], Qwen2-MoE's shared expert)."""
    _check_experts(x, w13, w2, shared, shared_gate)
    check_topk(x, topk_weights, topk_ids)
    if _skinny.fits(x, w13, w2, topk_ids.shape[1], shared):
        return _skinny.experts(x, w13, w2, topk_weights, topk_ids, shared=shared, shared_gate=shared_gate)
    if use_triton("fused_moe", x):
        if (chunks := _chunks(x)) is not None:
            return torch.cat([fused_experts(x[c], w13, w2, topk_weights[c], topk_ids[c], _part(shared, c),
                                            _part(shared_gate, c)) for c in chunks])
        top_k = topk_ids.shape[1]
        cfg = _config(x, w13, top_k)
        sorted_ids, expert_ids = _align.align(topk_ids, w13.shape[0], cfg.block_m)
        return _experts(x, w13, w2, topk_weights, sorted_ids, expert_ids, top_k, cfg, shared, shared_gate)
    log_cpu_reference_once("fused_moe")
    return _reference_rows(x, w13, w2, topk_weights, topk_ids, shared, shared_gate)


def fused_moe(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
    renormalize: bool, scoring: str = "softmax", shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
    act: ExpertAct | None = None,
) -> torch.Tensor:
    """A whole MoE layer's experts: routing (moe_route) then fused_experts. Nothing is read back
    to the host and every size depends on T only, so CUDA graphs capture it; a decode-sized
    batch routes and aligns in one kernel, or (1..a few tokens, ops/gemm/skinny_moe.py) routes and
    runs its experts on the skinny GEMM kernel. b13 [E, 2I], b2 [E, H]: expert biases; act: the
    gated activation (default SiLU; GPT-OSS's clamped SwiGLU)."""
    check_layer(x, w13, w2, top_k, scoring, shared, shared_gate, b13, b2, act)
    _check_routing(router_logits, top_k, scoring)
    check_shape("router_logits", router_logits, (x.shape[0], w13.shape[0]))
    check_same_device(x=x, router_logits=router_logits)
    return run_layer(x, router_logits, w13, w2, top_k, renormalize, scoring, shared, shared_gate, b13, b2, act)


def run_layer(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
    renormalize: bool, scoring: str, shared: torch.Tensor | None, shared_gate: torch.Tensor | None,
    b13: torch.Tensor | None, b2: torch.Tensor | None, act: ExpertAct | None,
) -> torch.Tensor:
    """fused_moe after its checks (ops/moe_layer.py checked the same and built the logits)."""
    if not use_triton("fused_moe", x):
        log_cpu_reference_once("fused_moe")
        weights, ids = _route.route_reference(router_logits, top_k, renormalize, scoring)
        return _reference_rows(x, w13, w2, weights, ids, shared, shared_gate, b13, b2, act)
    if _skinny.fits(x, w13, w2, top_k, shared):  # a decode step's few tokens: route + up + down
        weights, ids = _route.route(router_logits, top_k, renormalize, scoring)
        return _skinny.experts(x, w13, w2, weights, ids, b13, b2, act, shared=shared, shared_gate=shared_gate)
    if (chunks := _chunks(x)) is not None:
        return torch.cat([run_layer(x[c], router_logits[c], w13, w2, top_k, renormalize, scoring, _part(shared, c),
                                    _part(shared_gate, c), b13, b2, act) for c in chunks])
    cfg = _config(x, w13, top_k)
    num_experts = w13.shape[0]
    # (in deterministic mode one routing kernel at every token count: the two may differ in bits)
    if not is_deterministic(x.device) and _align.small_route_align_fits(x.shape[0], num_experts, top_k):
        weights, _, sorted_ids, expert_ids = _align.route_and_align(
            router_logits, top_k, renormalize, scoring, cfg.block_m
        )
    else:
        weights, ids = _route.route(router_logits, top_k, renormalize, scoring)
        sorted_ids, expert_ids = _align.align(ids, num_experts, cfg.block_m)
    return _experts(x, w13, w2, weights, sorted_ids, expert_ids, top_k, cfg, shared, shared_gate, b13, b2, act)
