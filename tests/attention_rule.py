"""Shared by the attention kernel tests. The accuracy rule (FlashAttention-3's): against fp64
math, the kernel's max error may be at most twice torch's own error when it computes in the
output dtype, plus two rounding steps of that dtype (the floor for outputs rounded once).
And NaN in the cache slots no request owns, which no kernel may let through; `paged_table` builds
a request table over permuted pages."""

from __future__ import annotations

from collections.abc import Callable

import torch


def assert_fa3_rule(
    out: torch.Tensor, reference: Callable[..., torch.Tensor], *args: object, min_floor_ulps: float = 0.0
) -> None:
    """`reference(*args, compute_dtype=...)` is the attention reference for the same inputs.
    `min_floor_ulps`: a floor of that many units in the last place of the output dtype at the
    largest output, for references whose "fp64" result is itself rounded to the output dtype
    (the rounding floor above then computes as 0)."""
    gold = reference(*args, compute_dtype=torch.float64)
    same = reference(*args, compute_dtype=out.dtype)
    floor = 2 * ((gold + 0.3 - 0.3).to(out.dtype).double() - gold).abs().max().item()
    floor = max(floor, min_floor_ulps * torch.finfo(out.dtype).eps * gold.abs().max().item())
    err = (out.double() - gold).abs().max().item()
    base = (same.double() - gold).abs().max().item()
    assert torch.isfinite(out).all()
    assert err <= 2 * base + floor, f"kernel error {err:.3g} > 2 x torch {base:.3g} + {floor:.3g}"


def poison_unused_slots(c: dict, seq_lens: list[int]) -> None:
    """NaN in every cache slot no request owns (the dummy page included): a kernel that loads
    one and weighs it by 0 still gets NaN (0 x NaN), as stale pool memory would give it."""
    used = torch.zeros(c["k_cache"].shape[0], dtype=torch.bool, device=c["k_cache"].device)
    for row, n in zip(c["req_rows"].tolist(), seq_lens):
        used[c["req_to_slot"][row, :n].long()] = True
    c["k_cache"][~used] = float("nan")
    c["v_cache"][~used] = float("nan")


def paged_table(seq_lens: list[int], page_size: int, gen: torch.Generator, device: str, spare_rows: int = 2):
    """req_to_slot [B + spare, max_ctx] over randomly permuted pages (page 0 = dummy, unused);
    requests get rows in shuffled order. Returns (table, rows int32 [B], num_slots)."""
    b = len(seq_lens)
    pages_needed = sum(-(-s // page_size) for s in seq_lens)
    num_pages = pages_needed + 3
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    max_ctx = max(seq_lens) + 5
    table = torch.zeros(b + spare_rows, max_ctx, dtype=torch.int32)
    rows = torch.randperm(b + spare_rows, generator=gen)[:b].to(torch.int32)
    for i, s in enumerate(seq_lens):
        n = -(-s // page_size)
        pages, perm = torch.tensor(perm[:n]), perm[n:]
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:s]
        table[rows[i], :s] = slots.to(torch.int32)
    return table.to(device), rows.to(device), num_pages * page_size
