"""SiLU-and-mul: the gated activation of Llama-family MLPs."""

from __future__ import annotations

import torch

from minisgl import ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate, up) -> [T, I]."""
    return ops.silu_and_mul(x)
