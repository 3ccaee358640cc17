"""Embedding index: gather embedding rows for token ids.

`embedding_lookup(weight, ids)` is `weight[ids]`. The vocab-parallel form, for a rank that
holds rows [start, end) of the vocabulary as `weight[0 : end - start]`, writes
`weight[id - start]` for ids in [start, end) and zeros for every other id (the all-reduce
across ranks then fills those in). Ids outside the range are never read, so out-of-range ids
cannot fault. On CUDA this is csrc/embedding.cuh; elsewhere the torch reference.
"""

from __future__ import annotations

import torch

from minisgl.ops import _checks
from minisgl.ops._backend import compiled, current_stream, use_cuda_kernel
from minisgl.ops._checks import (
    check_contiguous,
    check_inner_contiguous,
    check_same_device,
    check_shape,
    check_tensor,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ID_DTYPES = (torch.int32, torch.int64)


def embedding_lookup_reference(
    weight: torch.Tensor, ids: torch.Tensor, start: int = 0, end: int | None = None
) -> torch.Tensor:
    end = weight.size(0) + start if end is None else end
    if weight.size(0) == 0:
        return torch.zeros((ids.size(0), weight.size(1)), dtype=weight.dtype, device=weight.device)
    inside = (ids >= start) & (ids < end)
    local = torch.where(inside, ids.long() - start, torch.zeros_like(ids, dtype=torch.long))
    rows = weight[local.clamp(0, weight.size(0) - 1)]
    return torch.where(inside[:, None], rows, torch.zeros((), dtype=weight.dtype, device=weight.device))


def embedding_lookup(
    weight: torch.Tensor,
    ids: torch.Tensor,
    start: int = 0,
    end: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """weight [rows, hidden] (row stride free); ids int32/int64 [n]. Rows for ids in
    [start, end) (default: all of weight's rows), zeros elsewhere; returns [n, hidden]."""
    if _checks.enabled():
        check_tensor("weight", weight, dtype=_DTYPES, ndim=2)
        check_tensor("ids", ids, dtype=_ID_DTYPES, ndim=1)
        check_contiguous("ids", ids)
        check_inner_contiguous("weight", weight, inner_dims=1)
    end = weight.size(0) + start if end is None else end
    n, hidden = ids.size(0), weight.size(1)
    if _checks.enabled():
        if not 0 <= end - start <= weight.size(0):
            raise ValueError(f"end - start must be in [0, {weight.size(0)}] (weight's rows), got [{start}, {end})")
        if out is not None:
            check_tensor("out", out, dtype=weight.dtype, ndim=2)
            check_shape("out", out, (n, hidden))
            check_inner_contiguous("out", out, inner_dims=1)
            check_same_device(weight=weight, ids=ids, out=out)
        else:
            check_same_device(weight=weight, ids=ids)
    if not use_cuda_kernel("embedding_lookup", weight):
        ref = embedding_lookup_reference(weight, ids, start, end)
        if out is None:
            return ref
        out.copy_(ref)
        return out
    if out is None:
        out = torch.empty((n, hidden), dtype=weight.dtype, device=weight.device)
    esize = weight.element_size()
    compiled().embedding_lookup(
        out.data_ptr(),
        weight.data_ptr(),
        ids.data_ptr(),
        ids.dtype == torch.int64,
        n,
        hidden * esize,
        weight.stride(0) * esize,
        out.stride(0) * esize,
        start,
        end,
        current_stream(weight.device),
    )
    return out
