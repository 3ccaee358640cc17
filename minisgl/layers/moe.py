"""The sparse MLP block of MoE models (Qwen2-MoE, Qwen3-MoE, Mixtral, GPT-OSS): a router, the
routed experts stacked into two tensors for the fused kernels, and Qwen2-MoE's shared expert.
GPT-OSS adds biases (router and experts) and its clamped SwiGLU; its checkpoint stacks the
experts transposed ([E, H, 2I] and [E, I, H]) with gate and up columns interleaved, which the
loader turns into our (gate | up) rows.

Tensor parallelism shards every expert's intermediate dimension (as the dense MLP's): each
rank holds all E experts' slices, computes a partial sum of the block's output, and one
all-reduce finishes the block (routed and shared experts together). The router is replicated,
so every rank routes alike.

4-bit experts (INT4 checkpoints: AWQ, GPTQ, compressed-tensors; `quant`) are stacked in
kernels/quant4.py's layout: w13 int32 [E, 2 * I/tp, H / 8] with w13_scale / w13_zero
[E, 2 * I/tp, H / G], w2 int32 [E, H, I/tp / 8] with w2_scale / w2_zero [E, H, I/tp / G], each
expert's projections repacked once at load (layers/quant4_load.py). On the CPU they dequantize
to the 16-bit path's tensors through the fp32 reference; the GPU needs the 4-bit fused MoE kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl import ops
from minisgl.core.model_config import ModelConfig
from minisgl.core.quant_config import QuantConfig
from minisgl.distributed.info import Communicator, TPInfo
from minisgl.kernels.fused_moe import ExpertAct
from minisgl.kernels.quant4 import dequant_int4_reference, dequant_mxfp4_reference
from minisgl.layers.linear import MergedColumnParallelLinear, RowParallelLinear, _check_shape
from minisgl.layers.quant4_load import checkpoint_kinds, to_int4
from minisgl.ops.gemm.table import GemmCall
from minisgl.ops.gemm.w4 import fused_moe_w4


class ReplicatedLinear(nn.Module):
    """A small projection every rank holds whole: the router [E, H], the shared-expert gate [1, H]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ops.linear, not F.linear: at decode batch sizes the tuned table may pick the skinny
        # kernel (cuBLAS's split-K GEMM plus its reduce cost ~3 us per router call).
        return ops.linear(x, self.weight, self.bias)

    def gemm_calls(self) -> list[GemmCall]:
        return [GemmCall(self.weight, False)]


class FusedExperts(nn.Module):
    """All routed experts, stacked: w13 [E, 2 * I/tp, H] holds each expert's (gate | up) rows of
    this rank's shard, w2 [E, H, I/tp] its down-projection columns."""

    checkpoint_kinds: tuple[str, ...] | None = None  # a 4-bit expert projection's tensor suffixes

    def __init__(self, num_experts: int, hidden: int, inter: int, tp: TPInfo, quant: QuantConfig | None = None,
                 gpt_oss: bool = False) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.start, self.local = tp.shard(inter, "the expert intermediate size")
        self.quant = quant if quant is not None and quant.fmt in ("int4", "mxfp4") else None
        # GPT-OSS: b13 [E, 2 I/tp] (gate | up), b2 [E, H]; b2 is added to a partial sum that the
        # block all-reduces, so only rank 0 holds it (the others zeros).
        self.gpt_oss, self.rank = gpt_oss, tp.rank
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * self.local), requires_grad=False) if gpt_oss else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False) if gpt_oss else None
        if self.quant is not None and (self.quant.fmt == "mxfp4") != gpt_oss:
            raise ValueError(f"{self.quant.fmt.upper()} experts: GPT-OSS experts load in 16 bits or MXFP4, "
                             "other models' in 16 bits or INT4")
        if self.quant is None:
            self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.local), requires_grad=False)
            return
        if self.quant.fmt == "mxfp4":
            self._init_mxfp4()
            return
        g = self.quant.group
        if hidden % 8 or self.local % 8 or (g and (hidden % g or self.start % g or self.local % g)):
            raise ValueError(f"4-bit experts: hidden {hidden} and this rank's intermediate slice {self.start}.."
                             f"{self.start + self.local} must fall on groups of {g or 8}: use a smaller "
                             "tensor-parallel size")
        self.checkpoint_kinds = checkpoint_kinds(self.quant)
        self._pending: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        e, loc = num_experts, self.local

        def param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.w13 = param(e, 2 * loc, hidden // 8, dtype=torch.int32)
        self.w13_scale = param(e, 2 * loc, hidden // (g or hidden))
        self.w13_zero = param(e, 2 * loc, hidden // (g or hidden))
        self.w2 = param(e, hidden, loc // 8, dtype=torch.int32)
        self.w2_scale = param(e, hidden, loc // (g or loc))
        self.w2_zero = param(e, hidden, loc // (g or loc))

    def _init_mxfp4(self) -> None:
        """GPT-OSS's MXFP4 experts, kept in kernels/quant4.py's MXFP4 layout: blocks uint8
        [E, rows, K / 2] and e8m0 scales uint8 [E, rows, K / 32]."""
        e, h, loc = self.num_experts, self.hidden, self.local
        if h % 32 or loc % 32 or self.start % 32:
            raise ValueError(f"MXFP4 experts: hidden {h} and this rank's intermediate slice {self.start}.."
                             f"{self.start + loc} must fall on blocks of 32: use a smaller tensor-parallel size")
        self.checkpoint_kinds = ("blocks", "scales")
        u8 = torch.uint8
        self.w13 = nn.Parameter(torch.empty(e, 2 * loc, h // 2, dtype=u8), requires_grad=False)
        self.w13_scale = nn.Parameter(torch.empty(e, 2 * loc, h // 32, dtype=u8), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, loc // 2, dtype=u8), requires_grad=False)
        self.w2_scale = nn.Parameter(torch.empty(e, h, loc // 32, dtype=u8), requires_grad=False)
        self.w13_zero = self.w2_zero = None

    def quantized_on_gpu(self, x: torch.Tensor) -> bool:
        return self.quant is not None and x.device.type == "cuda"

    def w4_experts(self, x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool,
                   shared: torch.Tensor | None, shared_gate: torch.Tensor | None,
                   act: ExpertAct | None = None) -> torch.Tensor:
        """On the GPU: the 4-bit fused MoE (tiles dequantized in the GEMMs) after the routing."""
        weights, ids = ops.moe_route(logits, top_k, renormalize)
        return fused_moe_w4(x, self.quant.fmt, self.w13, self.w13_scale, self.w13_zero, self.w2, self.w2_scale,
                            self.w2_zero, weights, ids, shared, shared_gate, b13=self.b13, b2=self.b2, act=act)

    def weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) for the 16-bit fused MoE: the parameters, or the 4-bit ones dequantized (the
        CPU; on the GPU 4-bit experts go through w4_experts)."""
        if self.quant is None:
            return self.w13, self.w2
        if self.quant.fmt == "mxfp4":
            w13 = dequant_mxfp4_reference(self.w13, self.w13_scale).to(x.dtype)
            return w13, dequant_mxfp4_reference(self.w2, self.w2_scale).to(x.dtype)
        w13 = dequant_int4_reference(self.w13, self.w13_scale, self.w13_zero).to(x.dtype)
        return w13, dequant_int4_reference(self.w2, self.w2_scale, self.w2_zero).to(x.dtype)

    def _load_int4(self, name: str, expert: int, proj: str, kind: str, full: torch.Tensor) -> None:
        if kind not in self.checkpoint_kinds:
            raise ValueError(f"unexpected tensor {name}: a {self.quant.method} expert has {self.checkpoint_kinds}")
        got = self._pending.setdefault((expert, proj), {})
        got[kind] = full
        if len(got) < len(self.checkpoint_kinds):
            return
        del self._pending[(expert, proj)]
        down = proj == "down_proj"
        n, k = (self.hidden, self.inter) if down else (self.inter, self.hidden)
        qw, scales, zeros, perm = to_int4(self.quant, got, name.rpartition(".")[0], n, k)
        if perm is not None:
            raise ValueError(f"{name}: GPTQ act-order (desc_act) experts are not supported")
        if down:  # this rank's K slice
            g = self.quant.group or k
            cols, groups = slice(self.start // 8, (self.start + self.local) // 8), slice(
                self.start // g, self.start // g + self.w2_scale.size(2))
            self.w2.data[expert].copy_(qw[:, cols])
            self.w2_scale.data[expert].copy_(scales[:, groups])
            self.w2_zero.data[expert].copy_(zeros[:, groups])
            return
        shard, rows = slice(self.start, self.start + self.local), self._rows(proj)
        self.w13.data[expert, rows].copy_(qw[shard])
        self.w13_scale.data[expert, rows].copy_(scales[shard])
        self.w13_zero.data[expert, rows].copy_(zeros[shard])

    def _rows(self, proj: str) -> slice:
        return slice(0, self.local) if proj == "gate_proj" else slice(self.local, 2 * self.local)

    def load_expert(self, name: str, expert: int, proj: str, full: torch.Tensor, kind: str = "weight") -> None:
        """One expert's checkpoint tensor: gate_proj / up_proj [I, H] or down_proj [H, I] (4-bit:
        one of the format's tensors of that projection)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"tensor {name}: expert {expert} is outside [0, {self.num_experts})")
        if self.quant is not None:
            self._load_int4(name, expert, proj, kind, full)
            return
        if kind != "weight":
            raise ValueError(f"unexpected tensor {name}: 16-bit experts have weights only")
        shard = slice(self.start, self.start + self.local)
        if proj == "down_proj":
            _check_shape(name, full.shape, (self.hidden, self.inter))
            self.w2.data[expert].copy_(full[:, shard])
        else:
            _check_shape(name, full.shape, (self.inter, self.hidden))
            self.w13.data[expert, self._rows(proj)].copy_(full[shard])

    def load_stacked(self, name: str, proj: str, full: torch.Tensor) -> None:
        """All experts in one tensor (transformers 5's in-memory form): gate_up_proj [E, 2I, H]
        with rows (gate | up), or down_proj [E, H, I]; GPT-OSS's layout (and biases) below."""
        if self.gpt_oss:
            self._load_gpt_oss(name, proj, full)
            return
        e, i, h = self.num_experts, self.inter, self.hidden
        shard = slice(self.start, self.start + self.local)
        if proj == "down_proj":
            _check_shape(name, full.shape, (e, h, i))
            self.w2.data.copy_(full[:, :, shard])
            return
        _check_shape(name, full.shape, (e, 2 * i, h))
        self.w13.data[:, : self.local].copy_(full[:, shard])
        self.w13.data[:, self.local :].copy_(full[:, i + self.start : i + self.start + self.local])

    def _load_gpt_oss(self, name: str, proj: str, full: torch.Tensor) -> None:
        """gate_up_proj [E, H, 2I] (columns gate0, up0, gate1, up1, ...), gate_up_proj_bias
        [E, 2I] (the same order), down_proj [E, I, H], down_proj_bias [E, H]."""
        e, i, h = self.num_experts, self.inter, self.hidden
        shard = slice(self.start, self.start + self.local)
        if proj.endswith(("_blocks", "_scales")):
            self._load_gpt_oss_mxfp4(name, proj, full)
        elif proj == "gate_up_proj":
            _check_shape(name, full.shape, (e, h, 2 * i))
            self.w13.data[:, : self.local].copy_(full[:, :, 0::2][:, :, shard].transpose(1, 2))
            self.w13.data[:, self.local :].copy_(full[:, :, 1::2][:, :, shard].transpose(1, 2))
        elif proj == "gate_up_proj_bias":
            _check_shape(name, full.shape, (e, 2 * i))
            self.b13.data[:, : self.local].copy_(full[:, 0::2][:, shard])
            self.b13.data[:, self.local :].copy_(full[:, 1::2][:, shard])
        elif proj == "down_proj":
            _check_shape(name, full.shape, (e, i, h))
            self.w2.data.copy_(full[:, shard].transpose(1, 2))
        else:
            _check_shape(name, full.shape, (e, h))
            self.b2.data.copy_(full if self.rank == 0 else torch.zeros_like(full))

    def _load_gpt_oss_mxfp4(self, name: str, proj: str, full: torch.Tensor) -> None:
        """gate_up_proj_blocks [E, 2I, H/32, 16] / _scales [E, 2I, H/32] (rows gate0, up0, gate1, ...),
        down_proj_blocks [E, H, I/32, 16] / _scales [E, H, I/32]: the nibble order and exponents are
        our layout's already; rows are split into (gate | up) and this rank's slice taken."""
        if self.quant is None or self.quant.fmt != "mxfp4":
            raise ValueError(f"tensor {name}: MXFP4 experts in a checkpoint without quant_method 'mxfp4'")
        e, i, h = self.num_experts, self.inter, self.hidden
        blocks = proj.endswith("_blocks")
        if proj.startswith("gate_up_proj"):
            _check_shape(name, full.shape, (e, 2 * i, h // 32, 16) if blocks else (e, 2 * i, h // 32))
            dst = self.w13 if blocks else self.w13_scale
            rows = full.reshape(e, 2 * i, -1)
            shard = slice(self.start, self.start + self.local)
            dst.data[:, : self.local].copy_(rows[:, 0::2][:, shard])
            dst.data[:, self.local :].copy_(rows[:, 1::2][:, shard])
            return
        _check_shape(name, full.shape, (e, h, i // 32, 16) if blocks else (e, h, i // 32))
        per = 2 if blocks else 32  # K elements per stored column: two nibbles a byte, 32 per scale
        cols = full.reshape(e, h, -1)[:, :, self.start // per : (self.start + self.local) // per]
        (self.w2 if blocks else self.w2_scale).data.copy_(cols)


class SharedExpert(nn.Module):
    """A dense gated MLP whose down projection is left unreduced (the block reduces once)."""

    def __init__(self, hidden: int, inter: int, tp: TPInfo, comm: Communicator, quant: QuantConfig | None = None,
                 ) -> None:
        super().__init__()
        quant = quant if quant is not None and quant.fmt == "int4" else None  # FP8: 16-bit, as before
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], False, tp, quant=quant)
        self.down_proj = RowParallelLinear(inter, hidden, False, tp, comm, reduce=False, quant=quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, comm: Communicator, quant: QuantConfig | None = None,
                 shared_quant: QuantConfig | None = None) -> None:
        super().__init__()
        moe = cfg.moe
        if moe is None:
            raise ValueError(f"{cfg.architecture} has no MoE configuration")
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.comm = comm
        self.gate = ReplicatedLinear(cfg.hidden_size, moe.num_experts, bias=moe.biases)
        gpt_oss = moe.activation == "gpt_oss"
        self.experts = FusedExperts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, tp, quant, gpt_oss)
        self.act = ExpertAct(moe.activation, moe.swiglu_alpha, moe.swiglu_limit) if gpt_oss else None
        self.has_shared = moe.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = SharedExpert(cfg.hidden_size, moe.shared_expert_intermediate_size, tp, comm,
                                              shared_quant)
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = shared_gate = None
        if self.has_shared:
            shared, shared_gate = self.shared_expert(x), self.shared_expert_gate(x)
        if self.experts.quantized_on_gpu(x):
            out = self.experts.w4_experts(x, self.gate(x), self.top_k, self.renormalize, shared, shared_gate,
                                          self.act)
            return self.comm.all_reduce(out)
        w13, w2 = self.experts.weights(x)
        # The router GEMM inside: a decode step's few tokens route in one kernel (ops/moe_layer.py).
        out = ops.fused_moe_layer(
            x, self.gate.weight, self.gate.bias, w13, w2, self.top_k, self.renormalize,
            shared=shared, shared_gate=shared_gate, b13=self.experts.b13, b2=self.experts.b2, act=self.act,
        )
        return self.comm.all_reduce(out)
