"""Shapes, inputs and the grouped torch baseline shared by fused_moe.py and tune_fused_moe.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from minisgl.kernels import moe_routing

DEV = "cuda"
BF16 = torch.bfloat16
# name -> (experts, top_k, hidden, expert intermediate size)
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336), "gpt-oss-20b": (32, 4, 2880, 2880),
}
M_LIST = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
REPO_CONFIGS = Path(__file__).resolve().parents[2] / "kernels" / "fused_moe_configs.json"


@dataclass
class MoeCase:
    """One input set: hidden states, router logits, and the routing the logits give."""

    x: torch.Tensor  # [M, H] bf16
    logits: torch.Tensor  # [M, E] bf16
    weights: torch.Tensor  # [M, top_k] fp32
    ids: torch.Tensor  # [M, top_k] int32
    hit: int  # experts with at least one token (read on the host, outside any timing)

    @property
    def m(self) -> int:
        return self.x.shape[0]


def make_weights(e: int, h: int, i: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H], w2 [E, H, I], bf16, scaled so activations stay O(1)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, device=DEV, dtype=BF16, generator=g).mul_(h**-0.5)
    w2 = torch.randn(e, h, i, device=DEV, dtype=BF16, generator=g).mul_(i**-0.5)
    return w13, w2


def make_w4_weights(e: int, h: int, i: int, fmt: str, group: int = 128, seed: int = 0):
    """4-bit experts in kernels/quant4.py's layouts: (w13, w2, W4 of w13, W4 of w2) for
    kernels/fused_moe.py's up_gemm / down_gemm. INT4: random nibbles, scales ~0.01 and integer zeros
    per `group`; MXFP4: random bytes, e8m0 scales near 2^-7 (group unused: 32). Only the timing reads
    them. The words are drawn packed (every nibble uniform): packing drawn nibbles took int64
    temporaries of 8 bytes a weight (3.2 GB for Qwen3-30B-A3B's w13), once per compile worker."""
    from minisgl.kernels.fused_moe import W4
    from minisgl.kernels.w4a16_gemm import INT4, MXFP4

    if fmt == "int4" and (h % group or i % group):
        raise ValueError(f"INT4 group {group} must divide H = {h} and I = {i}")
    g = torch.Generator(device=DEV).manual_seed(seed)
    out = []
    for n, k in ((2 * i, h), (h, i)):
        if fmt == "int4":
            w = torch.randint(-(2**31), 2**31 - 1, (e, n, k // 8), device=DEV, dtype=torch.int32, generator=g)
            s = torch.rand(e, n, k // group, device=DEV, generator=g).mul_(0.01).add_(0.001).to(BF16)
            z = torch.randint(0, 16, (e, n, k // group), device=DEV, generator=g).to(BF16)
            out.append((w, W4(s, z, INT4)))
        else:
            w = torch.randint(0, 256, (e, n, k // 2), device=DEV, dtype=torch.uint8, generator=g)
            s = torch.randint(118, 124, (e, n, k // 32), device=DEV, dtype=torch.uint8, generator=g)
            out.append((w, W4(s, None, MXFP4)))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def make_case(e: int, top_k: int, h: int, m: int, seed: int) -> MoeCase:
    g = torch.Generator(device=DEV).manual_seed(1000 + seed)
    x = torch.randn(m, h, device=DEV, dtype=BF16, generator=g)
    logits = torch.randn(m, e, device=DEV, dtype=BF16, generator=g)
    weights, ids = moe_routing.route_reference(logits, top_k, True)
    return MoeCase(x, logits, weights, ids, int(torch.unique(ids).numel()))


def expert_bytes(h: int, i: int, w4: bool = False) -> int:
    return 3 * h * i * 2 // (4 if w4 else 1)  # gate, up, down in bf16 (4-bit: their packed values)


def grouped_reference(case: MoeCase, w13: torch.Tensor, w2: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The baseline: per expert hit, torch.matmul over its routed tokens (gather, gate_up, SiLU
    and mul, down, router weight, index_add), bf16 like transformers' expert loop. The token
    lists are built here, outside the timed call, so it captures in a CUDA graph."""
    inter = w2.shape[2]
    flat = case.ids.reshape(-1).long()
    top_k = case.ids.shape[1]
    groups = []
    for expert in torch.unique(flat).tolist():
        rows = (flat == expert).nonzero().flatten()
        groups.append((expert, rows // top_k, case.weights.reshape(-1)[rows].to(BF16)[:, None]))
    out = torch.empty_like(case.x)

    def run() -> torch.Tensor:
        out.zero_()
        for expert, tok, wt in groups:
            gate_up = case.x[tok] @ w13[expert].t()
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out.index_add_(0, tok, (act @ w2[expert].t()) * wt)
        return out

    return run
