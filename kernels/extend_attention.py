"""Extend (prefill) attention over the paged KV cache (Triton flash attention + fp32 reference).

A ragged batch of B requests: request b brings `ext_b = cu_seqlens_q[b+1] - cu_seqlens_q[b]`
new tokens at positions prefix_lens[b] .. prefix_lens[b] + ext_b - 1, whose K/V are already
stored in the cache. Token i attends causally to positions 0 .. prefix_lens[b] + i, read
through the request table: slot = req_to_slot[req_rows[b], position] (any page size).

Grid: (q_heads, q blocks, B) with heads fastest, so the heads of one KV group run side by side
(their K/V tiles are shared in L2) and, with q blocks taken last-first, the longest causal
rows start first. Each program: one BLOCK_M tile of queries of one head; an unmasked loop
over keys every query of the tile sees, then a short masked loop over the diagonal.

GQA packing (HEADS > 1; deterministic mode): a tile's BLOCK_M rows are TOKENS = BLOCK_M // HEADS
tokens times HEADS query heads of one KV group (row r: token r // HEADS, head r % HEADS), so the
group's keys are read once per tile and a decode (one token) fills HEADS rows, not one. Grid
axis 0 then runs over head groups (Hq / HEADS) and tiles count TOKENS tokens. Each row's
arithmetic is the same compiled code whatever the row holds.

Sliding windows and sinks (`window` > 0, `sinks`; in deterministic mode too): a query at p sees
keys p - W + 1 .. p only. A tile's key loop then starts at the block holding its first query's
first key (blocks wholly before every query's window are not read), every block is masked on
both sides, and no K/V outside the tile's key range is loaded (those slots may be freed). A
row with nothing visible yet keeps m = -inf without NaNs (the subtraction uses 0 for -inf).
A sink logit s per head joins the final normaliser: l += 2^(s log2 e - m).

The per-block steps (a block of keys into the running softmax state, deterministic mode's
splits and their partials, the sink) are in kernels/attention_blocks.py.

Tile-map mode (CUDA graphs): the grid is (q_heads, capacity), a bound that depends only on
the token bucket (`tile_capacity`), and program (h, t) reads its (request, first query) from
`tiles[t]` (int32 [capacity, 2], built on the host by `tile_map`, longest work first); rows
(-1, 0) are unused and exit at once. Nothing of the launch then depends on the batch's lengths.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minisgl.kernels.attention_blocks import (
    attend_block,
    attend_blocks,
    fold_split,
    split_partial,
    split_partials,
    with_sink,
)


@triton.jit
def _extend_attn_kernel(
    Q, KCache, VCache, Out, ReqToSlot, ReqRows, PrefixLens, CuSeqlensQ, Tiles, qk_scale, v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_rt, PartAcc, PartML, num_splits, window, Sinks,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, TILED: tl.constexpr,
    HEADS: tl.constexpr, SPLIT: tl.constexpr, PARTIAL: tl.constexpr, WINDOWED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    TOKENS: tl.constexpr = BLOCK_M // HEADS
    head0 = tl.program_id(0) * HEADS
    if TILED:
        b = tl.load(Tiles + 2 * tl.program_id(1))
        m_start = tl.load(Tiles + 2 * tl.program_id(1) + 1)
    else:
        b = tl.program_id(2)
        m_start = (tl.num_programs(1) - 1 - tl.program_id(1)) * TOKENS
    if b < 0:  # an unused tile
        return
    q_start = tl.load(CuSeqlensQ + b)
    ext = tl.load(CuSeqlensQ + b + 1) - q_start
    if m_start >= ext:
        return
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    row = tl.load(ReqRows + b).to(tl.int64)
    prefix = tl.load(PrefixLens + b)
    kvh = head0 // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    if HEADS == 1:  # (a compile-time branch: the unpacked kernel is unchanged)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < ext
        tok = (q_start + offs_m).to(tl.int64)
        q_ptrs = Q + tok[:, None] * stride_qt + head0 * stride_qh + offs_d[None, :]
        o_ptrs = Out + tok[:, None] * stride_ot + head0 * stride_oh + offs_d[None, :]
        heads = tl.full([BLOCK_M], 0, tl.int64) + head0  # (used by PARTIAL only)
    else:
        rows = tl.arange(0, BLOCK_M)
        offs_m = m_start + rows // HEADS
        mask_m = (offs_m < ext) & (rows < TOKENS * HEADS)
        heads = (head0 + rows % HEADS).to(tl.int64)
        tok = (q_start + offs_m).to(tl.int64)
        q_ptrs = Q + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        o_ptrs = Out + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    slot_base = ReqToSlot + row * stride_rt
    kv_off_k = kvh.to(tl.int64) * stride_kh
    kv_off_v = kvh.to(tl.int64) * stride_vh
    # Keys below prefix + m_start are visible to every query of the tile: no masks there.
    full_end = ((prefix + m_start) // BLOCK_N) * BLOCK_N
    kv_end = prefix + tl.minimum(m_start + TOKENS, ext)
    kv_lo = 0  # the tile's first query's window start (WINDOWED)
    if WINDOWED:
        kv_lo = tl.maximum(prefix + m_start - window + 1, 0)
    if WINDOWED and SPLIT == 0:  # every block masked; from the tile's first query's window on
        for start in range((kv_lo // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
            acc, m_i, l_i = attend_block(
                q, acc, m_i, l_i, KCache, VCache, slot_base, kv_off_k, kv_off_v, start, kv_end, q_pos,
                stride_kt, stride_vt, qk_scale, offs_d, mask_d, True, EVEN_D, BLOCK_N, DOT_PREC,
                kv_lo, window, True)
    elif SPLIT == 0:
        acc, m_i, l_i = attend_blocks(q, acc, m_i, l_i, KCache, VCache, slot_base, kv_off_k, kv_off_v, 0, full_end,
                                      kv_end, kv_end, q_pos, stride_kt, stride_vt, qk_scale, offs_d, mask_d, EVEN_D,
                                      BLOCK_N, DOT_PREC)
    elif PARTIAL:  # splits pid2, pid2 + P, ... (P programs on grid axis 2): partials to [T, Hq, S, ...]
        part_rows = (tok * (tl.num_programs(0) * HEADS) + heads) * num_splits
        if not WINDOWED:  # one flat loop over the splits' blocks
            split_partials(q, q_pos, KCache, VCache, slot_base, kv_off_k, kv_off_v, kv_end, stride_kt, stride_vt,
                           qk_scale, offs_d, mask_d, offs_m, mask_m, part_rows, PartAcc, PartML, EVEN_D, BLOCK_M,
                           BLOCK_N, BLOCK_D, SPLIT, DOT_PREC)
        else:  # a loop per split (a window holds one or two), from the split of the window's start (the
            # combine folds from there too)
            for s0 in range((kv_lo // SPLIT) * SPLIT + tl.program_id(2) * SPLIT, kv_end, tl.num_programs(2) * SPLIT):
                acc, m_i, l_i = split_partial(q, q_pos, KCache, VCache, slot_base, kv_off_k, kv_off_v, s0,
                                              tl.minimum(s0 + SPLIT, kv_end), full_end, kv_end, stride_kt, stride_vt,
                                              qk_scale, offs_d, mask_d, EVEN_D, BLOCK_M, BLOCK_D, BLOCK_N, DOT_PREC,
                                              kv_lo, window, WINDOWED)
                split_rows = part_rows + s0 // SPLIT  # (not `rows`: the GQA tile's row index above)
                tl.store(PartAcc + split_rows[:, None] * BLOCK_D + offs_d[None, :], acc, mask=mask_m[:, None])
                tl.store(PartML + 2 * split_rows, m_i, mask=mask_m)
                tl.store(PartML + 2 * split_rows + 1, l_i, mask=mask_m)
        return
    else:  # deterministic mode: splits of SPLIT keys at fixed positions, folded in order
        # With a window, from the split of the tile's first window start: the splits before it
        # hold no key any row sees, and folding such a split changes no bit (the split decode's
        # combine folds them all, from split 0, to the same bits).
        s_first = (kv_lo // SPLIT) * SPLIT
        acc, m_i, l_i = split_partial(q, q_pos, KCache, VCache, slot_base, kv_off_k, kv_off_v, s_first,
                                      tl.minimum(s_first + SPLIT, kv_end), full_end, kv_end, stride_kt, stride_vt,
                                      qk_scale, offs_d, mask_d, EVEN_D, BLOCK_M, BLOCK_D, BLOCK_N, DOT_PREC,
                                      kv_lo, window, WINDOWED)
        for s0 in range(s_first + SPLIT, kv_end, SPLIT):
            acc_p, m_p, l_p = split_partial(q, q_pos, KCache, VCache, slot_base, kv_off_k, kv_off_v, s0,
                                            tl.minimum(s0 + SPLIT, kv_end), full_end, kv_end, stride_kt,
                                            stride_vt, qk_scale, offs_d, mask_d, EVEN_D, BLOCK_M, BLOCK_D,
                                            BLOCK_N, DOT_PREC, kv_lo, window, WINDOWED)
            acc, m_i, l_i = fold_split(acc, m_i, l_i, acc_p, m_p, l_p)
    if HAS_SINKS:
        acc, l_i = with_sink(acc, m_i, l_i, tl.load(Sinks + heads))
    out = acc * (v_scale / l_i)[:, None]  # v_scale: an FP8 cache's V scale (1.0 for 16-bit caches)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products: tl.dot's default would round them to TF32 (about
    1e-3 relative), far from what a float32 cache promises. 16-bit inputs are exact either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


def default_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Interpreter: small tiles keep CI fast."""
    if device.type != "cuda":
        return (32, 32, 4, 1)
    if dtype == torch.float32:  # ieee dots run on FMA units: smaller tiles, fewer registers
        return (64, 32, 4, 2)
    # Chosen on an H100 (benchmarks/RESULTS.md) among configs that the compiler's resource
    # report (sm_90) shows without register spills; a padded head dim spills at 128 x 128.
    if head_dim <= 128:
        return (128, 128, 8, 3) if head_dim in (64, 128) else (128, 64, 8, 3)
    return (64, 64, 8, 2)


def tile_capacity(num_tokens: int, num_requests: int, block_m: int) -> int:
    """Rows `tile_map` may fill for at most `num_tokens` new tokens in at most `num_requests`
    requests: sum(ceil(ext_b / M)) <= T / M + B, and no more than one tile per token."""
    return min(num_tokens, triton.cdiv(num_tokens, block_m) + num_requests)


def tile_map(prefix_lens: list[int], extend_lens: list[int], block_m: int, capacity: int | None = None) -> list[int]:
    """Flat int32 pairs (request index, first query row) of every BLOCK_M query tile, the
    tiles that see the most keys first (they take longest; the grid's tail then stays short),
    padded with (-1, 0) to `capacity` tiles."""
    tiles = [(p + m + min(block_m, n - m), b, m) for b, (p, n) in enumerate(zip(prefix_lens, extend_lens))
             for m in range(0, n, block_m)]
    tiles.sort(key=lambda x: -x[0])
    if capacity is not None and len(tiles) > capacity:
        raise ValueError(f"{len(tiles)} attention tiles exceed the capacity of {capacity}")
    flat = [v for _, b, m in tiles for v in (b, m)]
    return flat + [-1, 0] * ((capacity or len(tiles)) - len(tiles))


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_slot: torch.Tensor,
    req_rows: torch.Tensor, prefix_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
    max_extend_len: int, scale: float, out: torch.Tensor | None = None,
    config: tuple[int, ...] | None = None, tiles: torch.Tensor | None = None, heads_per_tile: int = 1,
    split: int = 0, k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shapes as in the module docstring; returns out [T, Hq, D] in q's dtype. `window` > 0: a
    sliding window of that many keys; `sinks` fp32 [Hq]: a logit per head in every denominator
    (with `split` too: the splits stay at fixed positions, the window masks inside them). With `tiles`
    (int32 [capacity, 2] from `tile_map` with this config's BLOCK_M), the grid is
    (Hq, capacity) and `max_extend_len` is not used: the launch is fixed for a CUDA graph.
    Query rows that no tile covers (padding tokens) are left unwritten. `heads_per_tile` > 1:
    GQA packing (module docstring); it must divide Hq / Hkv, and `tiles` then come from
    `tile_map` with BLOCK_M // heads_per_tile tokens per tile. `split` > 0 (a multiple of
    BLOCK_N; deterministic mode): keys in splits of `split` at fixed positions, each from a
    fresh state, folded in order (kernels/deterministic_attention.py runs them in parallel).
    An FP8 cache holds K / k_scale and V / v_scale (per-tensor scales)."""
    t, hq, d = q.shape
    if out is None:
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    b = req_rows.shape[0]
    if t == 0 or b == 0 or (tiles is None and max_extend_len <= 0) or (tiles is not None and tiles.shape[0] == 0):
        return out
    block_m, block_n, num_warps, num_stages = config or default_config(d, q.dtype, q.device)
    group = hq // k_cache.shape[1]
    if group % heads_per_tile or heads_per_tile > block_m:
        raise ValueError(f"heads_per_tile {heads_per_tile} must divide the GQA group ({group}) and fit BLOCK_M")
    if split % block_n:
        raise ValueError(f"split {split} must be a multiple of BLOCK_N ({block_n})")
    if tiles is None:
        grid = (hq // heads_per_tile, triton.cdiv(max_extend_len, block_m // heads_per_tile), b)
    else:
        grid = (hq // heads_per_tile, tiles.shape[0], 1)
    launch(grid, q, k_cache, v_cache, out, req_to_slot, req_rows, prefix_lens, cu_seqlens_q, tiles, scale,
           (block_m, block_n, num_warps, num_stages), heads_per_tile, split, None, k_scale, v_scale, window, sinks)
    return out


def launch(grid: tuple[int, int, int], q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           out: torch.Tensor, req_to_slot: torch.Tensor, req_rows: torch.Tensor, prefix_lens: torch.Tensor,
           cu_seqlens_q: torch.Tensor, tiles: torch.Tensor | None, scale: float, config: tuple[int, ...],
           heads: int, split: int, partial: tuple[torch.Tensor, torch.Tensor] | None, k_scale: float = 1.0,
           v_scale: float = 1.0, window: int = 0, sinks: torch.Tensor | None = None) -> None:
    """The kernel launch; `partial` (acc [T, Hq, S, BLOCK_D], (m, l) [T, Hq, S, 2], fp32): the
    programs of grid axis 2 share the splits and write each split's partial there."""
    block_m, block_n, num_warps, num_stages = config
    d = q.shape[2]
    part_acc, part_ml = partial if partial is not None else (out, out)
    _extend_attn_kernel[grid](
        q, k_cache, v_cache, out, req_to_slot, req_rows, prefix_lens, cu_seqlens_q,
        cu_seqlens_q if tiles is None else tiles, scale * k_scale * math.log2(math.e), v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), out.stride(0), out.stride(1), req_to_slot.stride(0), part_acc, part_ml,
        part_acc.shape[2] if partial is not None else 0, window, q if sinks is None else sinks,
        GROUP=q.shape[1] // k_cache.shape[1], HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PREC=dot_precision(q.dtype), TILED=tiles is not None,
        HEADS=heads, SPLIT=split, PARTIAL=partial is not None, WINDOWED=window > 0, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages,
    )


def extend_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_slot: torch.Tensor,
    req_rows: torch.Tensor, prefix_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float,
    compute_dtype: torch.dtype = torch.float32, window: int = 0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain math per request in `compute_dtype` (fp64 for the gold answer, q's dtype for the
    same-dtype torch baseline of FA3's error rule); returns [T, Hq, D] in compute_dtype. Reads
    only the keys some query sees (a sliding window's older slots may be freed)."""
    t, hq, d = q.shape
    group = hq // k_cache.shape[1]
    out = torch.empty((t, hq, d), dtype=compute_dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    for i, (row, prefix) in enumerate(zip(req_rows.tolist(), prefix_lens.tolist())):
        lo, hi = cu[i], cu[i + 1]
        if hi == lo:
            continue
        seq = prefix + hi - lo
        first = max(0, prefix - window + 1) if window > 0 else 0
        slots = req_to_slot[row, first:seq].long()
        k = k_cache[slots].to(compute_dtype).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache[slots].to(compute_dtype).repeat_interleave(group, dim=1)
        qq = q[lo:hi].to(compute_dtype).transpose(0, 1)  # [Hq, n, D]
        s = torch.matmul(qq, k.permute(1, 2, 0)) * scale  # [Hq, n, L]
        q_pos = torch.arange(prefix, seq, device=q.device)
        key_pos = torch.arange(first, seq, device=q.device)
        mask = key_pos[None, :] > q_pos[:, None]
        if window > 0:
            mask |= key_pos[None, :] <= q_pos[:, None] - window
        s = s.masked_fill(mask[None], float("-inf"))
        # Softmax in fp32 (fp64 for the gold answer), matmuls in compute_dtype: FA3's baseline.
        soft_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        s = s.to(soft_dtype)
        if sinks is not None:  # the sink's column joins the softmax, then is dropped
            s = torch.cat([s, sinks.to(soft_dtype)[:, None, None].expand(-1, s.shape[1], 1)], dim=-1)
            p = torch.softmax(s, dim=-1)[..., :-1].to(compute_dtype)
        else:
            p = torch.softmax(s, dim=-1).to(compute_dtype)
        out[lo:hi] = torch.matmul(p, v.transpose(0, 1)).transpose(0, 1)
    return out
