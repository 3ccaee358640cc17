"""Tensor-parallel linear layers. Each holds only its rank's shard of the weight, and
copies that shard out of the full checkpoint tensor on load (so no rank keeps a full copy).

Column-parallel: the output features are split across ranks (q/k/v, gate/up).
Row-parallel: the input features are split; partial outputs are summed by all-reduce (o, down).
The GEMMs go through ops.linear, one entry for every weight format (ops/gemm/dispatch.py: our
skinny kernel or the large-batch path, per format, measured shape and M); `gemm_calls` lists
them for the engine, which measures that choice at start.

With `quant` (a QuantConfig) a layer is quantized, its format `fmt` (one state, one load path
and one GEMM call for every format; ops.linear takes the tensors as they are):
- "fp8": weight e4m3 [N, K] and fp32 weight_scale [N, ceil(K / block_k)] (ops/gemm/fp8.py has the
  layout), loaded from an FP8 checkpoint's weight and scale tensors (any order), or quantized per
  output channel on load from a 16-bit weight (`--quantization fp8`);
- "int4": weight int32 [N, K / 8], weight_scale and weight_zero [N, K / G] (kernels/quant4.py),
  repacked at load from the checkpoint format's tensors of each part once all have arrived
  (layers/quant4_load.py); GPTQ act-order: `act_perm` permutes x's columns as K was permuted.
TP: 4-bit K shards must start and end on group boundaries (refused otherwise).
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl import ops
from minisgl.core.quant_config import BLOCK, QuantConfig
from minisgl.distributed.info import Communicator, TPInfo
from minisgl.layers.fp8_load import check_weight_dtype, scale_rows
from minisgl.layers.quant4_load import checkpoint_kinds, to_int4
from minisgl.ops.gemm import DENSE, INT4
from minisgl.ops.gemm.fp8 import FP8, quantize_rows
from minisgl.ops.gemm.table import GemmCall


def _check_shape(name: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"tensor {name} has shape {tuple(got)}, expected {tuple(want)}")


class _QuantMixin(nn.Module):
    """The weight state shared by both layer kinds, for every format: `quant`, `fmt`, `weight`,
    `weight_scale` and `weight_zero` (or None), `block_k`, `act_perm`; `checkpoint_kinds`: the
    tensor suffixes of one part in the checkpoint where they are not `weight` (4-bit formats)."""

    silu_and_mul = False
    act_perm: torch.Tensor | None = None
    checkpoint_kinds: tuple[str, ...] | None = None

    def _make_weight(self, out: int, k: int, quant: QuantConfig | None, k_range: tuple[int, int] | None = None,
                     ) -> None:
        """`k_range`: (start, size) of this rank's K in the full K (row-parallel), else all of K."""
        self.quant = quant
        self.fmt = quant.fmt if quant else DENSE
        self.block_k = 0
        self.k_range = k_range or (0, k)
        self.register_parameter("weight_zero", None)
        if self.fmt == INT4:
            self._make_int4(out, k, quant)
            return
        self.weight = nn.Parameter(torch.empty(out, k, dtype=FP8 if quant else None), requires_grad=False)
        if quant is None:
            self.register_parameter("weight_scale", None)
            return
        self.block_k = quant.block_k or k
        kb = -(-k // self.block_k)
        self.weight_scale = nn.Parameter(torch.empty(out, kb, dtype=torch.float32), requires_grad=False)

    def _store_rows(self, name: str, full_rows: torch.Tensor, rows: slice, cols: slice) -> None:
        """Weight rows `rows` of this layer from `full_rows` (already the right rows), its
        columns `cols` (this rank's K range)."""
        check_weight_dtype(name, full_rows, self.quant)
        part = full_rows[:, cols]
        if self.quant is not None and self.quant.online:
            # Quantized where the layer lives (a GPU: seconds for 8B), one part at a time.
            q, s = quantize_rows(part.to(self.weight.device))
            self.weight.data[rows].copy_(q)
            self.weight_scale.data[rows].copy_(s)
            return
        self.weight.data[rows].copy_(part)

    def _store_scale(self, name: str, full: torch.Tensor, n_full: int, k_full: int, src: slice, rows: slice,
                     k_start: int) -> None:
        if self.quant is None or self.quant.online:
            raise ValueError(f"unexpected tensor {name}: this layer has no FP8 scales")
        expanded = scale_rows(name, full, self.quant, n_full, k_full)[src]
        kb = self.weight_scale.size(1)
        if expanded.size(1) > 1:  # K blocks of this rank (k_start is a multiple of 128)
            expanded = expanded[:, k_start // BLOCK : k_start // BLOCK + kb]
        self.weight_scale.data[rows].copy_(expanded)

    def _make_int4(self, out: int, k: int, quant: QuantConfig) -> None:
        start, size = self.k_range
        g = quant.group or k
        if quant.group and (start % g or size % g):
            raise ValueError(f"tensor-parallel shard of K at {start}..{start + size} does not fall on the 4-bit "
                             f"checkpoint's groups of {g}: use a smaller tensor-parallel size")
        if k % 8:
            raise ValueError(f"a 4-bit layer needs K divisible by 8, got {k}")
        self.checkpoint_kinds = checkpoint_kinds(quant)
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self._perms: list[torch.Tensor | None] = []
        self.weight = nn.Parameter(torch.empty(out, k // 8, dtype=torch.int32), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out, k // g), requires_grad=False)
        self.weight_zero = nn.Parameter(torch.empty(out, k // g), requires_grad=False)

    def _load_int4(self, name: str, kind: str, full: torch.Tensor, part: int, n_full: int, src: slice,
                   rows: slice) -> None:
        """Keeps `full` until every tensor of the part has come, then repacks the part and stores
        this rank's rows `src` (of the full part) at local `rows`, its K range."""
        if kind not in self.checkpoint_kinds:
            raise ValueError(f"unexpected tensor {name}: a {self.quant.method} layer has {self.checkpoint_kinds}")
        got = self._pending.setdefault(part, {})
        got[kind] = full
        if len(got) < len(self.checkpoint_kinds):
            return
        del self._pending[part]
        start, size = self.k_range
        k_full = self.in_features
        module = name.rpartition(".")[0]
        qw, scales, zeros, perm = to_int4(self.quant, got, module, n_full, k_full)
        if perm is not None and size != k_full:
            raise ValueError(f"{module}: GPTQ act-order (desc_act) with tensor parallelism splitting K is not "
                             "supported: use tensor-parallel size 1")
        if self._perms and not _same(self._perms[0], perm):
            raise ValueError(f"{module}: its g_idx order differs from the other parts' of the fused layer; minisgl "
                             "fuses them into one GEMM over one order of x")
        self._perms.append(perm)
        if perm is not None:
            self.act_perm = perm.to(self.weight.device)
        g = self.quant.group or k_full
        groups = slice(start // g, start // g + self.weight_scale.size(1))
        self.weight.data[rows].copy_(qw[src, start // 8 : (start + size) // 8])
        self.weight_scale.data[rows].copy_(scales[src, groups])
        self.weight_zero.data[rows].copy_(zeros[src, groups])

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
        if self.act_perm is not None:
            x = x.index_select(-1, self.act_perm)
        return ops.linear(x, self.weight, bias, silu, fmt=self.fmt, scale=self.weight_scale, zeros=self.weight_zero,
                          block_k=self.block_k)

    def gemm_calls(self) -> list[GemmCall]:
        return [GemmCall(self.weight, bool(self.silu_and_mul), self.fmt, self.weight_scale, self.block_k,
                         self.weight_zero)]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


class MergedColumnParallelLinear(_QuantMixin):
    """Several column-parallel projections fused into one matmul, e.g. gate/up.

    `out_sizes` are the full (unsharded) output sizes of the parts; each part is split
    evenly across ranks, and the local weight is the concatenation of the local parts.
    `silu_and_mul` (two equal parts: gate, up): the output is silu(gate) * up [T, inter], the
    activation fused into the GEMM's epilogue where our kernel runs.
    """

    def __init__(
        self, in_features: int, out_sizes: list[int], bias: bool, tp: TPInfo, silu_and_mul: bool = False,
        quant: QuantConfig | None = None,
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
        self._make_weight(out, in_features, quant)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def part_range(self, part: int) -> tuple[int, int, int]:
        """(local offset, local size, start row in the full tensor) of `part`."""
        offset = sum(self.local_sizes[:part])
        size = self.local_sizes[part]
        return offset, size, self.tp.rank * size

    def load_part(self, name: str, param: str, full: torch.Tensor, part: int) -> None:
        offset, size, start = self.part_range(part)
        if self.checkpoint_kinds is not None and param != "bias":
            self._load_int4(name, param, full, part, self.full_sizes[part], slice(start, start + size),
                            slice(offset, offset + size))
            return
        if param == "weight_scale":
            self._store_scale(name, full, self.full_sizes[part], self.in_features, slice(start, start + size),
                              slice(offset, offset + size), 0)
            return
        target = self.weight if param == "weight" else self.bias
        if target is None:
            raise ValueError(f"unexpected tensor {name}: this layer has no bias")
        want = (self.full_sizes[part], *target.shape[1:])
        _check_shape(name, full.shape, want)
        if param == "weight":
            self._store_rows(name, full[start : start + size], slice(offset, offset + size), slice(None))
        else:
            target.data[offset : offset + size].copy_(full[start : start + size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, self.bias, self.silu_and_mul)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v projections fused. Query heads are split across ranks; KV heads too, unless
    there are fewer KV heads than ranks, in which case each rank keeps one replicated head."""

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPInfo,
        quant: QuantConfig | None = None,
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
        self._make_weight(out, hidden, quant)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def part_range(self, part: int) -> tuple[int, int, int]:
        return sum(self.local_sizes[:part]), self.local_sizes[part], self._starts[part]


class RowParallelLinear(_QuantMixin):
    """`reduce=False` returns this rank's partial sum (the caller reduces once for several, as the
    MoE block does for the routed and the shared experts); it then takes no bias."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TPInfo, comm: Communicator, reduce: bool = True,
        quant: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        if bias and not reduce:
            raise ValueError("a row-parallel layer without its all-reduce cannot add a bias")
        self.reduce = reduce
        self.in_start, self.local_in = tp.shard(in_features, "an input size")
        self.in_features, self.out_features = in_features, out_features
        self.comm = comm
        if quant is not None and quant.block_k and self.in_start % BLOCK:
            raise ValueError(
                f"tensor-parallel size {tp.size} splits an input size of {in_features} at {self.in_start}, "
                "inside a 128 x 128 FP8 scale block: use a smaller tensor-parallel size"
            )
        self._make_weight(out_features, self.local_in, quant, (self.in_start, self.local_in))
        # The bias is added once, after the reduction (rank 0's copy would be summed N times). With
        # one rank there is no reduction: the bias is the GEMM's epilogue (one launch fewer per
        # GPT-OSS layer, ~0.05 ms of a 3.6 ms decode step on the H100).
        self.single = tp.size == 1
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load(self, name: str, param: str, full: torch.Tensor) -> None:
        if param == "bias":
            if self.bias is None:
                raise ValueError(f"unexpected tensor {name}: this layer has no bias")
            _check_shape(name, full.shape, (self.out_features,))
            self.bias.data.copy_(full)
            return
        rows = slice(0, self.out_features)
        if self.checkpoint_kinds is not None:
            self._load_int4(name, param, full, 0, self.out_features, rows, rows)
            return
        if param == "weight_scale":
            self._store_scale(name, full, self.out_features, self.in_features, rows, rows, self.in_start)
            return
        _check_shape(name, full.shape, (self.out_features, self.in_features))
        self._store_rows(name, full, rows, slice(self.in_start, self.in_start + self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.single:
            return self._gemm(x, self.bias, False)
        y = self._gemm(x, None, False)
        if not self.reduce:
            return y
        y = self.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, for a caller that reduces it itself (the norm after it)."""
        if self.bias is not None:
            raise ValueError("a row-parallel layer with a bias adds it after its own all-reduce: call it whole")
        return self._gemm(x, None, False)


def gemm_calls(model: nn.Module) -> list[GemmCall]:
    """Every GEMM the model runs through ops.linear, one per layer call, in its weight format
    (ops/gemm/tuning.py times those the skinny template takes)."""
    return [call for mod in model.modules() if hasattr(mod, "gemm_calls") for call in mod.gemm_calls()]
