"""Packed sequences (cu_seqlens) cut into chunks of BT tokens, as a table built on the device:
for every chunk its sequence and first token (so a kernel can run one program per chunk), and
the number of chunks. Sized by an upper bound, it reads no host
value, so the kernels that use it stay capturable in a CUDA graph. Used by the Gated DeltaNet
chunked prefill (kernels/gated_delta_prefill.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chunk(ChunkSeq, ChunkStart, Cu, c, BT: tl.constexpr):
    """Chunk c's sequence (-1: past the last chunk), its tokens and their mask."""
    seq = tl.load(ChunkSeq + c)
    s0 = tl.load(ChunkStart + c)
    end = tl.load(Cu + tl.maximum(seq, 0) + 1)
    tok = s0 + tl.arange(0, BT)
    return seq, s0, tok, tok < end, end


@triton.jit
def _chunk_table_kernel(Cu, ChunkSeq, ChunkStart, NumChunks, N, C,
                        BT: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr):
    """Per sequence i: the table entries of its chunks, (i, first token), placed after the chunks
    (ceil(len / BT) each) of the sequences before it; the last program also writes the
    number of chunks and -1 over the spare entries. Every program sums the N lengths itself
    (parallel, no second pass); a single program filling the whole table serially cost
    O(entries x N) in one SM, in every Gated DeltaNet layer of a step with many sequences."""
    i = tl.program_id(0)
    offs = tl.arange(0, BN)
    m = offs < N
    lens = tl.load(Cu + offs + 1, mask=m, other=0) - tl.load(Cu + offs, mask=m, other=0)
    per_seq = (lens + BT - 1) // BT
    first = tl.sum(tl.where(offs < i, per_seq, 0), axis=0)
    lo = tl.load(Cu + i)
    mine = (tl.load(Cu + i + 1) - lo + BT - 1) // BT
    for j0 in range(0, mine, BC):
        j = j0 + tl.arange(0, BC)
        tl.store(ChunkSeq + first + j, tl.full((BC,), 0, tl.int32) + i, mask=j < mine)
        tl.store(ChunkStart + first + j, lo + j * BT, mask=j < mine)
    if i == N - 1:
        total = tl.sum(per_seq, axis=0)
        tl.store(NumChunks, total)
        for c0 in range(total, C, BC):
            c = c0 + tl.arange(0, BC)
            tl.store(ChunkSeq + c, tl.full((BC,), -1, tl.int32), mask=c < C)
            tl.store(ChunkStart + c, tl.full((BC,), 0, tl.int32), mask=c < C)


def chunk_table(cu_seqlens: torch.Tensor, t: int, bt: int):
    """(sequence, first token) of every chunk, -1 past the last, and the number of chunks, built
    on the device (one launch, no host value read): the table is sized by the bound
    sum(ceil(len / bt)) <= t // bt + N, plus one entry so the spare entries cover the padding
    past cu_seqlens[N] that the W/U kernel zeroes: (t // bt + N + 1 - chunks) * bt >= t - cu[N]."""
    n = cu_seqlens.shape[0] - 1
    c = t // bt + n + 1
    dev = cu_seqlens.device
    # one allocation cut into the three (each allocation costs host time before the first kernel),
    # each part starting 16-byte aligned: Triton specializes a kernel on its pointers' alignment,
    # and parts at offsets that move with (t, n) would compile new variants mid-serving
    c4 = -(-c // 4) * 4
    buf = torch.empty(2 * c4 + 1, dtype=torch.int32, device=dev)
    seq, start, total = buf[:c], buf[c4 : c4 + c], buf[2 * c4 :]
    _chunk_table_kernel[(n,)](cu_seqlens, seq, start, total, n, c, BT=bt,
                              BN=triton.next_power_of_2(max(n, 16)), BC=128, num_warps=4)
    return seq, start, total
