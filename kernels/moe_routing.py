"""MoE routing (Triton + torch reference): router logits -> each token's top-k experts and weights.

Per token row of E logits: scores = softmax (Qwen-MoE, Mixtral) or sigmoid over the experts in
fp32; the top_k largest scores are chosen (largest first; ties go to the lower expert index);
with `renormalize` the chosen scores are divided by their sum (Qwen's `norm_topk_prob`, always
on for Mixtral). Outputs: weights [T, top_k] fp32, expert ids [T, top_k] int32.

Traffic: read T * E logits, write 8 * T * top_k bytes; one program handles BLOCK_T rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def topk_rows(x, cols, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr,
              RENORMALIZE: tl.constexpr):
    """x [R, BLOCK_E] fp32 logits (any value in columns >= E) -> (weights [R, BLOCK_K] fp32,
    ids [R, BLOCK_K] int32); slots >= TOP_K hold weight 0 and id -1."""
    valid = cols[None, :] < E
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        x = tl.where(valid, x, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = p / tl.sum(tl.where(valid, p, 0.0), axis=1)[:, None]
    s = tl.where(valid, s, -1.0)  # scores are >= 0: padding columns are never chosen
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((x.shape[0], BLOCK_K), dtype=tl.float32)
    ids = tl.full((x.shape[0], BLOCK_K), -1, dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(s, axis=1)
        idx = tl.min(tl.where(s == best[:, None], cols[None, :], E - 1), axis=1)
        # A NaN row matches nothing and keeps E - 1: ids stay in range whatever the logits hold.
        weights = tl.where(slots[None, :] == j, best[:, None], weights)
        ids = tl.where(slots[None, :] == j, idx[:, None], ids)
        s = tl.where(cols[None, :] == idx[:, None], -2.0, s)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    return weights, ids


@triton.jit
def _route_kernel(Logits, Weights, Ids, T, E, stride_l, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr,
                  RENORMALIZE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    x = tl.load(Logits + rows.to(tl.int64)[:, None] * stride_l + cols[None, :],
                mask=row_ok[:, None] & (cols[None, :] < E), other=0.0).to(tl.float32)
    weights, ids = topk_rows(x, cols, E, TOP_K, BLOCK_K, SIGMOID, RENORMALIZE)
    slots = tl.arange(0, BLOCK_K)
    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    ok = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(Weights + out, weights, mask=ok)
    tl.store(Ids + out, ids, mask=ok)


def route_block_t(num_experts: int) -> int:
    """Rows per program: a [BLOCK_T, BLOCK_E] tile of about 2k fp32 scores."""
    return max(1, min(16, 2048 // triton.next_power_of_2(num_experts)))


def route(logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (last dim packed) -> (weights [T, top_k] fp32, ids [T, top_k] int32)."""
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    block_t = route_block_t(e)
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, weights, ids, t, e, logits.stride(0), TOP_K=top_k, BLOCK_T=block_t,
        BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k),
        SIGMOID=scoring == "sigmoid", RENORMALIZE=renormalize, num_warps=4,
    )
    return weights, ids


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformers routers' math (Qwen2/3-MoE, Mixtral): fp32 scores, topk, renormalize."""
    x = logits.float()
    scores = torch.sigmoid(x) if scoring == "sigmoid" else torch.softmax(x, dim=-1)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
