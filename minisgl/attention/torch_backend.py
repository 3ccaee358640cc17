"""The torch reference backend: plain fp32 math over K/V gathered through the request table.
Runs on CPU and GPU; it is the path the CPU engine and the tests use, and the reference the
kernel backends are compared with.

Deterministic mode: one query token at a time over exactly its keys 0..p, so the matmul
shapes a token sees depend on its position alone (not on how many tokens share its step, nor
on the prefix/extend split); the BLAS then gives the same bits for the same token."""

from __future__ import annotations

import torch

from minisgl.attention.base import AttentionBackend
from minisgl.core.batch import ForwardBatch


def attend_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float,
    window: int = 0, sinks: torch.Tensor | None = None, key_start: int = 0,
) -> torch.Tensor:
    """q [n, Hq, D] at positions q_positions [n]; k, v [L, Hkv, D] for positions key_start ..
    key_start + L - 1. Causal: query at position p sees keys up to p, and with window W > 0
    only keys p - W + 1 .. p. sinks: [Hq] logits that join every softmax denominator (their
    weight is dropped). fp32 math; returns fp32 [n, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), kf) * scale
    key_pos = torch.arange(key_start, key_start + k.shape[0], device=q.device)
    mask = key_pos[None, :] > q_positions[:, None]
    if window > 0:
        mask |= key_pos[None, :] <= q_positions[:, None] - window
    scores.masked_fill_(mask[None], float("-inf"))
    if sinks is None:
        return torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), vf)
    sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hnl,lhd->nhd", probs, vf)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
        sinks: torch.Tensor | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = self.pool.k_cache(layer), self.pool.v_cache(layer)
        ks, vs = self.pool.k_scales[layer], self.pool.v_scales[layer]
        req_to_slot, out_slots = self.tables(layer, batch)
        self.wait_loaded(layer, batch)
        self.store(q, k, v, k_cache, v_cache, out_slots, ks, vs, rope)
        window = self.window_of(layer)
        out = torch.empty_like(q)
        starts = [0]  # offsets of each request's new tokens, from host lengths (no device sync)
        for s, p in zip(batch.seq_lens_cpu, batch.prefix_lens_cpu):
            starts.append(starts[-1] + s - p)
        for i, (seq_len, prefix) in enumerate(zip(batch.seq_lens_cpu, batch.prefix_lens_cpu)):
            lo, hi = starts[i], starts[i + 1]
            # A sliding layer reads only the keys its first new token can see: the slots of
            # older positions may already be freed (a window-sized pool).
            first = max(0, prefix - window + 1) if window > 0 else 0
            slots = req_to_slot[batch.req_rows[i], first:seq_len].long()
            positions = torch.arange(prefix, seq_len, device=q.device)
            # FP8 cache: dequantized here (fp32 math with the scales; exact for 16/32-bit).
            kk, vv = k_cache[slots].float() * ks, v_cache[slots].float() * vs
            if not self.deterministic:
                out[lo:hi] = attend_reference(q[lo:hi], kk, vv, positions, self.scale, window, sinks, first)
                continue
            for j in range(hi - lo):
                p = prefix + j
                lo_key = max(0, p - window + 1) if window > 0 else 0  # its keys alone: shapes by position
                keys = slice(lo_key - first, p + 1 - first)
                out[lo + j : lo + j + 1] = attend_reference(q[lo + j : lo + j + 1], kk[keys], vv[keys],
                                                            positions[j : j + 1], self.scale, window, sinks, lo_key)
        return out
