"""The block-level steps of the Triton attention kernels (kernels/extend_attention.py, and the split
decode's combine in kernels/deterministic_attention.py): one BLOCK_N block of keys folded into a
running (acc, m, l) softmax state (log2 domain), deterministic mode's splits (a split from a fresh
state; the split decode's partials; splits folded in order) and a sink logit's join.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_block(q, acc, m_i, l_i, KCache, VCache, slot_base, kv_off_k, kv_off_v, start, kv_end,
                 q_pos, stride_kt, stride_vt, qk_scale, offs_d, mask_d,
                 MASKED: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                 kv_lo=0, window=0, WINDOWED: tl.constexpr = False):
    """(acc, m, l) after the keys start .. start + BLOCK_N - 1 (MASKED: only those below kv_end and
    at or before each row's q_pos, and with a window inside it; unmasked: all seen by every row)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if WINDOWED:  # (always MASKED) keys below the tile's first window start are never loaded
        mask_n = (offs_n < kv_end) & (offs_n >= kv_lo)
        slots = tl.load(slot_base + offs_n, mask=mask_n, other=0).to(tl.int64)
    elif MASKED:
        mask_n = offs_n < kv_end
        slots = tl.load(slot_base + offs_n, mask=mask_n, other=0).to(tl.int64)
    else:
        slots = tl.load(slot_base + offs_n).to(tl.int64)
    k_ptrs = KCache + kv_off_k + slots[None, :] * stride_kt + offs_d[:, None]  # [D, BLOCK_N]
    v_ptrs = VCache + kv_off_v + slots[:, None] * stride_vt + offs_d[None, :]  # [BLOCK_N, D]
    if MASKED:
        # Columns past the context read slot 0 (the dummy slot). Its K and V are stale pool
        # memory, possibly NaN, and a masked score's weight of 0 times NaN is NaN: load 0s.
        k = tl.load(k_ptrs, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
    # An FP8 cache: e4m3 values are exact in q's 16/32-bit dtype; their per-tensor scales are
    # folded into qk_scale (K) and v_scale (V, applied to the output in fp32).
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    qk = tl.dot(q, k, input_precision=DOT_PREC)
    if WINDOWED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window) & mask_n[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    elif MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    # log2 domain; the scale folds into one FMA with the max subtraction (qk_scale > 0).
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if WINDOWED:  # a row that has seen no key yet stays at m = -inf, acc = l = 0 (no NaN)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(qk * qk_scale - m_sub[:, None])
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def split_partial(q, q_pos, KCache, VCache, slot_base, kv_off_k, kv_off_v, s0, s_end, full_end, kv_end,
                   stride_kt, stride_vt, qk_scale, offs_d, mask_d, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                   kv_lo=0, window=0, WINDOWED: tl.constexpr = False):
    """(acc, m, l) of keys s0 .. s_end-1 from a fresh state: one split of deterministic mode.
    A split no key of which a row sees leaves that row at m = -inf (and NaN acc, l; with a window:
    acc = l = 0). WINDOWED: every block masked, from the block of kv_lo (the tile's first window
    start) on; a block none of whose keys a row sees leaves that row's state exactly as it was."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if WINDOWED:
        for start in range(tl.maximum(s0, (kv_lo // BLOCK_N) * BLOCK_N), s_end, BLOCK_N):
            acc, m_i, l_i = attend_block(
                q, acc, m_i, l_i, KCache, VCache, slot_base, kv_off_k, kv_off_v, start, kv_end, q_pos,
                stride_kt, stride_vt, qk_scale, offs_d, mask_d, True, EVEN_D, BLOCK_N, DOT_PREC, kv_lo, window, True)
        return acc, m_i, l_i
    return attend_blocks(q, acc, m_i, l_i, KCache, VCache, slot_base, kv_off_k, kv_off_v, s0,
                         tl.minimum(tl.maximum(full_end, s0), s_end), s_end, kv_end, q_pos, stride_kt, stride_vt,
                         qk_scale, offs_d, mask_d, EVEN_D, BLOCK_N, DOT_PREC)


@triton.jit
def attend_blocks(q, acc, m_i, l_i, KCache, VCache, slot_base, kv_off_k, kv_off_v, lo, mid, hi, kv_end, q_pos,
                  stride_kt, stride_vt, qk_scale, offs_d, mask_d, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    """(acc, m, l) after the blocks lo .. hi - 1 (BLOCK_N apart): below mid unmasked (every row sees
    all their keys), then masked."""
    for start in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = attend_block(
            q, acc, m_i, l_i, KCache, VCache, slot_base, kv_off_k, kv_off_v, start, kv_end, q_pos,
            stride_kt, stride_vt, qk_scale, offs_d, mask_d, False, EVEN_D, BLOCK_N, DOT_PREC)
    for start in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = attend_block(
            q, acc, m_i, l_i, KCache, VCache, slot_base, kv_off_k, kv_off_v, start, kv_end, q_pos,
            stride_kt, stride_vt, qk_scale, offs_d, mask_d, True, EVEN_D, BLOCK_N, DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def split_partials(q, q_pos, KCache, VCache, slot_base, kv_off_k, kv_off_v, kv_end, stride_kt, stride_vt,
                   qk_scale, offs_d, mask_d, offs_m, mask_m, part_rows, PartAcc, PartML, EVEN_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    """Deterministic mode's split decode without a window: the partial (acc, m, l) of each split this
    program owns (splits pid2, pid2 + P, ... of P programs on grid axis 2) to row `part_rows` + split of
    PartAcc [.., BLOCK_D] and PartML [.., 2]. One flat loop over the owned splits' blocks, so their
    loads run ahead across split ends (a split is SPLIT // BLOCK_N blocks, two for the GPU's decode
    tile: a loop per split is too short for that): a split's first block starts from a fresh state,
    its last writes the partial. Every block takes the masked path (on a fully
    visible block the masks mask nothing out: the same bits as the unmasked path; the GPU tests compare
    decode steps with prefill, which takes it)."""
    CHUNKS: tl.constexpr = SPLIT // BLOCK_N
    p = tl.program_id(2)
    n_splits = tl.cdiv(kv_end, SPLIT)
    n_own = tl.cdiv(tl.maximum(n_splits - p, 0), tl.num_programs(2))
    # Only the last split may hold fewer blocks; it is this program's last if it is this program's.
    short = CHUNKS - tl.cdiv(kv_end - (n_splits - 1) * SPLIT, BLOCK_N)
    owns_last = (n_own > 0) & ((n_splits - 1) % tl.num_programs(2) == p)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for i in range(0, n_own * CHUNKS - tl.where(owns_last, short, 0)):
        s0 = (p + (i // CHUNKS) * tl.num_programs(2)) * SPLIT
        start = s0 + (i % CHUNKS) * BLOCK_N
        fresh = start == s0
        m_i = tl.where(fresh, float("-inf"), m_i)
        l_i = tl.where(fresh, 0.0, l_i)
        acc = tl.where(fresh, 0.0, acc)
        acc, m_i, l_i = attend_block(
            q, acc, m_i, l_i, KCache, VCache, slot_base, kv_off_k, kv_off_v, start, kv_end, q_pos,
            stride_kt, stride_vt, qk_scale, offs_d, mask_d, True, EVEN_D, BLOCK_N, DOT_PREC)
        # (the row mask as a comparison per row: the interpreter turns bool & a broadcast bool into int32)
        keep = mask_m & (start + BLOCK_N + 0 * offs_m >= tl.minimum(s0 + SPLIT, kv_end))
        rows = part_rows + s0 // SPLIT
        tl.store(PartAcc + rows[:, None] * BLOCK_D + offs_d[None, :], acc, mask=keep[:, None])
        tl.store(PartML + 2 * rows, m_i, mask=keep)
        tl.store(PartML + 2 * rows + 1, l_i, mask=keep)


@triton.jit
def with_sink(acc, m_i, l_i, sink):
    """The final state with a head's sink logit joining the denominator only (log2 domain,
    unscaled logit): (acc, l). Shared by the kernel and the split decode's combine."""
    sink = sink.to(tl.float32) * 1.4426950408889634
    m_fin = tl.maximum(m_i, sink)
    corr = tl.exp2(m_i - m_fin)
    return acc * corr[:, None], tl.fma(l_i, corr, tl.exp2(sink - m_fin))  # explicit: one rounding in both


@triton.jit
def fold_split(acc, m_i, l_i, acc_p, m_p, l_p):
    """The running state folded with the next split's partial (splits in order). Explicit FMAs:
    the same bits here and in the decode split-combine kernel (no contraction choices left to
    the compiler). A partial at m = -inf (an unseen split) leaves the state as it is."""
    m_new = tl.maximum(m_i, m_p)
    a = tl.exp2(m_i - m_new)
    b = tl.exp2(m_p - m_new)
    seen = m_p > float("-inf")
    l_new = tl.where(seen, tl.fma(l_i, a, l_p * b), l_i)
    acc_new = tl.where(seen[:, None], tl.fma(acc, a[:, None], acc_p * b[:, None]), acc)
    return acc_new, m_new, l_new
