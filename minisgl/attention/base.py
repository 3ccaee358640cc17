"""The attention backend interface.

A backend owns nothing but per-step metadata: K/V live in the engine's KVPool and are read
only through the request table. The engine calls `prepare(batch)` once per step (before the
model runs), then each attention layer calls `forward`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minisgl import ops
from minisgl.core.batch import ForwardBatch
from minisgl.kvcache.pool import KVPool


class AttentionBackend(ABC):
    name: str = "base"
    # Deterministic mode (set by the engine): each query token's output is bit-identical
    # however it is batched, chunked or split into prefix and extend (see each backend).
    deterministic: bool = False

    def __init__(
        self, pool: KVPool, num_q_heads: int, scale: float, q_dtype: torch.dtype | None = None,
        windows: tuple[int, ...] = (),
    ) -> None:
        self.pool = pool
        self.num_q_heads = num_q_heads
        self.scale = scale
        self.q_dtype = q_dtype or pool.dtype  # the model's dtype (an FP8 pool's differs from it)
        # Per layer: 0 = full attention, W > 0 = a sliding window of W keys (ModelConfig).
        self.windows = tuple(windows)

    def window_of(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def tables(self, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(request table, out slots) through which layer `layer` stores and reads its K/V.
        Every backend takes both from here, so a layer's pool group picks them in one place:
        a sliding layer whose K/V live in the pool's sliding group uses its own table."""
        if batch.req_to_swa_slot is not None and self.pool.is_swa_layer(layer):
            return batch.req_to_swa_slot, batch.out_slots_swa
        return batch.req_to_slot, batch.out_slots

    @staticmethod
    def store(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        out_slots: torch.Tensor, ks: float, vs: float, rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """The new tokens' k, v into a layer's cache rows `out_slots` (an FP8 cache holds K / ks,
        V / vs); with `rope` (positions, cos_sin_cache) q and k are rotated first, in the same
        kernel where it can."""
        if rope is None:
            ops.store_kv(k_cache, v_cache, k, v, out_slots, ks, vs)
        else:
            ops.apply_rope_and_store(q, k, v, rope[0], rope[1], k_cache, v_cache, out_slots, ks, vs)

    def wait_loaded(self, layer: int, batch: ForwardBatch) -> None:
        """Before a step other than a decode stores or reads layer `layer`: a host-tier load may
        be filling pages it reads (KVPool.wait_loaded). A request is admitted with its load in
        an extend or mixed step, never a decode step."""
        if not batch.is_decode:
            self.pool.wait_loaded(layer)

    def prepare(self, batch: ForwardBatch) -> None:
        """Build `batch.attn_metadata` once per step (default: nothing needed)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
        sinks: torch.Tensor | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q: [T, q_heads, head_dim]; k, v: [T, kv_heads, head_dim] for the step's new tokens
        (row strides may be anything: they are slices of the fused qkv output).
        Stores k, v at `batch.out_slots` of layer `layer` (self.store), then returns attention of
        each new token over its request's context (causal; within `window_of(layer)` keys where
        that is > 0), [T, q_heads, head_dim], q's dtype. sinks: fp32 [q_heads], one learned logit
        per head added to every softmax denominator (GPT-OSS; not multiplied by `scale`). rope:
        (positions, cos_sin_cache): q and k are not rotated yet; the store rotates them (in place)."""
