"""The torch reference backend: plain fp32 math over K/V gathered through the request table.
Runs on CPU and GPU; it is the path the CPU engine and the tests use, and the reference the
kernel backends are compared with.

Deterministic mode: one query token at a time over exactly its keys 0..p, so the matmul
shapes a token sees depend on its position alone (not on how many tokens share its step, nor
on the prefix/extend split); the BLAS then gives the same bits for the same token."""

from __future__ import annotations

import torch

from minisgl import ops
from minisgl.attention.base import AttentionBackend
from minisgl.core.batch import ForwardBatch


def attend_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, Hq, D] at positions q_positions [n]; k, v [L, Hkv, D] for positions 0..L-1.
    Causal: query at position p sees keys 0..p. fp32 math; returns fp32 [n, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), kf) * scale
    key_pos = torch.arange(k.shape[0], device=q.device)
    mask = key_pos[None, :] > q_positions[:, None]
    scores.masked_fill_(mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), vf)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None or self.window_of(layer):
            raise NotImplementedError(f"attention backend {self.name!r}: sliding windows and sinks are not built yet")
        k_cache, v_cache = self.pool.k_cache(layer), self.pool.v_cache(layer)
        ks, vs = self.pool.k_scales[layer], self.pool.v_scales[layer]
        ops.store_kv(k_cache, v_cache, k, v, batch.out_slots, ks, vs)
        out = torch.empty_like(q)
        starts = [0]  # offsets of each request's new tokens, from host lengths (no device sync)
        for s, p in zip(batch.seq_lens_cpu, batch.prefix_lens_cpu):
            starts.append(starts[-1] + s - p)
        for i, (seq_len, prefix) in enumerate(zip(batch.seq_lens_cpu, batch.prefix_lens_cpu)):
            lo, hi = starts[i], starts[i + 1]
            slots = batch.req_to_slot[batch.req_rows[i], :seq_len].long()
            positions = torch.arange(prefix, seq_len, device=q.device)
            # FP8 cache: dequantized here (fp32 math with the scales; exact for 16/32-bit).
            kk, vv = k_cache[slots].float() * ks, v_cache[slots].float() * vs
            if not self.deterministic:
                out[lo:hi] = attend_reference(q[lo:hi], kk, vv, positions, self.scale)
                continue
            for j in range(hi - lo):
                p = prefix + j
                out[lo + j : lo + j + 1] = attend_reference(q[lo + j : lo + j + 1], kk[: p + 1], vv[: p + 1],
                                                            positions[j : j + 1], self.scale)
        return out
