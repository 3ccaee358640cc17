"""Tensor-parallel rank information and the communicator interface the layers call."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} is outside [0, {self.size})")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's even share of `total` items."""
        if total % self.size != 0:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.size}")
        part = total // self.size
        return self.rank * part, part


class Communicator:
    """Collectives across the TP group. World size 1: every call is the identity."""

    def __init__(self, tp: TPInfo) -> None:
        self.tp = tp

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return x
        raise NotImplementedError("multi-rank communicators come with tensor parallelism")

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.tp.size == 1:
            return x
        raise NotImplementedError("multi-rank communicators come with tensor parallelism")

    def all_reduce_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(weight * rmsnorm(r), r) with r = the sum of x across ranks + residual (written into
        residual), in one kernel; None where this communicator has no such kernel for x (the
        caller then reduces, adds and normalises in separate steps)."""
        return None

    def destroy(self) -> None:
        """Frees the communicator's resources (collective where the backend's teardown is)."""
