"""Token -> expert alignment for the fused MoE GEMMs (Triton + torch reference).

The N = T * top_k (token, expert) assignments are numbered a = t * top_k + j. The GEMMs take
them grouped by expert, each expert's group padded to a multiple of BLOCK_M rows, so every
BLOCK_M-row block belongs to one expert:

- sorted_ids [num_blocks * BLOCK_M] int32: assignment numbers, expert by expert, ascending
  within an expert (a stable sort); padding slots hold N (a row the GEMMs skip).
- expert_ids [num_blocks] int32: each block's expert; -1 for blocks past the last used one.

Sizes are static per (N, E, BLOCK_M): num_blocks = cdiv(N + min(E, N) * (BLOCK_M - 1), BLOCK_M)
bounds any routing, so nothing is read back to the host and CUDA graphs can capture it.

Kernels: small batches (the [N, E] one-hot within ONEHOT_ELEMS) align, or route and align, in
ONE program (a decode step pays one launch). Larger ones: count per chunk of assignments -> one
program turns the counts into offsets (and writes the padding and the block experts) -> scatter
per chunk. Within a chunk an
assignment's rank among its expert's is a cumulative sum over a one-hot [CHUNK, E] tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.moe_routing import topk_rows

ONEHOT_ELEMS = 16384  # [chunk, experts] one-hot tiles stay about this size (registers)


def num_blocks(n: int, num_experts: int, block_m: int) -> int:
    return triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m)


def chunk_size(num_experts: int) -> int:
    return max(16, min(1024, ONEHOT_ELEMS // triton.next_power_of_2(num_experts)))


@triton.jit
def _padded_ends(counts, BLOCK_M: tl.constexpr):
    """Inclusive end of each expert's padded group (experts with no rows take no space)."""
    return tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, axis=0)


@triton.jit
def _fill_padding_and_blocks(SortedIds, ExpertIds, ends, N, NUM_BLOCKS, BLOCK_M: tl.constexpr,
                             BLOCK_B: tl.constexpr):
    """Every slot := N (the scatter later overwrites the real ones); each block's expert is the
    number of experts whose group ends at or before the block's first slot (empty groups have
    zero length, so they are skipped correctly); blocks past the total get -1."""
    total = tl.max(ends, axis=0)
    for b0 in range(0, NUM_BLOCKS, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        start = b * BLOCK_M
        expert = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), axis=1)
        tl.store(ExpertIds + b, tl.where(start < total, expert, -1), mask=b < NUM_BLOCKS)
        slots = b[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tl.store(SortedIds + slots, tl.full((BLOCK_B, BLOCK_M), N, tl.int32), mask=(b < NUM_BLOCKS)[:, None])


@triton.jit
def _onehot(ids, BLOCK_E: tl.constexpr):
    return (ids[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)


@triton.jit
def _rank_in_chunk(onehot):
    """How many earlier assignments of the chunk went to the same expert."""
    return tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1


@triton.jit
def _route_align_small_kernel(
    Logits, Weights, Ids, SortedIds, ExpertIds, T, E, stride_l, NUM_BLOCKS,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(Logits + rows[:, None] * stride_l + cols[None, :],
                mask=(rows[:, None] < T) & (cols[None, :] < E), other=0.0).to(tl.float32)
    weights, ids = topk_rows(x, cols, E, TOP_K, BLOCK_K, SIGMOID, RENORMALIZE)
    slots = tl.arange(0, BLOCK_K)
    ok = (rows[:, None] < T) & (slots[None, :] < TOP_K)
    item = rows[:, None] * TOP_K + slots[None, :]
    tl.store(Weights + item, weights, mask=ok)
    tl.store(Ids + item, ids, mask=ok)
    # Flatten [BLOCK_T, BLOCK_K] -> assignments; unused slots get expert -1 (no one-hot bit).
    flat_ids = tl.reshape(tl.where(ok, ids, -1), (BLOCK_T * BLOCK_K,))
    flat_item = tl.reshape(item, (BLOCK_T * BLOCK_K,))
    _align_in_one_program(flat_ids, flat_item, SortedIds, ExpertIds, T * TOP_K, NUM_BLOCKS, BLOCK_E, BLOCK_M,
                          BLOCK_B)


@triton.jit
def _align_in_one_program(ids, items, SortedIds, ExpertIds, N, NUM_BLOCKS, BLOCK_E: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """All N assignments (`ids` their experts, -1 for unused lanes; `items` their numbers) in one
    program: counts, padding, block experts, then each assignment's slot."""
    onehot = _onehot(ids, BLOCK_E)
    ends = _padded_ends(tl.sum(onehot, axis=0), BLOCK_M)
    _fill_padding_and_blocks(SortedIds, ExpertIds, ends, N, NUM_BLOCKS, BLOCK_M, BLOCK_B)
    tl.debug_barrier()  # the padding stores above land before the real slots overwrite them
    starts = ends - (tl.sum(onehot, axis=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pos = tl.sum(onehot * starts[None, :], axis=1) + _rank_in_chunk(onehot)
    tl.store(SortedIds + pos, items, mask=ids >= 0)


@triton.jit
def _align_small_kernel(Ids, SortedIds, ExpertIds, N, NUM_BLOCKS, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    items = tl.arange(0, BLOCK_N)
    ids = tl.load(Ids + items, mask=items < N, other=-1)
    _align_in_one_program(ids, items, SortedIds, ExpertIds, N, NUM_BLOCKS, BLOCK_E, BLOCK_M, BLOCK_B)


@triton.jit
def _count_kernel(Ids, Counts, N, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(Ids + offs, mask=offs < N, other=-1)
    cols = tl.arange(0, BLOCK_E)
    tl.store(Counts + pid * BLOCK_E + cols, tl.sum(_onehot(ids, BLOCK_E), axis=0))


@triton.jit
def _offsets_kernel(Counts, Prefix, Starts, SortedIds, ExpertIds, N, NUM_CHUNKS, NUM_BLOCKS,
                    BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_B: tl.constexpr):
    """Prefix[p, e] = rows of expert e in chunks before p; Starts[e] = where e's group begins."""
    cols = tl.arange(0, BLOCK_E)
    running = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, NUM_CHUNKS, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        at = p[:, None] * BLOCK_E + cols[None, :]
        c = tl.load(Counts + at, mask=(p < NUM_CHUNKS)[:, None], other=0)
        tl.store(Prefix + at, tl.cumsum(c, axis=0) - c + running[None, :], mask=(p < NUM_CHUNKS)[:, None])
        running += tl.sum(c, axis=0)
    ends = _padded_ends(running, BLOCK_M)
    tl.store(Starts + cols, ends - (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
    _fill_padding_and_blocks(SortedIds, ExpertIds, ends, N, NUM_BLOCKS, BLOCK_M, BLOCK_B)


@triton.jit
def _scatter_kernel(Ids, Prefix, Starts, SortedIds, N, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(Ids + offs, mask=offs < N, other=-1)
    cols = tl.arange(0, BLOCK_E)
    base = tl.load(Prefix + pid * BLOCK_E + cols) + tl.load(Starts + cols)
    onehot = _onehot(ids, BLOCK_E)
    pos = tl.sum(onehot * base[None, :], axis=1) + _rank_in_chunk(onehot)
    tl.store(SortedIds + pos, offs, mask=ids >= 0)


def _block_b(block_e: int, block_m: int) -> int:
    """Blocks per step of the padding loop: its [BLOCK_B, BLOCK_E] and [BLOCK_B, BLOCK_M] tiles ~2k."""
    return max(1, min(2048 // block_e, 2048 // block_m))


def _outputs(n: int, num_experts: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    nb = num_blocks(n, num_experts, block_m)
    return (torch.empty(nb * block_m, dtype=torch.int32, device=device),
            torch.empty(nb, dtype=torch.int32, device=device))


def _one_program_fits(rows: int, num_experts: int) -> bool:
    """Whether a one-program kernel's [rows, experts] one-hot tile stays within ONEHOT_ELEMS."""
    return rows * triton.next_power_of_2(num_experts) <= ONEHOT_ELEMS


def small_align_fits(n: int, num_experts: int) -> bool:
    """Whether align()'s one program holds n assignments (decode-sized batches)."""
    return _one_program_fits(triton.next_power_of_2(max(n, 1)), num_experts)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int, one_program: bool | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, top_k] int32 (contiguous) -> (sorted_ids, expert_ids), see the module doc.
    `one_program`: align in one launch (default: when small_align_fits) or in three."""
    n = topk_ids.numel()
    sorted_ids, expert_ids = _outputs(n, num_experts, block_m, topk_ids.device)
    if n == 0:
        return sorted_ids, expert_ids
    block_e = triton.next_power_of_2(num_experts)
    if one_program if one_program is not None else small_align_fits(n, num_experts):
        _align_small_kernel[(1,)](topk_ids, sorted_ids, expert_ids, n, expert_ids.numel(),
                                  BLOCK_N=triton.next_power_of_2(n), BLOCK_E=block_e, BLOCK_M=block_m,
                                  BLOCK_B=_block_b(block_e, block_m), num_warps=8)
        return sorted_ids, expert_ids
    chunk = chunk_size(num_experts)
    chunks = triton.cdiv(n, chunk)
    counts = torch.empty(chunks, block_e, dtype=torch.int32, device=topk_ids.device)
    prefix = torch.empty_like(counts)
    starts = torch.empty(block_e, dtype=torch.int32, device=topk_ids.device)
    _count_kernel[(chunks,)](topk_ids, counts, n, CHUNK=chunk, BLOCK_E=block_e, num_warps=4)
    _offsets_kernel[(1,)](
        counts, prefix, starts, sorted_ids, expert_ids, n, chunks, expert_ids.numel(), BLOCK_E=block_e,
        BLOCK_P=max(1, 2048 // block_e), BLOCK_M=block_m, BLOCK_B=_block_b(block_e, block_m), num_warps=4,
    )
    _scatter_kernel[(chunks,)](topk_ids, prefix, starts, sorted_ids, n, CHUNK=chunk, BLOCK_E=block_e, num_warps=4)
    return sorted_ids, expert_ids


def small_route_align_fits(num_tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether route_and_align's one program holds the whole batch (decode-sized batches)."""
    return _one_program_fits(triton.next_power_of_2(max(num_tokens, 1)) * triton.next_power_of_2(top_k), num_experts)


def route_and_align(logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing (moe_routing.route) and align() in one program, for batches where
    small_route_align_fits(): (weights, ids, sorted_ids, expert_ids)."""
    t, e = logits.shape
    dev = logits.device
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    sorted_ids, expert_ids = _outputs(t * top_k, e, block_m, dev)
    if t == 0:
        return weights, ids, sorted_ids, expert_ids
    block_e = triton.next_power_of_2(e)
    _route_align_small_kernel[(1,)](
        logits, weights, ids, sorted_ids, expert_ids, t, e, logits.stride(0), expert_ids.numel(),
        TOP_K=top_k, BLOCK_T=triton.next_power_of_2(t), BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), SIGMOID=scoring == "sigmoid", RENORMALIZE=renormalize,
        BLOCK_M=block_m, BLOCK_B=_block_b(block_e, block_m), num_warps=8,
    )
    return weights, ids, sorted_ids, expert_ids


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = topk_ids.reshape(-1).long().cpu()
    n = flat.numel()
    nb = num_blocks(n, num_experts, block_m)
    sorted_ids = torch.full((nb * block_m,), n, dtype=torch.int32)
    expert_ids = torch.full((nb,), -1, dtype=torch.int32)
    pos = 0
    for e in range(num_experts):
        rows = (flat == e).nonzero().flatten()
        if rows.numel() == 0:
            continue
        sorted_ids[pos : pos + rows.numel()] = rows.int()
        blocks = -(-rows.numel() // block_m)
        expert_ids[pos // block_m : pos // block_m + blocks] = e
        pos += blocks * block_m
    return sorted_ids.to(topk_ids.device), expert_ids.to(topk_ids.device)
