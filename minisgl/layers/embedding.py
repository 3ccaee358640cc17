"""Vocab-parallel embedding and LM head: each rank holds rows [start, start + per_rank) of
the (padded) vocabulary."""

from __future__ import annotations

import torch
from torch import nn

from minisgl import ops
from minisgl.distributed.info import Communicator, TPInfo
from minisgl.layers.linear import _check_shape
from minisgl.ops.gemm.table import GemmCall


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo, comm: Communicator) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)  # ceil: the last rank's shard may be padded
        self.start = tp.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.tp, self.comm = tp, comm
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden), requires_grad=False)

    def load(self, name: str, full: torch.Tensor) -> None:
        _check_shape(name, full.shape, (self.vocab_size, self.weight.shape[1]))
        rows = self.end - self.start
        self.weight.data[:rows].copy_(full[self.start : self.end])
        self.weight.data[rows:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return ops.embedding_lookup(self.weight, ids)
        # Rows outside this rank's range come out as zeros; the all-reduce fills them in.
        return self.comm.all_reduce(ops.embedding_lookup(self.weight, ids, start=self.start, end=self.end))


class ParallelLMHead(nn.Module):
    """Logits for the rows being sampled only. Tied: reuses the embedding's shard."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool) -> None:
        super().__init__()
        self.embedding = embedding
        self.tied = tied
        if not tied:
            self.weight = nn.Parameter(torch.empty_like(embedding.weight), requires_grad=False)

    def load(self, name: str, full: torch.Tensor) -> None:
        e = self.embedding
        _check_shape(name, full.shape, (e.vocab_size, e.weight.shape[1]))
        rows = e.end - e.start
        self.weight.data[:rows].copy_(full[e.start : e.end])
        self.weight.data[rows:].zero_()

    def gemm_calls(self) -> list[GemmCall]:
        return [GemmCall(self.embedding.weight if self.tied else self.weight, False)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embedding.weight if self.tied else self.weight
        logits = ops.linear(hidden, w)
        if self.embedding.tp.size > 1:
            logits = self.embedding.comm.all_gather(logits, dim=-1)
        return logits[:, : self.embedding.vocab_size]
