"""Rotary position embedding (neox style: rotate the two halves of each head).

The layer owns a [max_positions, head_dim] fp32 cos/sin table (first half cos, second half
sin), built once, with llama3 or linear frequency scaling where the config asks for it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from minisgl import ops
from minisgl.core.model_config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    # fp32, as transformers computes it, so fp32 logits match the reference closely.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
        # between low_freq_factor and high_freq_factor interpolated smoothly.
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    return inv_freq


def _yarn_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    # YaRN (as transformers computes it): dimensions that rotate more than beta_fast times over
    # the original context keep their frequency, those under beta_slow are slowed by `factor`,
    # a linear ramp between.
    def correction_dim(rotations: float) -> float:
        old = scaling.original_max_position_embeddings
        return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_attention_factor(scaling: RopeScaling) -> float:
    """The factor YaRN multiplies cos and sin by (1 for the other kinds)."""
    if scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling, device: torch.device
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
        t = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        mscale = rope_attention_factor(scaling)
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1) * mscale,
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotates q [T, Hq, D] and k [T, Hkv, D] in place."""
        ops.apply_rope(q, k, positions, self.cos_sin_cache)

    def forward_with_qk_norm(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
        k_weight: torch.Tensor, eps: float,
    ) -> None:
        """Qwen3: RMSNorm of each q and k head, then the rotation, in place, in one kernel."""
        ops.qk_norm_rope(q, k, positions, self.cos_sin_cache, q_weight, k_weight, eps)
