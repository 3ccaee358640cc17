"""Grammar masks: set the logits of tokens a row's grammar forbids to -inf (Triton), beside the
torch reference.

The mask is xgrammar's packed layout: int32 [k, W] with W >= ceil(V / 32); bit b of word w
(b = 0 the least significant) is 1 when token 32 * w + b is allowed. Mask row j belongs to
logits row rows[j]: only the k constrained rows of a batch are masked, so a batch pays for
its constrained rows alone. Memory traffic per constrained row: V / 8 bytes of mask read,
V * 4 bytes of logits written at most (only forbidden tokens are stored; nothing is read).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 4096  # tokens per program; benchmarks/grammar.py measures the alternatives


@triton.jit
def _apply_token_bitmask_kernel(Logits, Mask, Rows, stride_l, stride_m, V, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < V
    row = tl.load(Rows + j).to(tl.int64)
    # Each word is loaded by the 32 lanes that share it: one cache line serves them all.
    words = tl.load(Mask + j.to(tl.int64) * stride_m + offs // 32, mask=in_vocab, other=-1)
    allowed = (words >> (offs % 32)) & 1
    tl.store(Logits + row * stride_l + offs, float("-inf"), mask=in_vocab & (allowed == 0))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, block: int = BLOCK) -> None:
    """In place. logits [B, V] (last dim packed), bitmask int32 [k, W], rows int32 [k]."""
    k, v = rows.numel(), logits.shape[1]
    if k == 0:
        return
    grid = (k, triton.cdiv(v, block))
    _apply_token_bitmask_kernel[grid](logits, bitmask, rows, logits.stride(0), bitmask.stride(0), v, BLOCK=block)


def unpack_bitmask_reference(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [k, vocab]: True where the token is allowed. The int32 words are little-endian, so
    their bytes in memory order, each unpacked least significant bit first, list the tokens in
    order."""
    words = bitmask.detach().cpu().contiguous().numpy()
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits.astype(bool)).to(bitmask.device)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if rows.numel() == 0:
        return
    assert np.little_endian, "the packed layout is read as little-endian bytes"
    idx = rows.long()
    allowed = unpack_bitmask_reference(bitmask, logits.shape[1])
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
