"""RMSNorm with the residual add fused in (Llama-family pre-norm blocks)."""

from __future__ import annotations

import torch
from torch import nn

from minisgl import ops
from minisgl.distributed.info import Communicator


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rmsnorm(x, self.weight, self.eps)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor, reduce: Communicator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), residual updated in place. With `reduce`, x is
        this rank's partial sum: summed across the TP group first, in one kernel with the add
        and the norm where the communicator has one for x, else all-reduce then add and norm."""
        if reduce is not None:
            fused = reduce.all_reduce_rmsnorm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = reduce.all_reduce(x)
        return ops.fused_add_rmsnorm(x, residual, self.weight, self.eps)
