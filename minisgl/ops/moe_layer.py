"""A whole MoE layer from its hidden states: the router's linear layer, the routing and the routed
experts. For a decode step's few tokens on a small router (GPT-OSS: 32 x 2880) the router GEMM and
the top-k run in one kernel (kernels/moe_routing.route_linear) before the skinny expert kernels
(ops/gemm/skinny_moe.py): three launches per layer instead of router GEMM, routing + alignment,
up, down and top-k sum. Anything else: the router through ops.linear, then ops.fused_moe.

Its own module because ops.gemm's 4-bit path imports ops.moe's checks: ops.moe cannot import
ops.gemm's linear back.
"""

from __future__ import annotations

import torch

from minisgl.kernels import moe_routing as _route
from minisgl.kernels.fused_moe import ExpertAct
from minisgl.ops._backend import use_triton
from minisgl.ops._checks import check_same_device, check_shape, check_tensor
from minisgl.ops.deterministic import is_deterministic
from minisgl.ops.gemm import linear
from minisgl.ops.gemm import skinny_moe as _skinny
from minisgl.ops.gemm.skinny import counters
from minisgl.ops.moe import check_layer, run_layer

# Router weights up to this many elements take the one-kernel routing (each token's programs read
# the whole weight between them): GPT-OSS's 92k; Qwen3-30B-A3B's 262k stay on the GEMM.
ROUTE_LINEAR_MAX_ELEMENTS = 1 << 17


def fused_moe_layer(
    x: torch.Tensor, gate_weight: torch.Tensor, gate_bias: torch.Tensor | None, w13: torch.Tensor,
    w2: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax", shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
    act: ExpertAct | None = None,
) -> torch.Tensor:
    """fused_moe(x, x gate_weight^T + gate_bias, ...): the same result, the router GEMM included."""
    check_layer(x, w13, w2, top_k, scoring, shared, shared_gate, b13, b2, act)
    check_tensor("gate_weight", gate_weight, dtype=x.dtype, ndim=2)
    check_shape("gate_weight", gate_weight, (w13.shape[0], x.shape[1]))
    if gate_bias is not None:
        check_tensor("gate_bias", gate_bias, dtype=x.dtype, ndim=1)
        check_shape("gate_bias", gate_bias, (w13.shape[0],))
    check_same_device(x=x, gate_weight=gate_weight)
    # (not in deterministic mode: its router logits come from the mode's linear at every token count)
    if (gate_weight.numel() <= ROUTE_LINEAR_MAX_ELEMENTS and gate_weight.stride(1) == 1
            and not is_deterministic(x.device)
            and (gate_bias is None or gate_bias.stride(0) == 1)
            and _skinny.fits(x, w13, w2, top_k, shared) and use_triton("moe_route", x)):
        ctr = counters(x.device)  # the skinny GEMM's split-K counters: zero between launches on this stream
        weights, ids = _route.route_linear(x, gate_weight, gate_bias, top_k, renormalize, ctr, scoring)
        return _skinny.experts(x, w13, w2, weights, ids, b13, b2, act, shared=shared, shared_gate=shared_gate)
    logits = linear(x, gate_weight, gate_bias)  # [T, E] in x's dtype, as fused_moe checks them
    return run_layer(x, logits, w13, w2, top_k, renormalize, scoring, shared, shared_gate, b13, b2, act)
