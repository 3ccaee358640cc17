"""MoE routing (Triton + torch reference): router logits -> each token's top-k experts and weights.

Per token row of E logits: scores = softmax (Qwen-MoE, Mixtral) or sigmoid over the experts in
fp32; the top_k largest scores are chosen (largest first; ties go to the lower expert index);
with `renormalize` the chosen scores are divided by their sum (Qwen's `norm_topk_prob`, always
on for Mixtral). Outputs: weights [T, top_k] fp32, expert ids [T, top_k] int32.

Traffic: read T * E logits, write 8 * T * top_k bytes; one program handles BLOCK_T rows.

`route_linear` takes the router's GEMM too, for a decode step's few tokens: per token, programs
split H (~4k weight elements each: GPT-OSS's 32 x 2880 router is 23 programs) and write fp32
partial logits; the last to arrive (a counter) sums them in a fixed order, rounds the logits to x's
dtype as the router's own linear layer would, and routes them. One launch instead of two (router
GEMM, routing); each token re-reads the weight (from L2 after the first), so it is for small T and
small routers. (One program per token reading the whole weight took 10.6 us on the H100.)
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


@triton.jit
def _route_linear_kernel(X, W, B, Part, Counters, Weights, Ids, H, E, stride_x, stride_w, TOP_K: tl.constexpr,
                         SPLITS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
                         RENORMALIZE: tl.constexpr):
    """Program (t, s): token t's logits over H range [s * BLOCK_H, ...) into Part[t, s]; the last
    of the token's SPLITS programs to arrive (a counter, reset by it) sums them in split order."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    cols = tl.arange(0, BLOCK_E)
    hs = s * BLOCK_H + tl.arange(0, BLOCK_H)
    xv = tl.load(X + t * stride_x + hs, mask=hs < H, other=0.0).to(tl.float32)
    wv = tl.load(W + cols.to(tl.int64)[:, None] * stride_w + hs[None, :],
                 mask=(cols[:, None] < E) & (hs[None, :] < H), other=0.0).to(tl.float32)
    tl.store(Part + (t * SPLITS + s) * BLOCK_E + cols, tl.sum(wv * xv[None, :], axis=1))
    # Every thread's partial is stored before one thread's release: the split-K semaphore pattern.
    tl.debug_barrier()
    arrived = tl.atomic_add(Counters + t, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        logits = tl.zeros((BLOCK_E,), dtype=tl.float32)
        for j in tl.static_range(SPLITS):  # fixed order: the same bits whichever program is last
            logits += tl.load(Part + (t * SPLITS + j) * BLOCK_E + cols, cache_modifier=".cg")
        if HAS_BIAS:
            logits += tl.load(B + cols, mask=cols < E, other=0.0).to(tl.float32)
        # The router layer's output dtype: the same rounding as routing its linear output.
        logits = logits.to(X.dtype.element_ty).to(tl.float32)
        weights, ids = topk_rows(tl.reshape(logits, (1, BLOCK_E)), cols, E, TOP_K, BLOCK_K, SIGMOID, RENORMALIZE)
        slots = tl.arange(0, BLOCK_K)
        out = t * TOP_K + slots[None, :]
        ok = slots[None, :] < TOP_K
        tl.store(Weights + out, weights, mask=ok)
        tl.store(Ids + out, ids, mask=ok)
        tl.store(Counters + t, 0)  # every program of this token has arrived: ready for the next launch


def route_linear_splits(num_experts: int, hidden: int) -> tuple[int, int]:
    """(BLOCK_H, programs per token): ~4k weight elements per program."""
    block_h = max(16, min(1024, 4096 // triton.next_power_of_2(num_experts), triton.next_power_of_2(hidden)))
    return block_h, triton.cdiv(hidden, block_h)


def route_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                 counters: torch.Tensor, scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (last dim packed), router weight [E, H] (rows packed), bias [E] or None ->
    route(x W^T + b) as (weights [T, top_k] fp32, ids [T, top_k] int32). counters: int32 [>= T],
    zero, left zero (allocated outside any CUDA-graph capture)."""
    t, h = x.shape
    e = weight.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    block_h, splits = route_linear_splits(e, h)
    part = torch.empty(t, splits, block_e, dtype=torch.float32, device=x.device)
    _route_linear_kernel[(t, splits)](
        x, weight, weight if bias is None else bias, part, counters, weights, ids, h, e, x.stride(0),
        weight.stride(0), TOP_K=top_k, SPLITS=splits, BLOCK_E=block_e, BLOCK_H=block_h,
        BLOCK_K=triton.next_power_of_2(top_k), HAS_BIAS=bias is not None, SIGMOID=scoring == "sigmoid",
        RENORMALIZE=renormalize, num_warps=4,
    )
    return weights, ids


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
