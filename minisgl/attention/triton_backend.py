"""The Triton attention backend: paged extend (prefill) and split-K decode kernels.

Works on any GPU Triton supports (and on the CPU under TRITON_INTERPRET=1, for tests). No
per-step metadata beyond what ForwardBatch already carries: both kernels read the request
table, lengths and offsets directly, so prepare() has nothing to build and decode stays
CUDA-graph safe (its grid depends only on the batch size and the max_seq_len bound).

Deterministic mode: decode steps run the extend kernel too, as extends of one token. That
kernel walks each query's keys in BLOCK_N chunks at fixed absolute positions (0, BLOCK_N,
2 BLOCK_N, ...) with one fixed tile configuration, and a chunk wholly past a query's position
leaves its running max, sum and accumulator bit-identical (weight exp2(-inf) = 0, rescale
exp2(0) = 1). So a token's output is the same from a prefill, a chunked prefill, an extend
after a radix-cache hit or a decode, whatever else shares the launch. The split-K decode
kernels are not used: their split count depends on the batch.
"""

from __future__ import annotations

import torch

from minisgl import ops
from minisgl.attention.base import AttentionBackend
from minisgl.engine.batch import ForwardBatch


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def prepare(self, batch: ForwardBatch) -> None:
        if self.deterministic and batch.is_decode:
            # Decode as an extend of one token: its prefix is seq_len - 1. Computed on the
            # device (CUDA graphs capture it; their static prefix_lens are not refreshed).
            batch.attn_metadata = batch.seq_lens - 1

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        k_cache, v_cache = self.pool.k_cache(layer), self.pool.v_cache(layer)
        ops.store_kv(k_cache, v_cache, k, v, batch.out_slots)
        if batch.is_decode and not self.deterministic:
            return self._decode(q, k_cache, v_cache, batch)
        prefix = batch.attn_metadata if batch.is_decode else batch.prefix_lens
        return ops.extend_attention(
            q, k_cache, v_cache, batch.req_to_slot, batch.req_rows, prefix,
            batch.seq_lens, batch.cu_seqlens_q, batch.max_extend_len, self.scale,
        )

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        return ops.decode_attention_triton(
            q, k_cache, v_cache, batch.req_to_slot, batch.req_rows, batch.seq_lens, batch.max_seq_len, self.scale
        )
