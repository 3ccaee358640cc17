"""Tensor-parallel linear layers. Each holds only its rank's shard of the weight, and
copies that shard out of the full checkpoint tensor on load (so no rank keeps a full copy).

Column-parallel: the output features are split across ranks (q/k/v, gate/up).
Row-parallel: the input features are split; partial outputs are summed by all-reduce (o, down).
The GEMMs go through ops.linear (our skinny kernel or cuBLAS, per measured shape and M);
`gemm_calls` lists them for the engine, which measures that choice at start.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl import ops
from minisgl.distributed.info import Communicator, TPInfo


def _check_shape(name: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"tensor {name} has shape {tuple(got)}, expected {tuple(want)}")


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel projections fused into one matmul, e.g. gate/up.

    `out_sizes` are the full (unsharded) output sizes of the parts; each part is split
    evenly across ranks, and the local weight is the concatenation of the local parts.
    `silu_and_mul` (two equal parts: gate, up): the output is silu(gate) * up [T, inter], the
    activation fused into the GEMM's epilogue where our kernel runs.
    """

    silu_and_mul = False

    def __init__(
        self, in_features: int, out_sizes: list[int], bias: bool, tp: TPInfo, silu_and_mul: bool = False
    ) -> None:
        super().__init__()
        if silu_and_mul and (len(out_sizes) != 2 or out_sizes[0] != out_sizes[1]):
            raise ValueError(f"silu_and_mul needs two equal parts (gate, up), got out_sizes {out_sizes}")
        self.silu_and_mul = silu_and_mul
        self.in_features = in_features
        self.local_sizes = [tp.shard(n, "an output size")[1] for n in out_sizes]
        self.full_sizes = list(out_sizes)
        self.tp = tp
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def part_range(self, part: int) -> tuple[int, int, int]:
        """(local offset, local size, start row in the full tensor) of `part`."""
        offset = sum(self.local_sizes[:part])
        size = self.local_sizes[part]
        return offset, size, self.tp.rank * size

    def load_part(self, name: str, param: str, full: torch.Tensor, part: int) -> None:
        offset, size, start = self.part_range(part)
        target = self.weight if param == "weight" else self.bias
        if target is None:
            raise ValueError(f"unexpected tensor {name}: this layer has no bias")
        want = (self.full_sizes[part], *target.shape[1:])
        _check_shape(name, full.shape, want)
        target.data[offset : offset + size].copy_(full[start : start + size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, silu=self.silu_and_mul)

    def gemm_calls(self) -> list[tuple[torch.Tensor, bool]]:
        return [(self.weight, self.silu_and_mul)]


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v projections fused. Query heads are split across ranks; KV heads too, unless
    there are fewer KV heads than ranks, in which case each rank keeps one replicated head."""

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPInfo
    ) -> None:
        q_start, q_heads = tp.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.size:
            kv_start, kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
        else:
            if tp.size % num_kv_heads != 0:
                raise ValueError(
                    f"tensor-parallel size {tp.size} is not a multiple of num_key_value_heads {num_kv_heads}"
                )
            kv_heads, kv_start = 1, tp.rank * num_kv_heads // tp.size
        self.local_q_heads, self.local_kv_heads = q_heads, kv_heads
        nn.Module.__init__(self)
        self.in_features = hidden
        self.tp = tp
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.local_sizes = [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self._starts = [q_start * head_dim, kv_start * head_dim, kv_start * head_dim]
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def part_range(self, part: int) -> tuple[int, int, int]:
        return sum(self.local_sizes[:part]), self.local_sizes[part], self._starts[part]


class RowParallelLinear(nn.Module):
    """`reduce=False` returns this rank's partial sum (the caller reduces once for several, as the
    MoE block does for the routed and the shared experts); it then takes no bias."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TPInfo, comm: Communicator, reduce: bool = True
    ) -> None:
        super().__init__()
        if bias and not reduce:
            raise ValueError("a row-parallel layer without its all-reduce cannot add a bias")
        self.reduce = reduce
        self.in_start, self.local_in = tp.shard(in_features, "an input size")
        self.in_features, self.out_features = in_features, out_features
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in), requires_grad=False)
        # The bias is added once, after the reduction (rank 0's copy would be summed N times).
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load(self, name: str, param: str, full: torch.Tensor) -> None:
        if param == "bias":
            if self.bias is None:
                raise ValueError(f"unexpected tensor {name}: this layer has no bias")
            _check_shape(name, full.shape, (self.out_features,))
            self.bias.data.copy_(full)
            return
        _check_shape(name, full.shape, (self.out_features, self.in_features))
        self.weight.data.copy_(full[:, self.in_start : self.in_start + self.local_in])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x, self.weight)
        if not self.reduce:
            return y
        y = self.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def gemm_calls(self) -> list[tuple[torch.Tensor, bool]]:
        return [(self.weight, False)]


def gemm_calls(model: nn.Module) -> list[tuple[torch.Tensor, bool]]:
    """(weight, silu) of every GEMM the model runs through ops.linear, one per layer call."""
    return [call for mod in model.modules() if hasattr(mod, "gemm_calls") for call in mod.gemm_calls()]
