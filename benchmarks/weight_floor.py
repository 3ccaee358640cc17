"""Bytes of weights one decode step must read, for the bandwidth floors of profile_decode_step.py
and offline.py: every dense weight once; of the input embedding only the B rows looked up
(unless tied: then the LM head reads it all); of each MoE layer only the experts hit, which is
exactly top_k at batch 1 and E * (1 - (1 - top_k / E) ** B) expected at batch B when tokens
route uniformly (random dummy weights do, about)."""

from __future__ import annotations

import statistics

import torch


def expected_experts_hit(num_experts: int, top_k: int, batch: float) -> float:
    if batch <= 1:
        return float(top_k) if batch == 1 else 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_weight_bytes(model: torch.nn.Module, batch: float) -> float:
    """This rank's weight bytes read by a decode step of `batch` tokens."""
    cfg = model.cfg
    total = 0.0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if ".experts." in name:  # every per-expert tensor: weights, 4-bit scales and zeros, biases
            total += size / cfg.moe.num_experts * expected_experts_hit(cfg.moe.num_experts, cfg.moe.top_k, batch)
        elif name == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            total += min(batch, p.shape[0]) * p[0].numel() * p.element_size()
        else:
            total += size
    return total


def decode_kv_bytes(engine: object, context: int) -> float:
    """This rank's KV bytes one batch-1 decode step reads at `context` tokens: every full layer's
    K and V of the whole context, a sliding layer's of its window alone; a hybrid model's linear
    layers keep none (decode_state_bytes)."""
    from minisgl.kvcache.pool import KVPool

    cfg, pool = engine.model_config, engine.pool
    per_layer_token = KVPool.bytes_per_token_for(1, pool.kv_heads, pool.head_dim, pool.dtype)
    return float(sum(per_layer_token * min(context, cfg.window_of(i) or context)
                     for i in range(cfg.num_layers) if not cfg.is_linear_layer(i)))


def decode_state_bytes(engine: object) -> float:
    """This rank's recurrent-state bytes one batch-1 decode step reads and writes (a hybrid
    model's Gated DeltaNet layers: the request's conv and fp32 states, each read and written
    once); 0 for other models."""
    pool = getattr(engine, "state_pool", None)
    return 0.0 if pool is None else 2.0 * pool.bytes_per_slot


def read_bandwidth(device: torch.device, reps: int = 10) -> float:
    """Bytes/s of a 1 GiB fp32 sum on `device` (the read ceiling, measured now)."""
    src = torch.ones(1 << 28, dtype=torch.float32, device=device)
    src.sum()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        src.sum()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return src.numel() * 4 / statistics.median(times)
