"""The `cuda` attention backend: decode steps run minisgl._C's paged flash-decoding kernel;
extend steps (prefill, chunked prefill, prefix hits) run the Triton extend kernel
(ops.extend_attention, which falls back to its torch reference where Triton cannot run).
Both read a 16-bit or an FP8 e4m3 cache (per-layer K/V scales, dequantized in registers).
Layers with a sliding window or sinks (Gemma 3, GPT-OSS) decode through the Triton split kernel,
which takes both; the CUDA kernel reads whole contexts and has no sink term.

Decode is CUDA-graph safe: the store and the kernel read slots, rows and lengths from the
batch's device tensors, and the kernel's launch shape depends only on the batch size, the
head layout and `batch.max_seq_len`, which under CUDA graphs is a fixed upper bound.
"""

from __future__ import annotations

import torch

from minisgl import ops
from minisgl.attention.triton_backend import TritonAttentionBackend
from minisgl.kvcache.pool import KVPool
from minisgl.logging_setup import get_logger
from minisgl.ops.decode_attention import _HEAD_DIMS

SUPPORTED_HEAD_DIMS = _HEAD_DIMS
log = get_logger(__name__)


class CudaAttentionBackend(TritonAttentionBackend):
    """Extend (prefill) as the Triton backend; decode through minisgl._C."""

    name = "cuda"

    def __init__(
        self, pool: KVPool, num_q_heads: int, scale: float, q_dtype: torch.dtype | None = None,
        windows: tuple[int, ...] = (),
    ) -> None:
        super().__init__(pool, num_q_heads, scale, q_dtype, windows)
        # Refuse at startup what the kernel cannot run, rather than at the first decode step.
        if pool.dtype not in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(
                f"attention backend 'cuda' needs a float16, bfloat16 or fp8_e4m3 KV cache, got {pool.dtype}; "
                "use --dtype bfloat16 or another attention backend"
            )
        if self.q_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention backend 'cuda' needs a float16 or bfloat16 model, got {self.q_dtype}")
        if pool.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"attention backend 'cuda' supports head_dim {SUPPORTED_HEAD_DIMS}, got {pool.head_dim}")
        if any(self.windows):
            log.info("attention backend 'cuda': the sliding-window layers decode through the Triton split kernel "
                     "(window bound per layer); the full layers through minisgl._C's kernel")
        group = num_q_heads // pool.kv_heads
        if num_q_heads % pool.kv_heads != 0 or not 1 <= group <= 8:
            raise ValueError(
                f"attention backend 'cuda' supports 1..8 query heads per KV head, got {num_q_heads} / {pool.kv_heads}"
            )

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_slot: torch.Tensor,
        rows: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, out: torch.Tensor | None = None,
        k_scale: float = 1.0, v_scale: float = 1.0,  # an FP8 pool's per-layer scales (1.0 for 16-bit)
        window: int = 0, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if window or sinks is not None:  # our CUDA kernel reads whole contexts, without sinks
            return super()._decode(q, k_cache, v_cache, req_to_slot, rows, seq_lens, max_seq_len, out,
                                   k_scale, v_scale, window, sinks)
        return ops.paged_decode_attention(q, k_cache, v_cache, req_to_slot, rows, seq_lens, self.scale, max_seq_len,
                                          out=out, k_scale=k_scale, v_scale=v_scale)
