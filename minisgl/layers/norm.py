"""RMSNorm with the residual add fused in (Llama-family pre-norm blocks)."""

from __future__ import annotations

import torch
from torch import nn

from minisgl import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rmsnorm(x, self.weight, self.eps)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return ops.fused_add_rmsnorm(x, residual, self.weight, self.eps)
