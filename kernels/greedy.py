"""Greedy rows of a batch (Triton): each row's first argmax and the log-softmax at it, beside
an fp32 torch reference.

A batch-1 decode step's vocabulary row (128k-152k logits) is too short for torch's one-row
reductions, which ran argmax and logsumexp as three reductions of about 9-28 us each on an H200
(55 us of a 2.4 ms INT4 Llama-3.1-8B step), and too long for one program. Here pass 1 gives every
CHUNK logits of a row a program: its max, its first argmax and sum 2^((x - max) log2 e); pass 2
folds a row's chunks in order: the token is the first argmax among the chunks that hold the
row's max, and log_softmax at it is x[token] - logsumexp = max - (max + log s) = -log s. The chunks
are fixed positions of the vocabulary, so a row's result does not depend on the batch.
Memory traffic: the logits once (4 bytes each) plus 12 bytes per chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling import LOG2E

CHUNK = 4096  # logits per pass-1 program (a 128k vocabulary: 32 programs a row)


@triton.jit
def _chunk_kernel(Logits, stride, V, PartM, PartS, PartA, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Logits + row * stride + offs, mask=offs < V, other=float("-inf"))
    m = tl.max(x, 0)
    # First argmax of the chunk. Triton's max skips NaN where torch's argmax would pick it: a NaN
    # logit is never the token here, and its row's log-prob comes out NaN.
    a = tl.min(tl.where(x == m, offs, V), 0)
    # -inf logits add 2^-inf = 0; a max of -inf (every logit masked) stands in as -1e30, so that
    # no -inf - -inf (NaN) is formed.
    s = tl.sum(tl.exp2((x - tl.maximum(m, -1.0e30)) * LOG2E), 0)
    at = row * num_chunks + c
    tl.store(PartM + at, m)
    tl.store(PartS + at, s)
    tl.store(PartA + at, a)


@triton.jit
def _fold_kernel(PartM, PartS, PartA, num_chunks, V, Tokens, Logprobs, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    live = c < num_chunks
    m_c = tl.load(PartM + row * num_chunks + c, mask=live, other=float("-inf"))
    s_c = tl.load(PartS + row * num_chunks + c, mask=live, other=0.0)
    a_c = tl.load(PartA + row * num_chunks + c, mask=live, other=V)
    m = tl.max(m_c, 0)
    tok = tl.min(tl.where(m_c == m, a_c, V), 0)
    s = tl.sum(s_c * tl.exp2((m_c - tl.maximum(m, -1.0e30)) * LOG2E), 0)
    tl.store(Tokens + row, tl.minimum(tok, V - 1).to(tl.int64))
    # Every logit -inf: NaN, as torch's log_softmax (-log 0 would be a misleading +inf).
    tl.store(Logprobs + row, tl.where(m > float("-inf"), -tl.log(s), float("nan")))


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [B, V] (last dim packed, row stride free) -> (tokens int64 [B], logprobs f32 [B]):
    the first argmax of each row and log_softmax(row)[token]."""
    b, v = logits.shape
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    if b == 0:
        return tokens, logprobs
    chunks = triton.cdiv(v, CHUNK)
    part_m = torch.empty(b * chunks, dtype=torch.float32, device=logits.device)
    part_s = torch.empty_like(part_m)
    part_a = torch.empty(b * chunks, dtype=torch.int32, device=logits.device)
    _chunk_kernel[(b, chunks)](logits, logits.stride(0), v, part_m, part_s, part_a, chunks, CHUNK=CHUNK, num_warps=8)
    _fold_kernel[(b,)](part_m, part_s, part_a, chunks, v, tokens, logprobs,
                       BLOCK_C=max(16, triton.next_power_of_2(chunks)), num_warps=1)
    return tokens, logprobs


def greedy_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch: argmax (the first maximum) and log_softmax at it (x[token] - logsumexp, without
    a [B, V] log_softmax)."""
    tokens = logits.argmax(dim=-1)
    return tokens, logits.gather(1, tokens[:, None]).squeeze(1) - logits.logsumexp(dim=-1)
