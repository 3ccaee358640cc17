"""Fused MoE expert GEMMs (Triton) beside the grouped torch reference.

Weights, stacked per expert (this rank's TP shard of the intermediate dim I):
  w13 [E, 2I, H] rows (gate | up);  w2 [E, H, I].
For the N = T * top_k assignments a = t * top_k + j, grouped by expert into BLOCK_M-row blocks
(moe_align.py):
  1. up:   inter[a] = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T)  -- both products in one program,
           the SiLU-and-mul in its epilogue; inter is [N, I] in x's dtype.
  2. down: y[a] = weight[a] * (inter[a] @ w2_e^T)             -- the router weight in the epilogue.
  3. sum:  out[t] = sum_j y[t * top_k + j] (+ sigmoid(shared_gate[t]) * shared[t]), fp32, one rounding.
GPT-OSS: b13 [E, 2I] (gate | up) and b2 [E, H] biases join the products before the activation
and before the router weight; its activation (`act` "gpt_oss") is (clamp(up, -L, L) + 1) *
g * sigmoid(alpha g), g = min(gate, L).
Products accumulate in fp32 (fp32 inputs: exact "ieee" dots). Each program owns a BLOCK_M x
BLOCK_N output tile of one expert; blocks whose expert is -1 (past the routed rows) exit at once.
Traffic at small T: the hit experts' weights, read once; at large T, tensor-core bound.

Deterministic mode (`splits`, ops/moe.py) sums as the skinny MoE kernel does in that mode
(csrc/skinny_moe.cuh skinny_moe_kernel with warp_ranges), so a token's rows are the same bits at
every batch size, 1-2 tokens there and more here: K in `splits` fixed splits, each a chain of
k16 steps in plain K order from zero, added in split order to a zero total; then the bias, the
activation as nvcc compiles the CUDA epilogue (`_act_exact`: ex2.approx, div.rn, on the GPU), the
router weight; the down projection writes each slot's weighted row in fp32 and `moe_sum` adds a
token's slots in order and rounds once, as the CUDA kernel's split-K reduction over slots does.

4-bit experts (W_FMT = kernels/w4a16_gemm.INT4 or MXFP4): W is the quant4 layout stacked on [E]
(w13 [E, 2I, H/8] int32 or [E, 2I, H/2] uint8, scales / zeros [E, 2I, H/group]), each weight tile
dequantised in registers by w4a16_gemm.dequant_tile; everything else is the 16-bit kernel's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minisgl.kernels.fused_moe_config import GemmTile
from minisgl.kernels.tile_order import grouped_tile
from minisgl.kernels.w4a16_gemm import dequant_tile, scale_span

# u * (g / (1 + 2^(a * -log2(e)))), the instructions nvcc emits for csrc/skinny_gemm.cuh store_pair's
# gated epilogue, `lo / (1.0f + __expf(-lo)) * hi` (a = g) or GPT-OSS's (a = alpha * g, u = up + 1):
# no fast-math, so an IEEE division, and __expf's ex2.approx. Triton's own exp and `/` differ.
_ACT_EXACT = tl.constexpr("""{ .reg .f32 t, e, d, q;
mul.rn.f32 t, $2, 0fBFB8AA3B; ex2.approx.f32 e, t; add.rn.f32 d, e, 0f3F800000;
div.rn.f32 q, $1, d; mul.rn.f32 $0, $3, q; }""")


@triton.jit
def _act_exact(g, a, u, EXACT: tl.constexpr):
    if EXACT:
        return tl.inline_asm_elementwise(_ACT_EXACT, "=f,f,f,f", [g, a, u], dtype=tl.float32, is_pure=True, pack=1)
    else:  # the interpreter runs no PTX (and the default mode needs no match)
        return g / (1.0 + tl.exp(-a)) * u


# The row counts vary with every batch size: not specializing on them keeps one compile per tile.
@triton.jit(do_not_specialize=["num_valid", "num_blocks"])
def _moe_gemm_kernel(
    A, W, C, TopkWeights, SortedIds, ExpertIds, S, Z, Bias,
    num_valid, N, K, num_blocks, q_group, k_split,
    stride_am, stride_we, stride_wn, stride_wk, stride_cm, stride_se, stride_sn, stride_be, alpha, limit,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    GPT_OSS_ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, W_FMT: tl.constexpr, CHAINS: tl.constexpr,
    EXACT_ACT: tl.constexpr, SPAN: tl.constexpr,
):
    # Grouped order: GROUP_M consecutive row blocks (mostly one expert) sweep the N tiles
    # together, so an expert's weight tiles are reused from L2 at large T.
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    if expert < 0:
        return
    sid = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = sid < num_valid
    a_rows = (sid // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if CHAINS:  # deterministic mode: each k_split-long chain joins these in split order
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if W_FMT != 0:  # this expert's packed weight, scales and zeros (same strides as the scales)
        wq = W + expert * stride_we
        sq = S + expert * stride_se
        zq = Z + expert * stride_se
    for k0 in range(0, K, BLOCK_K):
        if W_FMT != 0:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = dequant_tile(wq, sq, zq, k0, offs_n, n_ok, K, stride_wn, stride_sn, q_group, W_FMT,
                             A.dtype.element_ty, BLOCK_K, SPAN)
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        if GATED:  # the up rows sit N rows below the gate rows
            if W_FMT != 0:
                u = dequant_tile(wq + N * stride_wn, sq + N * stride_sn, zq + N * stride_sn, k0, offs_n, n_ok, K,
                                 stride_wn, stride_sn, q_group, W_FMT, A.dtype.element_ty, BLOCK_K, SPAN)
            elif EVEN_K:
                u = tl.load(w_ptrs + N * stride_wn, mask=n_ok[None, :], other=0.0)
            else:
                u = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(a, u, acc_up, input_precision=DOT_PREC)
        if CHAINS:
            if ((k0 + BLOCK_K) % k_split == 0) | (k0 + BLOCK_K >= K):  # a split ends (k_split % BLOCK_K == 0)
                total += acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if GATED:
                    total_up += acc_up
                    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if CHAINS:
        acc = total
        acc_up = total_up
    if HAS_BIAS:  # (gate | up) rows of the bias as of the weight
        b_ptrs = Bias + expert * stride_be + offs_n
        acc += tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptrs + N, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if GPT_OSS_ACT:
            g = tl.minimum(acc, limit)
            u = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = _act_exact(g, g * alpha, u + 1.0, EXACT_ACT)
        else:
            acc = _act_exact(acc, acc, acc_up, EXACT_ACT)
    if MUL_WEIGHT:
        acc = acc * tl.load(TopkWeights + sid, mask=row_ok, other=0.0)[:, None]
    c_ptrs = C + sid.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_kernel(Y, Out, Shared, SharedGate, H, stride_sg, TOP_K: tl.constexpr,
                    HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(Y + (t * TOP_K + j) * H + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_SHARED:
        g = tl.load(SharedGate + t * stride_sg).to(tl.float32)
        acc += tl.load(Shared + t * H + offs, mask=ok, other=0.0).to(tl.float32) / (1.0 + tl.exp(-g))
    tl.store(Out + t * H + offs, acc.to(Out.dtype.element_ty), mask=ok)


def _gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
          sorted_ids: torch.Tensor, expert_ids: torch.Tensor, n_out: int, a_row_div: int, gated: bool,
          block_m: int, tile: GemmTile, w4: W4 | None = None, bias: torch.Tensor | None = None,
          act: ExpertAct | None = None, splits: int = 0) -> None:
    k = a.shape[1]
    chains = splits > 0
    k_split = k
    if splits > 1:
        k_split = k // splits
        tile = replace(tile, block_k=math.gcd(tile.block_k, k_split))
        # (on the GPU the skinny MoE kernel's warps cut K at multiples of 128: so must the splits here)
        align = 128 if a.is_cuda else 16
        if k % splits or k_split % align:
            raise ValueError(f"fused MoE: K {k} does not cut into {splits} splits of a multiple of {align}")
    blocks = expert_ids.numel()
    grid = (blocks * triton.cdiv(n_out, tile.block_n),)
    s = w4.scales if w4 is not None else w
    z = w4.zeros if w4 is not None and w4.zeros is not None else s
    gpt_oss = act is not None and act.kind == "gpt_oss"
    _moe_gemm_kernel[grid](
        a, w, c, topk_weights, sorted_ids, expert_ids, s, z, w if bias is None else bias, c.shape[0], n_out, k,
        blocks, k // s.shape[2] if w4 is not None else 1, k_split,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), c.stride(0),
        s.stride(0) if w4 is not None else 0, s.stride(1) if w4 is not None else 0,
        0 if bias is None else bias.stride(0), act.alpha if gpt_oss else 1.0, act.limit if gpt_oss else 0.0,
        A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=not gated, HAS_BIAS=bias is not None, GPT_OSS_ACT=gpt_oss,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        EVEN_K=k % tile.block_k == 0, DOT_PREC="ieee" if a.dtype == torch.float32 else "tf32",
        W_FMT=w4.fmt if w4 is not None else 0, CHAINS=chains, EXACT_ACT=chains and a.is_cuda,
        SPAN=8 if w4 is None else scale_span(k // s.shape[2], tile.block_k),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )


@dataclass(frozen=True)
class ExpertAct:
    """The experts' gated activation: "silu" (silu(gate) * up) or GPT-OSS's clamped SwiGLU."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """fp32 reference."""
        if self.kind == "silu":
            return torch.nn.functional.silu(gate) * up
        g = gate.clamp(max=self.limit)
        return g * torch.sigmoid(g * self.alpha) * (up.clamp(-self.limit, self.limit) + 1)


class W4(NamedTuple):
    """A 4-bit expert weight's scales (and INT4 zeros) and its format (w4a16_gemm.INT4 / MXFP4)."""

    scales: torch.Tensor
    zeros: torch.Tensor | None
    fmt: int


def up_gemm(x: torch.Tensor, w13: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
            top_k: int, block_m: int, tile: GemmTile, w4: W4 | None = None, b13: torch.Tensor | None = None,
            act: ExpertAct | None = None, splits: int = 0) -> torch.Tensor:
    """Step 1: x [T, H] -> inter [T * top_k, I]. splits > 0: deterministic mode's sums, K = H in
    that many splits."""
    inter = torch.empty(x.shape[0] * top_k, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    _gemm(x, w13, inter, inter, sorted_ids, expert_ids, inter.shape[1], top_k, True, block_m, tile, w4, b13, act,
          splits)
    return inter


def down_gemm(inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, sorted_ids: torch.Tensor,
              expert_ids: torch.Tensor, block_m: int, tile: GemmTile, w4: W4 | None = None,
              b2: torch.Tensor | None = None, splits: int = 0) -> torch.Tensor:
    """Step 2: inter [N, I] -> router-weighted y [N, H]; splits > 0: deterministic mode's sums, K = I
    in that many splits, and y in fp32 (moe_sum rounds once)."""
    dtype = torch.float32 if splits > 0 else inter.dtype
    y = torch.empty(inter.shape[0], w2.shape[1], dtype=dtype, device=inter.device)
    _gemm(inter, w2, y, topk_weights, sorted_ids, expert_ids, y.shape[1], 1, False, block_m, tile, w4, b2,
          splits=splits)
    return y


def moe_sum(y: torch.Tensor, top_k: int, shared: torch.Tensor | None = None,
            shared_gate: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Step 3: y [T * top_k, H] -> out [T, H] (+ sigmoid(shared_gate [T, 1]) * shared [T, H]), in
    `dtype` (default y's)."""
    t, h = y.shape[0] // top_k, y.shape[1]
    out = torch.empty(t, h, dtype=dtype or y.dtype, device=y.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(h))
    has_shared = shared is not None
    _moe_sum_kernel[(t, triton.cdiv(h, block))](
        y, out, shared if has_shared else y, shared_gate if has_shared else y,
        h, shared_gate.stride(0) if has_shared else 0, TOP_K=top_k, HAS_SHARED=has_shared, BLOCK_H=block,
        num_warps=4,
    )
    return out


def fused_experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, act: ExpertAct | None = None,
) -> torch.Tensor:
    """Grouped torch reference in x's dtype (transformers' expert loop): per expert hit, its
    tokens' rows through gate_up, SiLU-and-mul, down, times the router weight, summed in fp32.
    Reads the routing on the host (a reference, not a graph-capturable path)."""
    t, top_k = topk_ids.shape
    inter = w2.shape[2]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        rows = order[start : start + c]
        start += c
        tok = rows // top_k
        gate_up = x[tok] @ w13[e].t()
        if b13 is not None:
            gate_up = gate_up + b13[e]
        h = (act or ExpertAct())(gate_up[:, :inter].float(), gate_up[:, inter:].float()).to(x.dtype)
        y = h @ w2[e].t()
        if b2 is not None:
            y = y + b2[e]
        y = y.float() * topk_weights.reshape(-1)[rows, None].float()
        out.index_add_(0, tok, y.to(x.dtype).float())
    if shared is not None:
        out += torch.sigmoid(shared_gate.float()) * shared.float()
    return out.to(x.dtype)
