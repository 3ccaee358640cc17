"""Grammar masks: set the logits of tokens a row's grammar forbids to -inf (Triton), beside the
torch reference.

The mask is xgrammar's packed layout: int32 [k, W] with W >= ceil(V / 32); bit b of word w
(b = 0 the least significant) is 1 when token 32 * w + b is allowed. Mask row j belongs to
logits row rows[j]: only the k constrained rows of a batch are masked, so a batch pays for
its constrained rows alone. Memory traffic per constrained row: V / 8 bytes of mask read,
V * 4 bytes of logits written at most (only forbidden tokens are stored; nothing is read).

With `with_lse`, the kernel also returns each masked row's log-normalizer (logsumexp) as it was
before the mask: the sampler reports logprobs of the raw distribution, and a mask leaves every
allowed token's logit as it was, so the chosen token's raw logprob is its logit after the mask
minus this value, with no raw copy of the row (one extra read of its V * 4 bytes). Each
program writes its block's (max, sum of exp(x - max)); torch combines the [k, blocks] partials.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 4096  # tokens per program; benchmarks/grammar.py measures the alternatives


@triton.jit
def _apply_token_bitmask_kernel(Logits, Mask, Rows, Part, stride_l, stride_m, V, BLOCK: tl.constexpr,
                                WITH_LSE: tl.constexpr):
    j = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < V
    row = tl.load(Rows + j).to(tl.int64)
    if WITH_LSE:  # this block's share of the row's raw logsumexp, read before the mask writes
        x = tl.load(Logits + row * stride_l + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), axis=0)  # an all -inf block: 0
        part = Part + (j.to(tl.int64) * tl.num_programs(1) + blk) * 2
        tl.store(part, m)
        tl.store(part + 1, s)
    # Each word is loaded by the 32 lanes that share it: one cache line serves them all.
    words = tl.load(Mask + j.to(tl.int64) * stride_m + offs // 32, mask=in_vocab, other=-1)
    allowed = (words >> (offs % 32)) & 1
    tl.store(Logits + row * stride_l + offs, float("-inf"), mask=in_vocab & (allowed == 0))


def combine_lse(part: torch.Tensor) -> torch.Tensor:
    """f32 [k] logsumexp of each row from its blocks' (max, sum of exp(x - max)) [k, n, 2]."""
    m = part[..., 0].amax(dim=1, keepdim=True)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row of -inf only: -inf, not NaN
    return ((part[..., 1] * torch.exp(part[..., 0] - safe)).sum(dim=1).log() + safe.squeeze(1))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, block: int = BLOCK,
                        with_lse: bool = False) -> torch.Tensor | None:
    """In place. logits [B, V] (last dim packed), bitmask int32 [k, W], rows int32 [k].
    with_lse: returns f32 [k], logsumexp of logits[rows[j]] before the mask."""
    k, v = rows.numel(), logits.shape[1]
    if k == 0:
        return logits.new_empty(0, dtype=torch.float32) if with_lse else None
    grid = (k, triton.cdiv(v, block))
    part = torch.empty(k, grid[1], 2, dtype=torch.float32, device=logits.device) if with_lse else logits
    _apply_token_bitmask_kernel[grid](logits, bitmask, rows, part, logits.stride(0), bitmask.stride(0), v,
                                      BLOCK=block, WITH_LSE=with_lse)
    return combine_lse(part) if with_lse else None


def unpack_bitmask_reference(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [k, vocab]: True where the token is allowed. The int32 words are little-endian, so
    their bytes in memory order, each unpacked least significant bit first, list the tokens in
    order."""
    words = bitmask.detach().cpu().contiguous().numpy()
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits.astype(bool)).to(bitmask.device)


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, with_lse: bool = False
) -> torch.Tensor | None:
    idx = rows.long()
    lse = logits[idx].float().logsumexp(dim=-1) if with_lse else None
    if rows.numel() == 0:
        return lse
    assert np.little_endian, "the packed layout is read as little-endian bytes"
    allowed = unpack_bitmask_reference(bitmask, logits.shape[1])
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return lse
