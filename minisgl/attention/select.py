"""Which attention backend an engine gets: `make_backend` resolves "auto" for the device and
the KV cache's dtype and refuses a backend that cannot run there."""

from __future__ import annotations

import torch

from minisgl.attention.base import AttentionBackend
from minisgl.kvcache.pool import KVPool


def make_backend(
    name: str, pool: KVPool, num_q_heads: int, scale: float, device: torch.device, q_dtype: torch.dtype | None = None,
    windows: tuple[int, ...] = (),
) -> AttentionBackend:
    """q_dtype: the model's dtype (default: the pool's; an FP8 pool's differs). windows: per
    layer, 0 = full attention, W > 0 = sliding window (ModelConfig.attention_windows)."""
    q_dtype = q_dtype or pool.dtype
    if name == "auto":
        # GPU: our CUDA decode kernel + Triton extend where _C has CUDA, else all-Triton (both
        # read 16-bit and FP8 e4m3 caches). A float32 KV cache gets the torch backend: our CUDA
        # kernel takes 16-bit/FP8 caches only, and float32 is the reference dtype, whose math the
        # torch backend shares with the CPU.
        # (The Triton kernels are exact in fp32 too, with ieee dots; `triton` can be chosen.)
        from minisgl.ops._backend import compiled

        ext = compiled()
        if device.type != "cuda" or pool.dtype == torch.float32:
            name = "torch"
        elif q_dtype == torch.float32:  # an FP8 pool under a float32 model: our kernel takes 16-bit q
            name = "triton"
        else:
            name = "cuda" if ext is not None and ext.has_cuda else "triton"
    if name == "torch":
        from minisgl.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(pool, num_q_heads, scale, q_dtype, windows)
    if device.type != "cuda":
        raise ValueError(f"attention_backend {name!r} needs a CUDA device; use 'torch' on {device}")
    if name == "triton":
        from minisgl.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(pool, num_q_heads, scale, q_dtype, windows)
    from minisgl.attention.cuda_backend import CudaAttentionBackend

    return CudaAttentionBackend(pool, num_q_heads, scale, q_dtype, windows)
