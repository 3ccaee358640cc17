"""Sampling for a batch with per-row parameters: the torch reference.

Order: temperature -> top-k -> top-p (on the renormalized top-k distribution) -> min-p
(relative to the most likely token). A row's random draw is a function of (seed, step)
alone, so a seeded request gets the same tokens whatever else shares its batch. The chosen
token's log-probability is taken from the raw logits (log_softmax, no temperature/filtering).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.engine.step_builder import host_to_device

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) over the seed space


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # f32 [B]; 0 = greedy
    top_k: torch.Tensor  # int32 [B]; <= 0 = off
    top_p: torch.Tensor  # f32 [B]
    min_p: torch.Tensor  # f32 [B]
    seeds: torch.Tensor  # int64 [B]
    steps: torch.Tensor  # int64 [B]: tokens the request has generated so far
    all_greedy: bool

    @staticmethod
    def build(
        temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float],
        seeds: list[int], steps: list[int], device: torch.device,
    ) -> SamplingTensors:
        # Two host-to-device copies (floats, integers) instead of six. Rows are padded to 16
        # bytes: Triton specializes on pointer alignment (no recompiles as the batch changes).
        b = len(temperature)
        pf, pi = [0.0] * (-b % 4), [0] * (-b % 2)
        # From pinned memory: a pageable copy may wait for the stream (no overlap).
        f = host_to_device([temperature + pf, top_p + pf, min_p + pf], torch.float32, device)
        i = host_to_device([top_k + pi, seeds + pi, steps + pi], torch.int64, device)
        return SamplingTensors(
            f[0, :b], i[0, :b].to(torch.int32), f[1, :b], f[2, :b], i[1, :b], i[2, :b],
            all_greedy=all(x == 0.0 for x in temperature),
        )


def row_uniforms(seeds: list[int], steps: list[int]) -> torch.Tensor:
    """One U[0,1) per row, a function of (seed, step) only."""
    out = torch.empty(len(seeds), dtype=torch.float64)
    for i, (seed, step) in enumerate(zip(seeds, steps)):
        g = torch.Generator().manual_seed((seed * _SEED_MIX + step) % (1 << 63))
        out[i] = torch.rand((), generator=g, dtype=torch.float64)
    return out


def filtered_probs_reference(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """fp32 [B, V] probabilities after temperature, top-k, top-p and min-p (rows sum to 1).
    Greedy rows (temperature 0) come out one-hot on the argmax. The math lives beside the
    sampling kernel (minisgl.kernels.sampling); tests/test_sampler.py checks it against an
    independent numpy statement of the same filters."""
    from minisgl.kernels.sampling import filtered_probs_reference as reference

    return reference(logits, st.temperature, st.top_k, st.top_p, st.min_p)


def sample_reference(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], logprobs f32 [B])."""
    logprobs_all = torch.log_softmax(logits.float(), dim=-1)
    if st.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs = filtered_probs_reference(logits, st)
        cdf = probs.double().cumsum(dim=-1)
        u = row_uniforms(st.seeds.tolist(), st.steps.tolist()).to(logits.device)
        target = (u * cdf[:, -1])[:, None]
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)
        greedy = st.temperature <= 0
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)
