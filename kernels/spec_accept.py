"""Speculative decoding: accept or reject every request's draft tokens in one launch (Triton),
beside an fp32 torch reference with the same semantics and random numbers.

A verify step runs, per request b, its last token and its k_b draft tokens d_1..d_k through
the target: rows Cu[b] .. Cu[b] + k_b of `logits` (row Cu[b] + j predicts the token after
the j-th input, i.e. the position of d_{j+1}; the last row predicts the token after d_k).
Per row j (one program each; rows of one request run in parallel):
  p = the target distribution after temperature, top-k, top-p and min-p (the sampler's
      filters, kernels/sampling.py; greedy: one-hot on the argmax);
  j < k_b:  with the draft's distribution q (x = d_{j+1}): accept x with probability
            min(1, p(x) / q(x)); the fallback, used when row j holds the first rejection, is a
            draw from normalize(max(0, p - q)). A greedy drafter (q one-hot on x): the row draws
            from p exactly as the plain sampler would, accepts x when that draw is x (probability
            p(x), as the rejection test u < p(x)), and otherwise the draw is the fallback (a draw
            from p conditioned on not x: the same law as p without x). So a seeded request's
            tokens are the plain sampler's tokens, with or without a draft (logits equal);
  j == k_b: the bonus token, a draw from p.
num_accepted[b] = the first rejected row (k_b when all pass; an atomic min over the rows),
and tokens[b, :num_accepted[b] + 1] are the request's new tokens: d_1..d_n, then the fallback
(or bonus) of row n. This is exact rejection sampling: each emitted token is distributed as
the non-speculative sampler's (Leviathan et al. 2023).

Random numbers: row j of a request at generation step s (tokens generated so far) uses the
Philox counter (seed, s + j), the sampling kernel's: output 0 draws (so a request with no
draft, or a greedy drafter's, samples exactly the tokens the plain sampler would), output 1
decides acceptance against a non-one-hot q. Each
step's counter decides that step's token only once, so draws stay independent across steps.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl

from .sampling import LOG2E, _filter_threshold, _row_stats, default_config, filtered_probs_reference
from .sampling_search import _draw


@triton.jit
def _kept_mass(row, V, thr, m, inv_t, min_p, BLOCK: tl.constexpr):
    """sum of w = exp((x - m) / T) over the kept set {x >= thr, w >= min_p}."""
    lane = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + lane
        x = tl.load(row + idx, mask=idx < V, other=float("-inf"))
        w = tl.exp2((x - m) * inv_t)
        acc += tl.where((x >= thr) & (w >= min_p), w, 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _accept_kernel(
    Logits, stride_l, V, Cu, Drafts, stride_d, Q, stride_q, Temp, TopK, TopP, MinP, Seeds, Steps,
    OutTok, OutLogp, stride_o, NumAcc, Scratch, stride_s, BLOCK: tl.constexpr, NB: tl.constexpr,
    PER_LANE: tl.constexpr, WALK: tl.constexpr, MAX_PASSES: tl.constexpr, HAS_Q: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    lo = tl.load(Cu + b)
    k = tl.load(Cu + b + 1) - lo - 1  # draft tokens of this request
    if j <= k:
        t = (lo + j).to(tl.int64)  # this program's row of logits (and of Q)
        row = Logits + t * stride_l
        temp = tl.load(Temp + b)
        inv_t = LOG2E / tl.where(temp > 0, temp, 1.0)  # greedy rows: any finite value
        lm, m, s, s_t, amax, mn, nfin = _row_stats(row, V, inv_t, BLOCK)
        is_draft = j < k
        x = tl.load(Drafts + b * stride_d + j, mask=is_draft, other=0).to(tl.int32)
        lx = tl.load(row + x)
        accept = is_draft & (x == amax)  # greedy: p is one-hot on the argmax (exact for any q)
        tok = amax
        if temp > 0:
            min_p = tl.load(MinP + b)
            thr = _filter_threshold(row, V, Scratch + t * stride_s, lm, m, s_t, mn, nfin, tl.load(TopK + b),
                                    tl.load(TopP + b), inv_t, BLOCK, NB, PER_LANE, MAX_PASSES)
            inv_S = 1.0 / _kept_mass(row, V, thr, m, inv_t, min_p, BLOCK)
            w_x = tl.exp2((lx - m) * inv_t)
            p_x = tl.where((lx >= thr) & (w_x >= min_p), w_x * inv_S, 0.0)
            q_row = Q + t * stride_q
            q_x = 1.0
            if HAS_Q:
                q_x = tl.load(q_row + x, mask=is_draft, other=1.0)
            step = tl.load(Steps + b) + j
            zero = tl.zeros([], tl.uint32)
            r0, r1, _, _ = tl.philox(tl.load(Seeds + b), (step & 0xFFFFFFFF).to(tl.uint32),
                                     ((step >> 32) & 0xFFFFFFFF).to(tl.uint32), zero, zero)
            if HAS_Q:
                accept = is_draft & (tl.uint_to_uniform_float(r1) * q_x < p_x)
                if accept == 0:
                    # Bonus row: a draw from p. Draft row: from max(0, p - q).
                    tok = _draw(row, V, thr, m, inv_t, min_p, tl.uint_to_uniform_float(r0), q_row, is_draft,
                                inv_S, -1, HAS_Q, False, BLOCK, WALK)
                    tok = tl.where(tok >= 0, tok, x)  # p == q up to rounding: nothing left to draw
            else:
                # One-hot q: the plain sampler's own draw from p, accepted when it is the draft.
                tok = _draw(row, V, thr, m, inv_t, min_p, tl.uint_to_uniform_float(r0), q_row, False, inv_S, -1,
                            HAS_Q, False, BLOCK, WALK)
                tok = tl.where(tok >= 0, tok, amax)  # no kept weight (rounding): the argmax
                accept = is_draft & (tok == x)
        tok = tl.where(accept, x, tok)
        tl.store(OutTok + b * stride_o + j, tok.to(tl.int64))
        tl.store(OutLogp + b * stride_o + j, tl.load(row + tok) - m - tl.log(s))
        if accept == 0:
            tl.atomic_min(NumAcc + b, j)


def accept(
    logits: torch.Tensor, cu: torch.Tensor, drafts: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
    top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
    q: torch.Tensor | None = None, config: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits fp32 [T, V] (T = sum of 1 + k_b; last dim packed); cu int32 [B + 1] row offsets;
    drafts int64 [B, K] (K >= every k_b; entries past k_b ignored); per-request sampling
    params [B] as the sampler's; q fp32 [T, V] draft probabilities (row Cu[b] + j: the
    distribution d_{j+1} was drawn from), None for greedy drafters (one-hot).
    -> (tokens int64 [B, K + 1], logprobs f32 [B, K + 1], num_accepted int32 [B]); entries
    past num_accepted[b] are unspecified."""
    t_rows, v = logits.shape
    b, kmax = drafts.shape
    cfg = {**default_config(logits.device), **(config or {})}
    tokens = torch.empty(b, kmax + 1, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, kmax + 1, dtype=torch.float32, device=logits.device)
    num_acc = torch.full((b,), kmax, dtype=torch.int32, device=logits.device)
    if b == 0:
        return tokens, logprobs, num_acc
    block, per_lane = cfg["BLOCK"], cfg["PER_LANE"]
    scratch = torch.empty((t_rows, 3 * block * per_lane), dtype=torch.float32, device=logits.device)
    walk = min(256, triton.next_power_of_2(triton.cdiv(v, block)))
    qq = logits if q is None else q  # HAS_Q off: never read
    dd = drafts if kmax > 0 else torch.zeros(b, 1, dtype=torch.int64, device=logits.device)  # never read
    _accept_kernel[(b, kmax + 1)](
        logits, logits.stride(0), v, cu, dd, dd.stride(0), qq, qq.stride(0), temperature, top_k, top_p,
        min_p, seeds, steps, tokens, logprobs, tokens.stride(0), num_acc, scratch, scratch.stride(0),
        BLOCK=block, NB=cfg["NB"], PER_LANE=per_lane, WALK=walk, MAX_PASSES=40, HAS_Q=q is not None,
        num_warps=cfg["num_warps"],
    )
    return tokens, logprobs, num_acc


# ---- the reference ----

_M32 = np.uint64(0xFFFFFFFF)


def philox_uniforms(seeds: np.ndarray, counters: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(u0, u1) fp32: outputs 0 and 1 of Philox4x32-10 at key `seed` (uint64) and counter
    (lo, hi, 0, 0) of `counters` (int64), as tl.philox + tl.uint_to_uniform_float compute them."""
    seed = seeds.astype(np.int64).view(np.uint64)
    ctr = counters.astype(np.int64).view(np.uint64)
    c0, c1 = ctr & _M32, ctr >> np.uint64(32)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = seed & _M32, seed >> np.uint64(32)
    ra, rb = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        prod_b, prod_a = rb * c2, ra * c0  # < 2**64: no wrap-around
        c0, c1, c2, c3 = ((prod_b >> np.uint64(32)) ^ c1 ^ k0, prod_b & _M32,
                          (prod_a >> np.uint64(32)) ^ c3 ^ k1, prod_a & _M32)
        k0 = (k0 + np.uint64(0x9E3779B9)) & _M32
        k1 = (k1 + np.uint64(0xBB67AE85)) & _M32

    def uniform(r: np.ndarray) -> np.ndarray:
        i = r.astype(np.uint32).view(np.int32)
        i = np.where(i < 0, ~i, i)
        return i.astype(np.float32) * np.float32(4.6566127342e-10)

    return uniform(c0), uniform(c1)


def lane_major_order(v: int, block: int) -> torch.Tensor:
    """The kernel's draw order: element i sits in lane i % block; lanes in turn, each in order."""
    idx = torch.arange(v)
    return torch.argsort(idx % block * v + idx // block)


def accept_reference(
    logits: torch.Tensor, cu: torch.Tensor, drafts: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
    top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
    q: torch.Tensor | None = None, block: int | None = None,
    draw_uniforms: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same contract and random numbers as `accept`, vectorized over rows in torch (sort-based
    filters). `block`: draw in the kernel's lane-major order for that many lanes (tests compare
    tokens with the kernel's); None draws in vocabulary order (an equally exact sampler).
    `draw_uniforms(seeds, counters)`: the draw's uniform per row instead of Philox output 0 (the
    CPU engine passes its plain sampler's, ops/spec_accept.py, so a greedy drafter leaves seeded
    tokens as that sampler draws them)."""
    dev = logits.device
    t_rows, v = logits.shape
    b, kmax = drafts.shape
    cu_l = cu.long().cpu()
    counts = (cu_l[1:] - cu_l[:-1]).tolist()
    req = torch.repeat_interleave(torch.arange(b), torch.tensor(counts, dtype=torch.long))  # [T]
    pos = torch.arange(t_rows) - cu_l[req]  # j of each row
    k_row = torch.tensor(counts, dtype=torch.long)[req] - 1
    is_draft = pos < k_row
    x = torch.where(is_draft, drafts.cpu()[req, pos.clamp(max=kmax - 1)] if kmax else 0, 0)
    req_d, x_d, is_draft_d = req.to(dev), x.to(dev), is_draft.to(dev)

    amax = logits.argmax(dim=-1)
    tok = amax.clone()  # greedy rows: the argmax, accepted when it is the draft
    accept_row = is_draft_d & (x_d == amax)
    s = (temperature[req_d] > 0).nonzero().squeeze(1)  # sampled rows (the only ones sorted)
    if s.numel():
        rs = req_d[s]
        # One row at a time, as the deterministic mode's CPU sampler filters (a reduction over
        # several rows may split a row differently: a draw near a boundary would flip).
        probs = torch.cat([filtered_probs_reference(logits[i : i + 1], temperature[r : r + 1], top_k[r : r + 1],
                                                    top_p[r : r + 1], min_p[r : r + 1])
                           for i, r in zip(s.tolist(), rs.tolist())])
        xs, ds = x_d[s], is_draft_d[s]
        ar = torch.arange(s.numel(), device=dev)
        p_x = probs[ar, xs]
        q_x = torch.ones_like(p_x) if q is None else q[s, xs].float()
        s_h = s.cpu().numpy()
        row_seeds = seeds.cpu().numpy()[req.numpy()[s_h]]
        counters = steps.cpu().numpy()[req.numpy()[s_h]] + pos.numpy()[s_h]
        u0, u1 = philox_uniforms(row_seeds, counters)
        if draw_uniforms is not None:
            u0 = draw_uniforms(row_seeds, counters)
        u0_t, u1_t = torch.from_numpy(u0).to(dev), torch.from_numpy(u1).to(dev)
        if q is None:  # one-hot q: the plain draw from p, accepted when it is the draft (below)
            resid = probs
        else:
            resid = torch.where(ds[:, None], (probs - q[s].float()).clamp(min=0.0), probs)
        order = lane_major_order(v, block).to(dev) if block is not None else torch.arange(v, device=dev)
        cdf = resid[:, order].double().cumsum(dim=-1)
        target = (u0_t.double() * cdf[:, -1])[:, None]
        pick = order[torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=v - 1)]
        if q is None:
            tok[s] = torch.where(cdf[:, -1] > 0, pick, amax[s])
            accept_row[s] = ds & (tok[s] == xs)
        else:
            tok[s] = torch.where(cdf[:, -1] > 0, pick, xs)  # nothing left to draw: p == q
            accept_row[s] = ds & (u1_t * q_x < p_x)
    tok = torch.where(accept_row, x_d, tok)
    # The plain reference sampler's formula (ops.sample_reference), one row at a time as the
    # deterministic sampler calls it: a verify row's logprob is a decode's bit for bit.
    logp = torch.stack([torch.log_softmax(logits[r : r + 1].float(), dim=-1)[0, tok[r]] for r in range(t_rows)]) \
        if t_rows else logits.new_zeros(0)

    tokens = torch.zeros(b, kmax + 1, dtype=torch.int64, device=dev)
    logprobs = torch.zeros(b, kmax + 1, dtype=torch.float32, device=dev)
    tokens[req_d, pos.to(dev)] = tok
    logprobs[req_d, pos.to(dev)] = logp
    rejected = torch.where(accept_row, kmax + 1, pos.to(dev))
    num_acc = torch.full((b,), kmax + 1, dtype=torch.int64, device=dev).scatter_reduce(0, req_d, rejected, "amin")
    return tokens, logprobs, num_acc.to(torch.int32)
