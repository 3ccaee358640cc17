"""Batched sampling without a vocabulary sort (Triton), beside a sort-based fp32 reference.

Per row: temperature T (<= 0: greedy), top-k, top-p, min-p, then one draw that depends only on
(seed, step). Every filter keeps an upper set of the logits, so the kept set is
{x >= thr and w(x) >= min_p} with w(x) = exp((x - max) / T) = p(x) / p_max, and
    t_k = largest logit a with  #{x >= a}          >= k              (the k-th largest)
    t_p = largest logit a >= t_k with mass{x >= a} >= top_p * mass{x >= t_k}
    thr = max(t_k, t_p)   (min-p needs no search: it compares w with min_p directly).
Ties at a threshold are all kept (the sort-based reference keeps exactly k in sort order;
the two differ only on tied logits).

Both thresholds come from one bracket search (kernels/sampling_search.py): a pass computes,
for NB pivots spread over the bracket [lo, hi), the count (or mass) at or above each pivot,
keeps the sub-bracket where the target is crossed, and copies the bracket's elements into
per-lane scratch slots; it ends when the bracket holds one distinct value. Once a copy fits,
later passes read only the copy (usually a few elements per lane). A cheap starting bracket
comes from pass A's lane maxima: at least k elements are >= the k-th largest lane maximum, so
for top-k (k <= BLOCK) one copy pass of the elements >= it replaces the vocabulary scans;
the same holds for top-p when the top lane maxima alone carry top_p of the mass.
The draw is one more pass: an inverse CDF in lane-major order with one Philox uniform keyed
by (seed, step).

One program per row: passes never synchronize across programs, and a row's result does not
depend on the rest of the batch. log-probs come from the raw logits (log_softmax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling_search import _draw, _lane_pass, _search

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _lane_stats(x, idx, lm, ls, lt, la, lmn, lf, inv_t):
    """Pass A's lane-wise update with one chunk x (elements idx)."""
    fin = (x > float("-inf")) & (x < float("inf"))
    up = fin & (x > lm)
    # -|x - lane max| (x finite); a -inf lane max stands in as -1e30 (exp2 of it is 0).
    d = tl.where(fin, -tl.abs(x - tl.maximum(lm, -1.0e30)), float("-inf"))
    e_raw = tl.exp2(d * LOG2E)
    e_t = tl.exp2(d * inv_t)
    ls = tl.where(up, ls * e_raw + 1.0, ls + e_raw)
    lt = tl.where(up, lt * e_t + 1.0, lt + e_t)
    la = tl.where(up, idx, la)
    lm = tl.where(up, x, lm)
    lmn = tl.minimum(lmn, tl.where(fin, x, float("inf")))
    return lm, ls, lt, la, lmn, lf + fin.to(tl.int32)


@triton.jit
def _row_stats(row, V, inv_t, BLOCK: tl.constexpr):
    """Pass A over one row: (lane maxima [BLOCK], max m, sum exp(x - m), tempered sum
    exp((x - m) / T), first argmax, min finite, count finite)."""
    lane = tl.arange(0, BLOCK)
    # Lane-wise max and first argmax, sums of exp (raw, and tempered for the masses) rescaled
    # online with one exp2 each, finite count and min.
    lm = tl.full([BLOCK], float("-inf"), tl.float32)
    ls = tl.zeros([BLOCK], tl.float32)
    lt = tl.zeros([BLOCK], tl.float32)
    la = tl.zeros([BLOCK], tl.int32)
    lmn = tl.full([BLOCK], float("inf"), tl.float32)
    lf = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, 2 * BLOCK):  # two chunks per step: twice the loads in flight
        idx = start + lane
        x0 = tl.load(row + idx, mask=idx < V, other=float("-inf"))
        x1 = tl.load(row + idx + BLOCK, mask=idx + BLOCK < V, other=float("-inf"))
        lm, ls, lt, la, lmn, lf = _lane_stats(x0, idx, lm, ls, lt, la, lmn, lf, inv_t)
        lm, ls, lt, la, lmn, lf = _lane_stats(x1, idx + BLOCK, lm, ls, lt, la, lmn, lf, inv_t)
    m = tl.max(lm, 0)
    live = lm > float("-inf")
    s = tl.sum(tl.where(live, ls * tl.exp2((lm - m) * LOG2E), 0.0), 0)
    s_t = tl.sum(tl.where(live, lt * tl.exp2((lm - m) * inv_t), 0.0), 0)
    tok = tl.min(tl.where(lm == m, la, 2147483647), 0)
    return lm, m, s, s_t, tok, tl.min(lmn, 0), tl.sum(lf, 0)


@triton.jit
def _filter_threshold(row, V, buf, lm, m, s_t, mn, nfin, k, top_p, inv_t, BLOCK: tl.constexpr,
                      NB: tl.constexpr, PER_LANE: tl.constexpr, MAX_PASSES: tl.constexpr):
    """thr = max(t_k, t_p) of a tempered row from its pass-A statistics (mn when neither
    filter is on); `buf` is the row's scratch (3 regions of BLOCK x PER_LANE)."""
    lane = tl.arange(0, BLOCK)
    topk_on = (k > 0) & (k < nfin)
    topp_on = top_p < 1.0
    thr = mn
    if topk_on | topp_on:
        # Lower bounds from the sorted lane maxima: at least K elements are >= the K-th
        # largest lane max; the mass >= the j-th is at least that of the top j lane maxima.
        srt = tl.sort(lm, descending=True)
        bound_k = tl.sum(tl.where(lane == k - 1, srt, 0.0), 0)
        cw = tl.cumsum(tl.where(srt > float("-inf"), tl.exp2((srt - m) * inv_t), 0.0), 0)
        jp = tl.min(tl.where(cw >= top_p * s_t, lane, BLOCK), 0)
        bound_p = tl.sum(tl.where(lane == jp, srt, 0.0), 0)
        bound = tl.where(topk_on, tl.where(k <= BLOCK, bound_k, float("-inf")),
                         tl.where(jp < BLOCK, bound_p, float("-inf")))
        bound = tl.where(bound > float("-inf"), bound, mn)
        # Copy every element >= bound into buffer region 0 (usually a few per lane).
        cnt0 = tl.zeros([BLOCK], tl.int32)
        from_row0 = tl.full([], 1, tl.int32)
        if bound > mn:
            _, _, _, _, cnt0 = _lane_pass(
                row, V, buf, cnt0, from_row0, buf, bound, float("inf"), tl.zeros([1], tl.float32),
                m, inv_t, False, False, BLOCK, 1, PER_LANE)
            if tl.max(cnt0, 0) <= PER_LANE:
                from_row0 = from_row0 * 0
        if topk_on:
            thr = _search(row, V, buf, cnt0, from_row0, bound, m, k.to(tl.float32), 1.0, m,
                          inv_t, False, BLOCK, NB, PER_LANE, MAX_PASSES)
        if topp_on:
            # After top-k the target is relative to the top-k mass (learned in the first
            # pass); alone it is top_p times the whole mass.
            lo_p = tl.where(topk_on, thr, bound)
            target = tl.where(topk_on, -1.0, top_p * s_t)
            thr = _search(row, V, buf, cnt0, from_row0, lo_p, m, target, top_p, m, inv_t,
                          True, BLOCK, NB, PER_LANE, MAX_PASSES)
    return thr


@triton.jit
def _sample_kernel(
    Logits, stride_l, V, Temp, TopK, TopP, MinP, Seeds, Steps, OutTok, OutLogp, OutThr, Scratch,
    stride_s, BLOCK: tl.constexpr, NB: tl.constexpr, PER_LANE: tl.constexpr, WALK: tl.constexpr,
    MAX_PASSES: tl.constexpr, STORE_THR: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = Logits + r * stride_l
    temp = tl.load(Temp + r)
    inv_t = LOG2E / tl.where(temp > 0, temp, 1.0)  # greedy rows: any finite value
    lm, m, s, s_t, tok, mn, nfin = _row_stats(row, V, inv_t, BLOCK)
    thr = m  # greedy: only the max
    if temp > 0:
        min_p = tl.load(MinP + r)
        thr = _filter_threshold(row, V, Scratch + r * stride_s, lm, m, s_t, mn, nfin, tl.load(TopK + r),
                                tl.load(TopP + r), inv_t, BLOCK, NB, PER_LANE, MAX_PASSES)
        seed = tl.load(Seeds + r)
        step = tl.load(Steps + r)
        zero = tl.zeros([], tl.uint32)
        r0, _, _, _ = tl.philox(seed, (step & 0xFFFFFFFF).to(tl.uint32),
                                ((step >> 32) & 0xFFFFFFFF).to(tl.uint32), zero, zero)
        u = tl.uint_to_uniform_float(r0)
        tok = _draw(row, V, thr, m, inv_t, min_p, u, row, False, 1.0, -1, False, False, BLOCK, WALK)
    x_tok = tl.load(row + tok)
    tl.store(OutTok + r, tok.to(tl.int64))
    tl.store(OutLogp + r, x_tok - m - tl.log(s))
    if STORE_THR:  # tests: the kept set is {x >= thr and exp((x - max) / T) >= min_p}
        tl.store(OutThr + r, thr)


def default_config(device: torch.device) -> dict[str, int]:
    """BLOCK lanes, NB pivots per search pass, PER_LANE copy slots per lane."""
    if device.type != "cuda":
        return {"BLOCK": 32, "NB": 8, "PER_LANE": 8, "num_warps": 4}
    # Measured on an H100 (benchmarks/RESULTS.md): 512 lanes x 4 warps beat 1024 x 8 warps.
    return {"BLOCK": 512, "NB": 16, "PER_LANE": 16, "num_warps": 4}


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
    config: dict[str, int] | None = None, thresholds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [B, V] (last dim packed); per-row params [B]. -> (tokens int64, logprobs f32).
    `thresholds` (fp32 [B], optional) receives each row's logit threshold thr, for tests."""
    b, v = logits.shape
    cfg = {**default_config(logits.device), **(config or {})}
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    if b == 0:
        return tokens, logprobs
    block, per_lane = cfg["BLOCK"], cfg["PER_LANE"]
    # Three regions of lane slots per row: the first copy, then two for the search's ping-pong.
    scratch = torch.empty((b, 3 * block * per_lane), dtype=torch.float32, device=logits.device)
    walk = min(256, triton.next_power_of_2(triton.cdiv(v, block)))
    _sample_kernel[(b,)](
        logits, logits.stride(0), v, temperature, top_k, top_p, min_p, seeds, steps, tokens,
        logprobs, logprobs if thresholds is None else thresholds, scratch, scratch.stride(0),
        BLOCK=block, NB=cfg["NB"], PER_LANE=per_lane, WALK=walk, MAX_PASSES=40,
        STORE_THR=thresholds is not None, num_warps=cfg["num_warps"],
    )
    return tokens, logprobs


def filtered_probs_reference(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """fp32 [B, V] probabilities after temperature -> top-k -> top-p -> min-p (sort-based; the
    same semantics as minisgl.sampling.sampler). Greedy rows come out one-hot on the argmax."""
    logits = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(torch.int64)
    keep = rank < k[:, None]
    sorted_p = sorted_p * keep
    sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
    keep &= before < top_p[:, None]
    keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    keep[:, 0] = True
    filtered = torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)
    filtered = filtered / filtered.sum(dim=-1, keepdim=True)
    onehot = torch.zeros_like(filtered).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, filtered)


def sample_reference(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort-based sampling (the benchmark baseline): filtered probs, then an exponential race
    (argmax p / E, E ~ Exp(1)), which draws exactly from the filtered distribution."""
    probs = filtered_probs_reference(logits, temperature, top_k, top_p, min_p)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    tokens = (probs / noise).argmax(dim=-1)
    tokens = torch.where(temperature <= 0, logits.argmax(dim=-1), tokens)
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs
