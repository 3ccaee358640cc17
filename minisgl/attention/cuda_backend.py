"""The `cuda` attention backend: decode steps run minisgl._C's paged flash-decoding kernel;
extend steps (prefill, chunked prefill, prefix hits) run the Triton extend kernel
(ops.extend_attention, which falls back to its torch reference where Triton cannot run).
Both read a 16-bit or an FP8 e4m3 cache (per-layer K/V scales, dequantized in registers).
Sliding-window layers (Gemma 3, Mistral, Qwen2) decode through the same CUDA kernel: its splits
cover the last W keys only. Layers with sinks (GPT-OSS) and models with 8 q heads per KV head
(TRITON_DECODE_GROUP) decode through the Triton split kernel. The CUDA kernel takes sinks too
(tests/test_decode_window.py passes at head dims 64-256), but the tiny GPT-OSS engine test (head
dim 16) missed transformers' tokens with it on the H100 and that was not explained: not used
for sinks until it is.

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
# From this many q heads per KV head, decode runs the Triton split kernel (tensor-core dots):
# our CUDA kernel does its dot products on the CUDA cores, and at 8 heads per 64-dim KV row
# (GPT-OSS) that is compute-bound: 54% of the read ceiling at a 32k context against 73% for the
# Triton kernel (benchmarks/kernels/decode_attention.py --triton-sweep, H100). Llama's 4 heads
# per 128-dim row are at parity or better with ours.
TRITON_DECODE_GROUP = 8


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
        group = self.group = num_q_heads // pool.kv_heads
        if group >= TRITON_DECODE_GROUP:
            log.info(f"attention backend 'cuda': {group} q heads per KV head decode through the Triton split "
                     "kernel (tensor-core dots; our kernel is compute-bound there)")
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
        if self.group >= TRITON_DECODE_GROUP or sinks is not None:
            return super()._decode(q, k_cache, v_cache, req_to_slot, rows, seq_lens, max_seq_len, out,
                                   k_scale, v_scale, window, sinks)
        return ops.paged_decode_attention(q, k_cache, v_cache, req_to_slot, rows, seq_lens, self.scale, max_seq_len,
                                          out=out, k_scale=k_scale, v_scale=v_scale, window=window, sinks=sinks)
