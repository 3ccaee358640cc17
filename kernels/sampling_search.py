"""Device helpers of the sampling kernel (kernels/sampling.py): bracket passes, threshold
search, and the draw. Everything here runs inside one program per row.

Lanes: a pass walks the row in chunks of BLOCK; element i sits in lane i % BLOCK. Inner loops
only do lane-wise (elementwise) work into [BLOCK] or [BLOCK, NB] accumulators, and reduce
across lanes once per pass, so warps never wait on each other inside a loop and keep several
loads in flight. Candidates are copied into lane slots: lane j's t-th copied element goes to
buffer[j * PER_LANE + t], which needs no scan and keeps a fixed (lane-major) order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _lane_pass(Row, V, Src, cnt_src, from_row, Dst, lo, hi, piv, m, inv_t,
               MASS: tl.constexpr, STATS: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
               PER_LANE: tl.constexpr):
    """Over the source's elements x in [lo, hi): copies them to Dst's lane slots and (STATS)
    per pivot the weight (count, or mass exp2((x - m) * inv_t)) of those >= the pivot, the
    total weight, max and min. Returns (g [NB], wtot, mx, mn, cnt_dst [BLOCK])."""
    tl.debug_barrier()  # the previous pass's copies (other threads') must be visible
    lane = tl.arange(0, BLOCK)
    n_iter = tl.where(from_row != 0, tl.cdiv(V, BLOCK), tl.max(cnt_src, 0))
    n_row = tl.where(from_row != 0, V, 0)
    cnt_buf = tl.where(from_row != 0, 0, cnt_src)
    cnt = tl.zeros([BLOCK], tl.int32)
    g = tl.zeros([NB, BLOCK], tl.float32)
    wsum = tl.zeros([BLOCK], tl.float32)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    mn = tl.full([BLOCK], float("inf"), tl.float32)
    for it in range(0, n_iter):
        idx = it * BLOCK + lane
        x_row = tl.load(Row + idx, mask=idx < n_row, other=float("-inf"))
        x_buf = tl.load(Src + lane * PER_LANE + it, mask=it < cnt_buf, other=float("-inf"))
        x = tl.maximum(x_row, x_buf)  # one of the two loads is fully masked off
        inb = (x >= lo) & (x < hi)
        tl.store(Dst + lane * PER_LANE + cnt, x, mask=inb & (cnt < PER_LANE))
        cnt += inb.to(tl.int32)
        if STATS:
            if MASS:
                w = tl.where(inb, tl.exp2((x - m) * inv_t), 0.0)
            else:
                w = inb.to(tl.float32)
            g += tl.where(x[None, :] >= piv[:, None], w[None, :], 0.0)
            wsum += w
            mx = tl.maximum(mx, tl.where(inb, x, float("-inf")))
            mn = tl.minimum(mn, tl.where(inb, x, float("inf")))
    return tl.sum(g, 1), tl.sum(wsum, 0), tl.max(mx, 0), tl.min(mn, 0), cnt


@triton.jit
def _search(Row, V, Buf, cnt0, from_row0, lo0, top0, target0, frac, m, inv_t,
            MASS: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, PER_LANE: tl.constexpr,
            MAX_PASSES: tl.constexpr):
    """Largest element a >= lo0 with F(a) >= target, F(a) = count (or mass) of elements >= a.
    target0 < 0: target = frac * F(lo0), learned in the first pass. The source is the row, or
    (from_row0 == 0) buffer region 0 with lane counts cnt0, holding every element >= lo0.
    Invariants: F(lo) >= target > F(hi); the bracket's elements lie in [lo, top]."""
    region = BLOCK * PER_LANE
    jj = tl.arange(0, NB)
    f = (jj + 1).to(tl.float32) / NB
    lo = lo0
    top = top0
    hi = tl.full([], float("inf"), tl.float32)
    f_hi = tl.zeros([], tl.float32)
    target = target0 + tl.zeros([], tl.float32)
    answer = lo0
    from_row = from_row0 + tl.zeros([], tl.int32)
    cnt = cnt0
    src = tl.zeros([], tl.int32)  # region 0 is the caller's; the search ping-pongs on 1 and 2
    passes = tl.zeros([], tl.int32)
    going = tl.full([], 1, tl.int32)
    while going != 0:
        dst = tl.where(src == 1, 2, 1)
        piv = lo * (1.0 - f) + top * f  # ascending, the last is top; no overflow
        g, wtot, mx, mn, cnt_dst = _lane_pass(
            Row, V, Buf + src * region, cnt, from_row, Buf + dst * region, lo, hi, piv, m, inv_t,
            MASS, True, BLOCK, NB, PER_LANE)
        if target < 0:
            target = frac * (f_hi + wtot)
        passes += 1
        if (mx == mn) | (mx < mn) | (passes >= MAX_PASSES):
            # One distinct value left (the answer); empty (rounding) or the safety stop: lo.
            answer = tl.where(mx == mn, mx, lo)
            going = going * 0
        else:
            ok = (f_hi + g) >= target
            jl = tl.max(tl.where(ok, jj, -1), 0)
            new_lo = tl.where(jl >= 0, tl.sum(tl.where(jj == jl, piv, 0.0), 0), lo)
            has_next = jl + 1 < NB
            new_hi = tl.where(has_next, tl.sum(tl.where(jj == jl + 1, piv, 0.0), 0), hi)
            f_hi = tl.where(has_next, f_hi + tl.sum(tl.where(jj == jl + 1, g, 0.0), 0), f_hi)
            hi = new_hi
            lo = tl.maximum(new_lo, mn)  # nothing lies in [lo, mn): F(mn) = F(lo)
            top = tl.minimum(mx, hi)
            if tl.max(cnt_dst, 0) <= PER_LANE:  # all of the bracket was copied: read only it
                from_row = from_row * 0
                cnt = cnt_dst
                src = dst
    return answer


@triton.jit
def _draw_weight(x, idx, V, thr, m, inv_t, min_p, Q, q_on, inv_S, excl, HAS_Q: tl.constexpr,
                 EXCL: tl.constexpr):
    """Unnormalized draw weight of elements x (indices idx): the kept weight w = p / p_max on
    {x >= thr, w >= min_p}; with HAS_Q (and q_on), the residual max(0, w * inv_S - q[idx]) of
    rejection sampling (inv_S = 1 / kept mass, so w * inv_S = p); with EXCL, index `excl`
    weighs 0 (the residual of a one-hot q)."""
    w = tl.exp2((x - m) * inv_t)
    w = tl.where((x >= thr) & (w >= min_p), w, 0.0)
    if HAS_Q:
        q = tl.load(Q + idx, mask=(idx < V) & (idx >= 0), other=0.0)
        w = tl.maximum(w * inv_S - tl.where(q_on, q, 0.0), 0.0)
    if EXCL:
        w = tl.where(idx == excl, 0.0, w)
    return w


@triton.jit
def _draw(Row, V, thr, m, inv_t, min_p, u, Q, q_on, inv_S, excl, HAS_Q: tl.constexpr,
          EXCL: tl.constexpr, BLOCK: tl.constexpr, WALK: tl.constexpr):
    """Inverse CDF in lane-major order over the weights of `_draw_weight` (plain sampling:
    the kept set {x >= thr, w >= min_p}, w = p / p_max): lane sums in one pass, a scan over
    lanes, then a walk down the chosen lane. Returns -1 when every weight is 0."""
    lane = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, 2 * BLOCK):  # two chunks per step: twice the loads in flight
        idx = start + lane
        x0 = tl.load(Row + idx, mask=idx < V, other=float("-inf"))
        x1 = tl.load(Row + idx + BLOCK, mask=idx + BLOCK < V, other=float("-inf"))
        acc += _draw_weight(x0, idx, V, thr, m, inv_t, min_p, Q, q_on, inv_S, excl, HAS_Q, EXCL)
        acc += _draw_weight(x1, idx + BLOCK, V, thr, m, inv_t, min_p, Q, q_on, inv_S, excl, HAS_Q, EXCL)
    cum = tl.cumsum(acc, 0)
    r = u * tl.sum(acc, 0)
    j = tl.min(tl.where(cum > r, lane, BLOCK), 0)
    j = tl.where(j < BLOCK, j, tl.max(tl.where(acc > 0, lane, -1), 0))  # rounding guard
    j = tl.maximum(j, 0)  # all weights 0: walk lane 0, find nothing, return -1
    r = r - tl.sum(tl.where(lane == j, cum - acc, 0.0), 0)
    # Walk lane j: elements j, j + BLOCK, ... in order (WALK of them per step).
    steps = tl.arange(0, WALK)
    run = tl.zeros([], tl.float32)
    tok = tl.full([], -1, tl.int32)
    last = tl.full([], -1, tl.int32)
    for c0 in range(0, tl.cdiv(V, BLOCK), WALK):
        idx = j + (c0 + steps) * BLOCK
        x = tl.load(Row + idx, mask=idx < V, other=float("-inf"))
        w = _draw_weight(x, idx, V, thr, m, inv_t, min_p, Q, q_on, inv_S, excl, HAS_Q, EXCL)
        c = run + tl.cumsum(w, 0)
        first = tl.min(tl.where(c > r, idx, 2147483647), 0)
        tok = tl.where((tok < 0) & (first < 2147483647), first, tok)
        last = tl.maximum(last, tl.max(tl.where(w > 0, idx, -1), 0))
        run += tl.sum(w, 0)
    return tl.where(tok >= 0, tok, last)
