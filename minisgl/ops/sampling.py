"""Batched sampling (greedy / temperature / top-k / top-p / min-p, per-row seeds): Triton where
it can run, else the sort-based torch reference."""

from __future__ import annotations

import torch

from minisgl.kernels import greedy as _greedy
from minisgl.kernels import sampling as _k
from minisgl.ops._backend import log_cpu_reference_once, use_triton
from minisgl.ops._checks import check_contiguous, check_same_device, check_shape, check_tensor


def check_sampling_params(
    b: int, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    seeds: torch.Tensor, steps: torch.Tensor,
) -> None:
    """The per-row sampling parameters of `sample` (and of `spec_accept`, per request): dtypes,
    [b] shapes, packed."""
    for name, t, dtype in (
        ("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
        ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32),
        ("seeds", seeds, torch.int64), ("steps", steps, torch.int64),
    ):
        check_tensor(name, t, dtype=dtype, ndim=1)
        check_shape(name, t, (b,))
        check_contiguous(name, t)


def check_logits(logits: torch.Tensor) -> None:
    """`sample`'s and `greedy`'s logits: fp32 [B, V], V > 0, packed in the last dimension."""
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    if logits.stride(1) != 1 and logits.shape[1] > 1:
        raise ValueError(f"logits must be packed in its last dimension, got strides {logits.stride()}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [B, V] (last dim packed, row stride free); temperature f32 [B] (<= 0: greedy,
    exactly argmax); top_k int32 [B] (<= 0 or >= V: off); top_p f32 [B] (>= 1: off); min_p f32
    [B] (<= 0: off); seeds, steps int64 [B]. Filters apply in the order temperature -> top-k ->
    top-p (on the top-k renormalized distribution) -> min-p (relative to the top token).
    A row's draw depends only on its logits, parameters and (seed, step).
    Returns (tokens int64 [B], logprobs f32 [B] = log_softmax(logits)[token] of the raw logits)."""
    check_logits(logits)
    check_sampling_params(logits.shape[0], temperature, top_k, top_p, min_p, seeds, steps)
    check_same_device(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p,
                      min_p=min_p, seeds=seeds, steps=steps)
    if use_triton("sample", logits):
        return _k.sample(logits, temperature, top_k, top_p, min_p, seeds, steps)
    log_cpu_reference_once("sample")
    return sample_reference(logits, temperature, top_k, top_p, min_p, seeds, steps)


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row greedy: logits fp32 [B, V] (last dim packed, row stride free) -> (tokens int64 [B],
    the first argmax of each row; logprobs f32 [B], log_softmax(row)[token]). Faster than `sample`
    and torch's reductions at small batches (kernels/greedy.py); a row's bits depend on it alone."""
    check_logits(logits)
    if use_triton("greedy", logits):
        return _greedy.greedy(logits)
    log_cpu_reference_once("greedy")
    return _greedy.greedy_reference(logits)


# The torch reference (fp32, sort-based). Order: temperature -> top-k -> top-p (on the
# renormalized top-k distribution) -> min-p (relative to the most likely token). A row's random
# draw is a function of (seed, step) alone, so a seeded request gets the same tokens whatever
# else shares its batch. The chosen token's log-probability is of the raw logits.
_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) over the seed space


def row_uniforms(seeds: list[int], steps: list[int]) -> torch.Tensor:
    """One U[0,1) per row, a function of (seed, step) only."""
    out = torch.empty(len(seeds), dtype=torch.float64)
    for i, (seed, step) in enumerate(zip(seeds, steps)):
        g = torch.Generator().manual_seed((seed * _SEED_MIX + step) % (1 << 63))
        out[i] = torch.rand((), generator=g, dtype=torch.float64)
    return out


def sample_reference(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample`'s arguments; (tokens int64 [B], logprobs f32 [B]). The filtered probabilities
    come from the sort-based reference beside the kernel (minisgl.kernels.sampling), which
    tests/test_sampler.py checks against an independent numpy statement of the same filters;
    the draw is an inverse CDF at one (seed, step) uniform per row."""
    logprobs_all = torch.log_softmax(logits.float(), dim=-1)
    greedy = temperature <= 0
    if bool(greedy.all()):
        tokens = logits.argmax(dim=-1)
    else:
        probs = _k.filtered_probs_reference(logits, temperature, top_k, top_p, min_p)
        cdf = probs.double().cumsum(dim=-1)
        u = row_uniforms(seeds.tolist(), steps.tolist()).to(logits.device)
        target = (u * cdf[:, -1])[:, None]
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)
