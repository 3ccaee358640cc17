"""Applying grammar token masks to logits: Triton where it can run, else the torch reference."""

from __future__ import annotations

import torch

from minisgl.ops._backend import log_cpu_reference_once, use_triton
from minisgl.ops._checks import check_contiguous, check_same_device, check_shape, check_tensor


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, with_lse: bool = False
) -> torch.Tensor | None:
    """In place: logits[rows[j], t] = -inf wherever bit t of bitmask[j] is 0. With `with_lse`,
    returns f32 [k]: logsumexp(logits[rows[j]]) as it was before the mask (in one pass).

    logits f32/f16/bf16 [B, V] (last dim packed, row stride free); bitmask int32 [k, W] with
    W >= ceil(V / 32) (xgrammar's packed layout, row stride free); rows int32 [k], distinct
    values in [0, B) (not checked on the device: that would synchronize)."""
    check_tensor("logits", logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=2)
    if logits.stride(1) != 1 and logits.shape[1] > 1:
        raise ValueError(f"logits must be packed in its last dimension, got strides {logits.stride()}")
    check_tensor("bitmask", bitmask, dtype=torch.int32, ndim=2)
    check_tensor("rows", rows, dtype=torch.int32, ndim=1)
    check_shape("rows", rows, (bitmask.shape[0],))
    check_contiguous("rows", rows)
    if bitmask.shape[0] and bitmask.stride(1) != 1:
        raise ValueError(f"bitmask must be packed in its last dimension, got strides {bitmask.stride()}")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"bitmask covers {bitmask.shape[1] * 32} tokens but logits have {logits.shape[1]}: "
            "allocate it for the model's full vocabulary"
        )
    if bitmask.shape[0] > logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for a batch of {logits.shape[0]}")
    check_same_device(logits=logits, bitmask=bitmask, rows=rows)
    if use_triton("apply_token_bitmask", logits):
        from minisgl.kernels.token_bitmask import apply_token_bitmask as kernel

        return kernel(logits, bitmask, rows, with_lse=with_lse)
    log_cpu_reference_once("apply_token_bitmask")
    from minisgl.kernels.token_bitmask import apply_token_bitmask_reference

    return apply_token_bitmask_reference(logits, bitmask, rows, with_lse)
