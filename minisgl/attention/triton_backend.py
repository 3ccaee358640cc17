"""The Triton attention backend: paged extend (prefill) and split-K decode kernels.

Works on any GPU Triton supports (and on the CPU under TRITON_INTERPRET=1, for tests). No
per-step metadata beyond what ForwardBatch already carries: both kernels read the request
table, lengths and offsets directly, so prepare() has nothing to build and decode stays
CUDA-graph safe (its grid depends only on the batch size and the max_seq_len bound).
"""

from __future__ import annotations

import torch

from minisgl import ops
from minisgl.attention.base import AttentionBackend
from minisgl.engine.batch import ForwardBatch


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        k_cache, v_cache = self.pool.k_cache(layer), self.pool.v_cache(layer)
        ks, vs = self.pool.k_scales[layer], self.pool.v_scales[layer]  # FP8 cache: K / ks, V / vs
        ops.store_kv(k_cache, v_cache, k, v, batch.out_slots, ks, vs)
        if batch.is_decode:
            return self._decode(q, k_cache, v_cache, batch, ks, vs)
        return ops.extend_attention(
            q, k_cache, v_cache, batch.req_to_slot, batch.req_rows, batch.prefix_lens,
            batch.seq_lens, batch.cu_seqlens_q, batch.max_extend_len, self.scale, k_scale=ks, v_scale=vs,
        )

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> torch.Tensor:
        return ops.decode_attention_triton(
            q, k_cache, v_cache, batch.req_to_slot, batch.req_rows, batch.seq_lens, batch.max_seq_len, self.scale,
            k_scale=k_scale, v_scale=v_scale,
        )
