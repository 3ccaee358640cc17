"""RMSNorm after a row-parallel layer's partial sum (layers/norm.py): the communicator's fused
all-reduce + add + norm where it has one, else its all-reduce then fused_add_rmsnorm; both give
what the unfused layer gave (all-reduce, then norm with the residual)."""

from __future__ import annotations

import torch

from minisgl.distributed.info import Communicator, TPInfo
from minisgl.layers.norm import RMSNorm


class Doubling(Communicator):
    """Two ranks holding the same partial sum: the all-reduce doubles it."""

    def __init__(self, fused: bool) -> None:
        super().__init__(TPInfo(0, 2))
        self.fused, self.calls = fused, []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_reduce")
        return x.mul_(2)

    def all_reduce_rmsnorm(self, x, residual, weight, eps):  # noqa: ANN001, ANN201
        if not self.fused:
            return None
        self.calls.append("fused")
        residual.add_(2 * x)
        return RMSNorm.__new__(RMSNorm), residual  # a marker: the norm must pass it through


def norm(hidden: int) -> RMSNorm:
    n = RMSNorm(hidden, 1e-6)
    n.weight.data = torch.rand(hidden) + 0.5
    return n


def test_fallback_reduces_then_adds_and_normalises() -> None:
    torch.manual_seed(0)
    n, x, residual = norm(64), torch.randn(3, 64), torch.randn(3, 64)
    want_out, want_res = n.forward_with_residual(2 * x, residual.clone())
    comm = Doubling(fused=False)
    got_out, got_res = n.forward_with_residual(x.clone(), residual, comm)
    assert comm.calls == ["all_reduce"]
    assert torch.equal(got_res, want_res) and torch.equal(got_out, want_out)


def test_fused_path_is_taken_when_offered() -> None:
    n, x, residual = norm(16), torch.randn(2, 16), torch.randn(2, 16)
    comm = Doubling(fused=True)
    out, res = n.forward_with_residual(x, residual.clone(), comm)
    assert comm.calls == ["fused"] and isinstance(out, RMSNorm)
    assert torch.allclose(res, residual + 2 * x)


def test_without_a_communicator_nothing_is_reduced() -> None:
    n, x, residual = norm(16), torch.randn(2, 16), torch.randn(2, 16)
    out, res = n.forward_with_residual(x, residual.clone())
    assert torch.allclose(res, residual + x)
    xf = res.float()
    assert torch.allclose(out, n.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)), atol=1e-5)
