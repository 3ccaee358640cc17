"""The Triton attention backend: paged extend (prefill) and split-K decode kernels.

Works on any GPU Triton supports (and on the CPU under TRITON_INTERPRET=1, for tests). No
per-step metadata beyond what ForwardBatch already carries: both kernels read the request
table, lengths and offsets directly, so prepare() has nothing to build. Every launch is
CUDA-graph safe: decode's grid depends only on the batch size and the max_seq_len bound;
extend runs in tile-map mode when the batch carries tiles (engine-built batches do), its
grid then sized by the tile capacity; a mixed step's decode rows (batch.decode_rows) go
through the decode kernel first, and the tiles then write every other row.

Deterministic mode: no step reaches a decode kernel (their split count depends on the
batch). Decode steps run the extend kernel as extends of one token (the step builder gives
them a tile map: one one-token tile per request), and a mixed step's decodes are one-token
tiles (no batch.decode_rows). The extend kernel runs one fixed configuration in this mode,
with GQA packing (a tile's rows are tokens x the q heads of one KV group: a decode fills a
group's rows and reads its keys once), and walks each query's keys in BLOCK_N chunks at fixed
absolute positions (0, BLOCK_N, 2 BLOCK_N, ...) with one fixed tile configuration, and a
chunk wholly past a query's position leaves its running max, sum and accumulator
bit-identical (weight exp2(-inf) = 0, rescale exp2(0) = 1); which tile row a query sits in,
and what the tile's other rows hold, changes nothing of its row. So a token's output is the
same from a prefill, a chunked prefill, an extend after a radix-cache hit, a mixed step or a
decode, graph or eager, whatever else shares the launch.

Sliding windows and sinks (per layer: `window_of(layer)`, the model's sinks): both kernels take
them (not in deterministic mode, which the engine refuses for such models); a sliding layer's
table and out slots come from `tables(layer, batch)`.
"""

from __future__ import annotations

import torch

from minisgl import ops
from minisgl.attention.base import AttentionBackend
from minisgl.core.batch import ForwardBatch


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
        sinks: torch.Tensor | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = self.pool.k_cache(layer), self.pool.v_cache(layer)
        ks, vs = self.pool.k_scales[layer], self.pool.v_scales[layer]  # FP8 cache: K / ks, V / vs
        req_to_slot, out_slots = self.tables(layer, batch)
        self.wait_loaded(layer, batch)
        self.store(q, k, v, k_cache, v_cache, out_slots, ks, vs, rope)
        window = self.window_of(layer)
        if batch.is_decode and not self.deterministic:
            return self._decode(q, k_cache, v_cache, req_to_slot, batch.req_rows, batch.seq_lens,
                                batch.max_seq_len, k_scale=ks, v_scale=vs, window=window, sinks=sinks)
        out = None
        if batch.decode_rows is not None:  # first: the extend tiles then overwrite the other rows
            if self.deterministic:
                raise ValueError("deterministic mode takes a mixed step's decodes as extend tiles, not decode rows")
            d = batch.decode_rows.shape[0]
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self._decode(q[:d], k_cache, v_cache, req_to_slot, batch.decode_rows, batch.decode_seq_lens,
                         batch.max_seq_len, out[:d], k_scale=ks, v_scale=vs, window=window, sinks=sinks)
        return ops.extend_attention(
            q, k_cache, v_cache, req_to_slot, batch.req_rows, batch.prefix_lens,
            batch.seq_lens, batch.cu_seqlens_q, batch.max_extend_len, self.scale, out=out, tiles=batch.tiles,
            deterministic=self.deterministic, decode_max_seq_len=batch.max_seq_len if batch.is_decode else None,
            k_scale=ks, v_scale=vs, window=window, sinks=sinks,
        )

    @property
    def tile_block_m(self) -> int:
        """Query tokens per extend-kernel tile: the unit of the batch's tile map."""
        return ops.extend_block_m(self.pool.head_dim, self.q_dtype, self.pool.device,
                                  self.num_q_heads // self.pool.kv_heads, self.deterministic)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_slot: torch.Tensor,
        rows: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, out: torch.Tensor | None = None,
        k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return ops.decode_attention_triton(q, k_cache, v_cache, req_to_slot, rows, seq_lens, max_seq_len, self.scale,
                                           out=out, k_scale=k_scale, v_scale=v_scale, window=window, sinks=sinks)
