"""Speculative acceptance for a verify batch (rejection sampling; a greedy drafter's rows draw as the
plain sampler does): Triton where it can run, else the torch reference (the CPU engine path)."""

from __future__ import annotations

import torch

from minisgl.kernels import spec_accept as _k
from minisgl.ops._backend import log_cpu_reference_once, use_triton
from minisgl.ops._checks import check_contiguous, check_same_device, check_shape, check_tensor
from minisgl.ops.sampling import check_logits, check_sampling_params, row_uniforms


def spec_accept(
    logits: torch.Tensor, cu: torch.Tensor, drafts: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
    top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
    q: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits fp32 [T, V] (packed last dim), T = sum over requests of 1 + k_b; cu int32 [B + 1]
    offsets of each request's rows; drafts int64 [B, K], K >= max k_b; per-request sampling
    params [B] as `ops.sample` takes them (steps: tokens generated before this step); q fp32
    [T, V] the draft distributions, or None for greedy drafters (one-hot q).
    Returns (tokens int64 [B, K + 1], logprobs f32 [B, K + 1], num_accepted int32 [B]): request
    b's new tokens are tokens[b, :num_accepted[b] + 1] (accepted drafts, then one sampled)."""
    check_logits(logits)
    check_tensor("drafts", drafts, dtype=torch.int64, ndim=2)
    check_contiguous("drafts", drafts)
    b = drafts.shape[0]
    check_tensor("cu", cu, dtype=torch.int32, ndim=1)
    check_shape("cu", cu, (b + 1,))
    check_sampling_params(b, temperature, top_k, top_p, min_p, seeds, steps)
    if q is not None:
        check_tensor("q", q, dtype=torch.float32, ndim=2)
        check_shape("q", q, tuple(logits.shape))
        check_contiguous("q", q)
        check_same_device(logits=logits, q=q)
    check_same_device(logits=logits, cu=cu, drafts=drafts, temperature=temperature, top_k=top_k, top_p=top_p,
                      min_p=min_p, seeds=seeds, steps=steps)
    if use_triton("spec_accept", logits):
        return _k.accept(logits, cu, drafts, temperature, top_k, top_p, min_p, seeds, steps, q)
    log_cpu_reference_once("spec_accept")
    # The CPU sampler's own (seed, step) uniforms (ops/sampling.py) for row j of a request at
    # step + j: with a greedy drafter the emitted tokens are the ones it draws (the kernels share Philox).
    return _k.accept_reference(logits, cu, drafts, temperature, top_k, top_p, min_p, seeds, steps, q,
                               draw_uniforms=lambda s, c: row_uniforms(s.tolist(), c.tolist()).numpy())
